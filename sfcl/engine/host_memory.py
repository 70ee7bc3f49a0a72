"""Host memory settings for the serving process: glibc's allocator thresholds, and Python's garbage
collector.

A decode step allocates the same large temporaries again and again: logits, softmax and their
kin are (B, V) float32, 3 MiB at 16 rows over a 49k vocabulary. glibc serves blocks above its
mmap threshold (dynamic, from 128 KiB) with a fresh ``mmap`` and unmaps them on free, and trims
the top of the heap when more than its trim threshold is free; either way the next step's
temporaries land on pages the kernel must fault in and zero again. On this project's CPU that
made the same token path (log-softmax, entropy, sampling for 16 rows) take 1.2-4.7 ms greedy and
3.6-5.6 ms at temperature 1 depending on the process, against 1.3 and 1.5-1.9 ms in every
process with the thresholds fixed (``scripts/profile_sampler.py``, 4 processes each).

``keep_freed_memory`` fixes both thresholds with ``mallopt(3)``: blocks up to 32 MiB (the
largest mmap threshold glibc accepts on 64-bit) come from the heap, and up to 1 GiB of freed heap
stays mapped for reuse. Fixing them also turns off glibc's dynamic threshold. The cost is
resident memory: freed temporaries are kept rather than returned to the kernel, so RSS stays
near its peak. ``SFCL_MALLOC_TUNING=0`` leaves glibc's defaults (as does a libc other than glibc).

``freeze_startup_objects`` moves every object alive once the server has loaded (model, tokenizer,
library, the web framework: ~263,000 tracked objects for the default server) into the
collector's permanent generation (``gc.freeze``, Python >= 3.7), so that no later collection
traverses them. A full collection took 116-162 ms in the default server and ran while it served
(two unfrozen served runs saw one at 127 and one at 162 ms); frozen, 2.6-2.75 ms served and ~0.1 ms
in process (thirteenth session, ``docs/performance-journal.md``). Such a pause
lands on whichever thread allocates: the engine thread between two steps, or the event loop
holding the GIL while the engine waits for it. The cost: an object alive at start-up that later
becomes cyclic garbage is never collected (reference counting still frees everything else);
a server's start-up objects live as long as the server. A reloaded anchor library is not one of
them: after a reload the start-up library's ``Snapshotter`` and index are freed, frozen or not
(8 reloads in process, RSS flat). ``SFCL_GC_FREEZE=0`` leaves the collector as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os

log = logging.getLogger("sfcl.engine")

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def _glibc(name: str, argtypes: list, restype=ctypes.c_int):
    """glibc's function ``name`` with its C signature set, or None where the C library has none
    (musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring). Returns True when both
    were set; False when turned off by ``SFCL_MALLOC_TUNING=0``, when the C library is not glibc,
    or when ``mallopt`` refused a value. Never raises."""
    if os.environ.get("SFCL_MALLOC_TUNING", "1").strip() == "0":
        return False
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:  # not glibc: nothing to tune
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.warning("mallopt refused the allocator thresholds; glibc's defaults stay")
    return ok


def return_freed_memory() -> bool:
    """``malloc_trim(0)``: hand the heap's free pages back to the kernel, in every arena, whatever
    the trim threshold (``keep_freed_memory`` keeps up to 1 GiB mapped for the decode step's
    temporaries). For after a one-off release of a large structure, such as an anchor reload:
    without it each reload kept the old library's freed index memory mapped (RSS +72 MiB over 8
    SIGHUP reloads of the default library, then flat; Intel Xeon, 2026-12-05). Returns True when
    memory was released, False when none was or the C library is not glibc. Never raises."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return trim is not None and trim(0) == 1


def freeze_startup_objects() -> int:
    """``gc.collect()`` then ``gc.freeze()`` (see the module docstring): call once in a serving
    process after the engine and the app are built, not in a process that goes on creating and
    dropping engines (tests). Returns the number of objects frozen; 0 when turned off by
    ``SFCL_GC_FREEZE=0``. Never raises."""
    if os.environ.get("SFCL_GC_FREEZE", "1").strip() == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
