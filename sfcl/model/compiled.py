"""Compiled decode step (``sfcl serve --compile``): ``torch.compile`` (TorchInductor) of
``LlamaModel.forward_step`` for steps that only decode.

Why: at batch 1 on CPU an eager decode step of a small model is dominated by ~3,000 operator
dispatches (RMSNorm, RoPE, attention and residual element-wise ops of every layer), not by the
GEMVs. Inductor fuses the element-wise ops into generated C++ loops and removes the Python and
dispatcher overhead between them; the GEMMs stay library calls. The step is compiled with dynamic
shapes (``dynamic=True``), so the batch size B and the attended length S are symbolic: in practice
a few graphs cover every decode step (B = 1, which Inductor specialises, B >= 2, and the full
batch), compiled at warm-up, and a new length never recompiles. With ``--weight-quant`` the
packed/dense kernel switch of ``sfcl.model.quant.QuantLinear`` (B <= max_rows) is a guard on B,
so one more graph covers B > max_rows (measured with TORCH_LOGS=recompiles over batches mixing
every size 1..16: no recompiles after warm-up). Steps that carry prompt chunks run eager (their
structure varies step to step; they are few in steady decoding), like vLLM, which captures only
decode batches.

Per step, what is left around the kernels is kept small: Dynamo checks no guards on the model's
modules (``_guard_filter``) and, on CPU, Inductor's C++ wrapper calls the kernels
(``compile_options``). Compilation happens in ``warmup()`` (about 5 min on 2 CPU cores the first
time, once per process; Inductor caches generated code under /tmp/torchinductor_$USER, so a
restart takes ~35 s) so no request pays it.
Requires a C++ compiler on CPU (Inductor's C++ backend). The block-wise INT8 KV path has
data-dependent Python control flow and stays eager (``CompiledDecode`` refuses it).

Off by default (``sfcl serve --compile`` turns it on). The rule was: on by default only if its
start-up cost is cached and bounded, since a first ``sfcl serve`` must answer within 3 minutes.
It is cached (~35 s on later starts) but not bounded: the first compile alone takes ~2.6 min
without and ~5.4 min with the C++ wrapper on 2 cores (156 / 324 s, ``compile_options``), on top
of loading the model and building the default anchor library, and much longer on a shared
machine (a first compile under a load average of ~18 on the 2-core AVX2 EPYC had not finished
after 30 minutes). Compiling on a background thread while serving eagerly would take those
minutes of both cores from the requests being served. What it would buy is the eager step's
operator overhead: on the AVX2 EPYC about a third of a batch-1 int4 decode step's CPU time was
outside the GEMM / GEMV kernels (``torch.profiler`` over ``LlamaModel.forward_step``), after the
eager path was trimmed from 2,494 to 1,526 operators per step (``sfcl.model.llama``).
"""

from __future__ import annotations

import functools
import logging
import time
import types

import torch
import torch._dynamo

from sfcl.model.llama import AttnBatch, LlamaModel, StepBatch, StepOut

log = logging.getLogger("sfcl.engine")


