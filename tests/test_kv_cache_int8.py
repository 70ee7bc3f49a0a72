"""Adversarial: INT8 KV cache decode over never-written (uninitialized) memory.

``write_decode`` re-quantizes the block in progress from the full-precision key residual
``k_res``, masking the positions not yet filled by *multiplying* with 0. ``k_res`` comes from
``torch.empty``: a NaN/Inf bit pattern there gives 0 * NaN = NaN, the block's scale is NaN and
every later token is argmax(NaN) = token 0. Seen on a fresh ``sfcl serve --kv-cache-dtype int8``:
every answer was its first token followed by ``<|endoftext|>`` up to max_tokens.
"""

import torch

from sfcl.model.kv_cache import KVCache
from tests.test_kv_cache import ARGS, kv_pair


def test_int8_decode_ignores_garbage_in_the_key_residual():
    c = KVCache(ARGS, 2, 32, torch.float32, kv_dtype="int8", block_size=4)
    for t in c.k_res:
        t.fill_(float("nan"))  # what torch.empty may hold
    k, v = kv_pair(7)
    for layer in range(2):
        c.write_prefill(layer, 0, 0, k[:, :4], v[:, :4])  # ends on a block boundary: residual unused
    for t in (4, 5, 6):
        c.ensure_initialized(1, t + 1)
        for layer in range(2):
            c.write_decode(layer, torch.tensor([0]), torch.tensor([t]), k[None, :, t], v[None, :, t])
    for layer in range(2):
        kk, vv = c.read(layer, slice(0, 1), 7)
        assert torch.isfinite(kk).all() and torch.isfinite(vv).all()
        blk = k[:, 4:7]
        bound = blk.abs().amax(dim=1, keepdim=True) / 254 * 1.01 + 1e-6
        assert ((kk[0, :, 4:7] - blk).abs() <= bound).all()


def test_int8_engine_greedy_follows_bf16_on_a_short_prompt(lm):
    from sfcl.config import EngineConfig
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine

    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is a contract?"}],
                                            tokenize=False, add_generation_prompt=True)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = {}
    for kv in ("auto", "int8"):
        eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2, kv_cache_dtype=kv))
        for t in getattr(eng.runner.kv, "k_res", []):
            t.fill_(float("nan"))  # deterministic stand-in for uninitialized memory
        [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=8, temperature=0.0, snapshot_mode="off"))])
        out[kv] = "".join(e.text for e in ev if isinstance(e, TextDelta))
    assert out["int8"].split()[:3] == out["auto"].split()[:3], out
