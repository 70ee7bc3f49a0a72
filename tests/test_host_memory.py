"""sfcl.engine.host_memory: glibc's thresholds are set, and the switch turns it off."""

import subprocess
import sys

import pytest

CHECK = """
import ctypes, ctypes.util, sys
from sfcl.engine.host_memory import keep_freed_memory
ok = keep_freed_memory()
# after mallopt(M_MMAP_THRESHOLD, 32 MiB), a 3 MiB block comes from the heap: malloc_usable_size
# of an mmapped chunk is its page-rounded size minus the header, of a heap chunk the request + < 32
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
libc.malloc_usable_size.restype = ctypes.c_size_t
libc.free.argtypes = [ctypes.c_void_p]
n = 3 * 1024 * 1024 + 100
p = libc.malloc(n)
extra = libc.malloc_usable_size(p) - n
libc.free(p)
print(ok, extra)
"""


def _run(env_extra: dict) -> tuple[str, int]:
    import os

    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    ok, extra = out.stdout.split()
    return ok, int(extra)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_thresholds_set_put_a_3_mib_block_on_the_heap_and_the_switch_leaves_glibc_defaults():
    ok, extra = _run({"SFCL_MALLOC_TUNING": "1"})
    if ok != "True":
        pytest.skip("not glibc")
    assert extra < 64  # a heap chunk: the request rounded up to 16 bytes, plus at most one word
    ok, extra = _run({"SFCL_MALLOC_TUNING": "0"})
    assert ok == "False" and extra >= 100  # glibc's default: mmapped, rounded up to a whole page


FREEZE = """
import gc
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle alive at start-up
from sfcl.engine.host_memory import freeze_startup_objects
n = freeze_startup_objects()
frozen = gc.get_freeze_count()
tracked = len(gc.get_objects())  # what a full collection would still walk
print(n, frozen, tracked)
"""


@pytest.mark.parametrize("switch, frozen", [("1", True), ("0", False)])
def test_freeze_startup_objects_takes_them_out_of_later_collections(switch, frozen):
    """Frozen, the objects alive at start-up are in the permanent generation (a full collection
    walks none of them); ``SFCL_GC_FREEZE=0`` leaves the collector as it is."""
    import os

    env = {**os.environ, "SFCL_GC_FREEZE": switch}
    out = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    n, count, tracked = (int(x) for x in out.stdout.split())
    if frozen:
        assert n == count > 1000 and tracked < 100
    else:
        assert n == count == 0 and tracked > 1000


TRIM = """
import ctypes, ctypes.util
from sfcl.engine.host_memory import keep_freed_memory, return_freed_memory

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
ok = keep_freed_memory()
base = rss_mib()
blocks = [libc.malloc(1 << 20) for _ in range(200)]  # 200 MiB on the heap (below the mmap threshold)
for p in blocks:
    ctypes.memset(p, 1, 1 << 20)  # touch every page
held = rss_mib()
for p in reversed(blocks):
    libc.free(p)
kept = rss_mib()  # under the 1 GiB trim threshold freed memory stays mapped
released = return_freed_memory()
print(ok, released, round(held - base), round(kept - base), round(rss_mib() - base))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_return_freed_memory_hands_back_what_the_thresholds_keep():
    out = subprocess.run([sys.executable, "-c", TRIM], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ok, released, held, kept, after = out.stdout.split()
    if ok != "True":
        pytest.skip("not glibc")
    assert int(held) >= 190 and int(kept) >= 190  # the thresholds keep the freed 200 MiB mapped
    assert released == "True" and int(after) < 20  # malloc_trim(0) returned it
