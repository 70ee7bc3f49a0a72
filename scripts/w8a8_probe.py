"""Probe: int8 weights x int8 activations (W8A8) on FBGEMM's dynamic int8 GEMM, per layer type.

    python scripts/w8a8_probe.py [--docs 4] [--tokens 384] [--threads 1]

Not a serving format (see docs/performance-journal.md, 2026-12-04): it measured what W8A8 would
cost in quality on this model before anyone builds on it. ``torch.ops.quantized.linear_dynamic``
quantizes its whole input with one scale; here each row is divided by its max |x| and two columns
(+1, -1; zero weights) are appended, so every batch spans [-1, 1] and a row's result does not
depend on the rows batched with it (checked below). Prints the teacher-forced NDA perplexity of the
float model and its change with W8A8 in one layer type at a time (qkv, o, gate_up, down, lm_head)
and in all of them, and the time of one [M x 576] . [576 x 1536] product against FBGEMM fp16.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings

import torch
from torch import nn

from sfcl.anchors.corpus import read_corpus
from sfcl.config import contractnli_path, default_cache_dir
from sfcl.eval.quality import teacher_forced
from sfcl.model.loader import load_model
from sfcl.model.quant import Fp16Linear, quantize_int8


class W8A8Linear(nn.Module):
    """x (M, K) fp32 -> (M, N) fp32; int8 per-channel weights, int8 per-row activations (7-bit grid)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.N, self.K = weight.shape
        q, s = quantize_int8(weight)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(torch.cat([q, q.new_zeros(self.N, 2)], 1), s.double(),
                                                          torch.zeros(self.N, dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.K).float()
        r = torch.linalg.vector_norm(x2, float("inf"), dim=1, keepdim=True).clamp_(min=1e-30)  # (M, 1)
        xp = torch.cat([x2 / r, x2.new_tensor([[1.0, -1.0]]).expand(x2.shape[0], 2)], 1)  # rows span [-1, 1]
        y = torch.ops.quantized.linear_dynamic(xp, self.packed, True) * r
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    w = torch.randn(1536, 576) * 0.05
    lin, f16 = W8A8Linear(w, None), Fp16Linear(w, None)
    x = torch.randn(16, 576)
    x[3] *= 50  # one loud row must not change the others
    alone = torch.cat([lin(x[i:i + 1]) for i in range(16)])
    print(f"batch invariant: {torch.equal(alone, lin(x))}; relative error vs fp32 "
          f"{float(((lin(x) - x @ w.t()).norm(dim=1) / (x @ w.t()).norm(dim=1)).max()):.4f}")
    for M in (1, 16, 256):
        xm = torch.randn(M, 576)
        ts = {}
        for name, f in (("w8a8", lin), ("fp16", f16)):
            for _ in range(10):
                f(xm)
            t = time.perf_counter()
            for _ in range(200):
                f(xm)
            ts[name] = (time.perf_counter() - t) / 200 * 1e6
        print(f"[{M} x 576] . [576 x 1536]: w8a8 {ts['w8a8']:.0f} us, fp16 {ts['fp16']:.0f} us")

    lm = load_model(None, dtype="auto", cache_dir=default_cache_dir())
    docs = read_corpus(str(contractnli_path()))[:a.docs]
    idss = [lm.tokenizer(d.text, add_special_tokens=False)["input_ids"][:a.tokens] for d in docs]

    def ppl(model) -> float:
        tot = n = 0
        for ids in idss:
            t, k, _ = teacher_forced(model, lm.args, ids, a.tokens)
            tot, n = tot + t, n + k
        return math.exp(tot / n)

    base = ppl(lm.model)
    print(f"perplexity, {sum(map(len, idss))} tokens of {len(idss)} NDAs: float {base:.3f}")
    kinds = {"qkv": ["self_attn.qkv_proj"], "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_up_proj"],
             "down": ["mlp.down_proj"], "lm_head": [], "all": ["self_attn.qkv_proj", "self_attn.o_proj",
                                                             "mlp.gate_up_proj", "mlp.down_proj"]}
    for name, targets in kinds.items():
        m = copy.deepcopy(lm.model)
        if name in ("lm_head", "all"):
            m.lm_head = W8A8Linear(m.lm_head.weight.data, None)
        for blk in m.layers:
            for t in targets:
                part, attr = t.split(".")
                old = getattr(getattr(blk, part), attr)
                setattr(getattr(blk, part), attr, W8A8Linear(old.weight.data, old.bias))
        p = ppl(m)
        print(f"  W8A8 {name}: {p:.3f} ({100 * (p / base - 1):+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