def _guard_filter(entries) -> list[bool]:
    """Dynamo guard filter: drop the guards on the model's modules, keep those on the step's
    inputs and the KV cache (shapes, dtypes, the B and S buckets).

    Why: with the modules inlined, Dynamo guards every attribute of every layer (about 5,000
    guards for 30 layers); checking them took 1.1 ms of each 11 ms decode step at batch 1
    (profiled, ``TorchDynamo Cache Lookup``), 0.3 ms after. Safe here because the model is not
    changed after compilation (quantization runs before; serving never edits weights or modules)
    and each ``CompiledDecode`` compiles its own code object (``_private_function``), so another
    model's graphs are never looked up against this model. This is torch's own
    ``skip_guard_on_all_nn_modules_unsafe`` policy."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)


def compile_options(device: torch.device | str) -> dict:
    """``torch.compile`` options of the decode step. On CPU, Inductor's C++ wrapper
    (``cpp_wrapper``): the generated step calls its ~600 kernels from C++ rather than from a
    Python function, which took 0.35-0.57 ms off a batch-1 step (SmolLM2-135M int4, 1 thread,
    200 positions, timed against the guard filter alone in one process) and doubles the first
    compile (324 vs 156 s for all batch sizes on 2 cores)."""
    opts = {"guard_filter_fn": _guard_filter}
    if torch.device(device).type == "cpu":
        opts["cpp_wrapper"] = True
    return opts


def _private_function(fn):
    """A copy of ``fn`` with its own code object. Dynamo traces a ``functools.partial`` through a
    wrapper of torch's (``torch._dynamo.external_utils.inner``) whose cache holds the graphs of
    every model compiled in the process (tests, ``sfcl bench``), and tells them apart by a guard on
    the wrapped function's code object (``___check_obj_id(fn.func.__code__)``, TORCH_LOGS=recompiles,
    torch 2.13): with module guards filtered out (``_guard_filter``), two models sharing one code
    object could run each other's graphs. (``isolate_recompiles`` gives each compile its own
    recompile count; the graphs still live in that one cache.)"""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)  # a new, equal code object
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return new


def dummy_decode_step(B: int, S: int, device: torch.device | str = "cpu") -> StepBatch:
    """A decode-only step of rows [0, B) each attending to S cache positions (the new token at
    position S - 1), built as the runner builds one (for warm-up and timing). Every tensor is
    fresh: positions and decode.positions are distinct, because Dynamo guards on aliasing between
    inputs and a warm-up that aliased them recompiled later."""
    pos = torch.full((B,), S - 1, dtype=torch.long, device=device)
    return StepBatch(positions=pos.clone(), chunks=[], sample_index=torch.arange(B, device=device),
                     decode=AttnBatch(is_prefill=False, slots=torch.arange(B, device=device), positions=pos,
                                      kv_len=S, mask=torch.ones(B, 1, 1, S, dtype=torch.bool, device=device),
                                      slot_range=(0, B)))


class CompiledDecode:
    """Callable like ``model.forward_step(ids, step, kv, tap_layer)`` for decode-only steps.

    Raises ValueError for an INT8 KV cache, RuntimeError (from Inductor) when no C++ compiler
    is available. Must be called with autograd off (``torch.no_grad()``), not under
    ``torch.inference_mode()``: Inductor cannot trace in-place KV writes to inference tensors.
    """

    def __init__(self, model: LlamaModel, kv):
        if kv.int8:
            raise ValueError("--compile works with the bf16/fp32 KV cache; the INT8 KV cache runs eager")
        self.model, self.kv = model, kv
        # without inference_mode; a private code object, so these graphs and guards are this model's alone
        raw = functools.partial(_private_function(LlamaModel.forward_step.__wrapped__), model)
        # isolate_recompiles: torch.compile of a callable that is not a Module traces it through one
        # wrapper function of torch's (torch._dynamo.external_utils.inner), whose code object keeps
        # every such compile's graphs; without it, the ninth graph compiled in a process (the
        # fourth engine of a test run) hit torch._dynamo.config.recompile_limit (8) and that engine's
        # "compiled" decode silently ran eager (TORCH_LOGS=recompiles, torch 2.13)
        self.fn = torch.compile(raw, dynamic=True, options=compile_options(kv.k[0].device),
                                isolate_recompiles=True)
        self.compile_s = 0.0
        self.calls = 0  # decode steps served by the compiled graphs (warm-up included)
        self.uncompiled: list[int] = []  # warm-up batch sizes that run eager: Dynamo compiled no graph for them
        self.graph_breaks = 0  # graph breaks Dynamo met while compiling the warm-up's graphs

    def __call__(self, ids: torch.Tensor, step: StepBatch, tap_layer: int) -> StepOut:
        if step.chunks:
            raise ValueError("CompiledDecode runs decode-only steps")
        self.calls += 1
        d = step.decode
        mark = torch._dynamo.mark_dynamic
        if ids.shape[1] >= 2:  # B: symbolic from the first compile (size 1 is always specialised)
            for t in (ids, step.positions, step.sample_index, d.positions, d.slots, d.mask):
                mark(t, 1 if t is ids else 0)
        if d.mask.shape[3] >= 2:  # S, the attended length
            mark(d.mask, 3)
        return self.fn(ids, step, self.kv, tap_layer)

    @torch.no_grad()
    def batch_buckets(self) -> list[int]:
        """Batch sizes compiled at warm-up: 1 (specialised), 2 (generic), the full batch
        (measured: without it the first full batch recompiled once, mid-serving) and, with
        ``--weight-quant``, the first size past the packed-kernel cut (``max_rows + 1``: the
        packed/dense switch is a guard on B, so each side gets its own graph)."""
        cuts = {m.max_rows + 1 for m in self.model.modules() if hasattr(m, "max_rows")}
        return sorted(b for b in {1, 2, self.kv.n_slots} | cuts if 1 <= b <= self.kv.n_slots)

    @torch.no_grad()
    def warmup(self, tap_layer: int, batch_sizes: list[int] | None = None, S: int = 32) -> float:
        """Compile every graph decode will use (``batch_buckets()``) on dummy rows attending to
        S positions (S >= 2, so the length is compiled symbolic, not specialised to 1); returns
        seconds. Batch sizes Dynamo did not compile (it fell back to eager) are left in
        ``uncompiled``, and the graph breaks Dynamo met in ``graph_breaks``. Writes position S-1 of KV rows [0, max(batch_sizes)): harmless, rows are
        rewritten by every prefill before they are read."""
        t0 = time.perf_counter()
        dev = self.kv.k[0].device
        frames, breaks = torch._dynamo.utils.counters["frames"], torch._dynamo.utils.counters["graph_break"]
        self.uncompiled = []
        breaks0 = sum(breaks.values())
        for i, B in enumerate(batch_sizes or self.batch_buckets()):
            self.kv.ensure_initialized(B, S)
            tried, ok = frames["total"], frames["ok"]
            self(torch.zeros(1, B, dtype=torch.long, device=dev), dummy_decode_step(B, S, dev), tap_layer)
            # Dynamo counts a frame it tried to compile in "total", one it compiled in "ok": tried and
            # not compiled (a recompile limit, an error it suppressed) runs eager, and so does every
            # later miss (Dynamo stops trying: "RUN_ONLY"); no try at all is otherwise a cache hit,
            # except on the first call, which this region has never compiled (Dynamo off)
            if frames["ok"] == ok and (frames["total"] > tried or i == 0 or self.uncompiled):
                self.uncompiled.append(B)
        self.graph_breaks = sum(breaks.values()) - breaks0
        self.compile_s = time.perf_counter() - t0
        return self.compile_s
