"""CUDA-graph capture and replay of a function of static input buffers, one graph per shape key,
applied from outside the model, with an eager switch.

Why: at small batch a decode step is hundreds of tiny kernels; on a fast GPU the CPU cannot launch
them as fast as the GPU runs them, so the step is launch-bound. Recording the step once as a
``torch.cuda.CUDAGraph`` and replaying it removes the per-kernel launch cost (the approach of
vLLM's ``CUDAGraphRunner`` and gpt-fast's ``decode_one_token`` under ``torch.compile(mode=
"reduce-overhead")``). The model code is not changed: the caller's function calls
``LlamaModel.forward`` on static tensors.

A graph replays fixed shapes and fixed memory addresses, so each key (e.g. padded batch size and
KV-length bucket) gets its own static input buffers, written in place before every run, and the
outputs of a replay are static buffers that the next replay of the same key overwrites (copy what
must outlive it). All graphs share one memory pool. Capture happens lazily on a key's first run,
after ``warmup`` eager runs on a side stream (cuBLAS handles, allocator), with the static inputs
at the values ``make_inputs`` gave them: those must be harmless to run (the engine's decode sends
every row's KV write to the cache's scratch row then).

``GraphCache(device, capture=False)`` — or any non-CUDA device — runs exactly the same function on
exactly the same static buffers, eagerly, every time. That is the path the CPU tests exercise
(``tests/test_graph_runner.py``); capture itself is tested in ``tests/gpu/``.

If a capture fails (an operation that cannot be captured, e.g. a hidden host sync), the cache logs
a warning, remembers the error in ``failed`` and runs eagerly from then on: serving keeps working,
only slower. Used by ``sfcl.engine.graph_runner.DecodeGraphRunner`` (engine thread only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

log = logging.getLogger("sfcl.cuda_graph")

Buffers = dict[str, torch.Tensor]


@dataclass(slots=True)
class _Entry:
    inputs: Buffers  # static input buffers of this key (device tensors, written in place)
    graph: "torch.cuda.CUDAGraph | None" = None  # None: run eagerly on the same buffers
    outputs: Buffers | None = None  # the captured graph's output buffers


class GraphCache:
    """Run ``fn(inputs) -> outputs`` per key on static buffers, captured as a CUDA graph when
    enabled.

    device: where the buffers live. capture: record graphs (ignored, i.e. False, off CUDA).
    warmup: eager runs before a capture. max_graphs: keys captured at most; further keys run
    eagerly on their static buffers (a cap on capture time and pool memory).
    """

    def __init__(self, device: str | torch.device, *, capture: bool = True, warmup: int = 2, max_graphs: int = 256):
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        self.warmup, self.max_graphs = max(1, int(warmup)), int(max_graphs)
        self._entries: dict[Hashable, _Entry] = {}
        self._pool = None
        self.failed: str | None = None  # error of a failed capture (then everything runs eagerly)
        self.replays = 0  # runs served by a graph replay (for tests and stats)
        self.eager_runs = 0  # runs executed eagerly on the static buffers

    @property
    def captured(self) -> list[Hashable]:
        """Keys with a captured graph, sorted."""
        return sorted(k for k, e in self._entries.items() if e.graph is not None)

    def run(self, key: Hashable, make_inputs: Callable[[], Buffers], fill: Callable[[Buffers], None],
            fn: Callable[[Buffers], Buffers]) -> tuple[Buffers, bool]:
        """Fill ``key``'s static inputs (``fill`` writes them in place) and run ``fn`` on them.

        make_inputs: builds the static input buffers of a new key, at harmless values (they are
        what warm-up and capture run on). Returns (outputs, replayed): with ``replayed`` True the
        outputs are the graph's static buffers, valid until the next run of the same key.
        """
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry(inputs=make_inputs())
            if self.capture and sum(x.graph is not None for x in self._entries.values()) < self.max_graphs:
                self._capture(e, fn)
        fill(e.inputs)
        if e.graph is not None:
            e.graph.replay()
            self.replays += 1
            return e.outputs, True
        self.eager_runs += 1
        return fn(e.inputs), False

    def _capture(self, e: _Entry, fn: Callable[[Buffers], Buffers]) -> None:
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS handles, allocator)
                for _ in range(self.warmup):
                    fn(e.inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work during a capture (an anchor reload uploading
            # its device index from an HTTP worker) must not invalidate it, nor fail itself
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn(e.inputs)
            if self._pool is None:
                self._pool = graph.pool()
            e.graph, e.outputs = graph, out
        except Exception as err:  # noqa: BLE001 - any capture failure: degrade to eager, keep serving
            self.failed = f"{type(err).__name__}: {err}"
            self.capture = False
            log.warning("CUDA-graph capture failed, decode runs eagerly from now on: %s", self.failed)
