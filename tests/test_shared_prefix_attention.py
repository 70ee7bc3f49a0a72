"""Shared-prefix decode attention (``Attention._grouped_decode``): rows whose cache rows hold the same
prefix KV read it once per group, and get the attention output and weights of the plain batched
decode; the engine plans such groups for questions about one document and answers them as it would
without them."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, "auto"), (torch.float32, "auto"),
                                             (torch.float32, "int8")])
def test_grouped_decode_equals_the_plain_batched_decode(lm, dtype, kv_dtype):
    """6 rows: rows 0, 2, 3 share 32 positions (a group that is not a slice), rows 4, 5 share 16
    (a slice), row 1 shares nothing; lengths differ, so masks apply past each row's own end."""
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import Attention, AttnBatch, RowGroup

    a = lm.args
    attn = Attention(a)
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    B, S = 6, 50
    kv = KVCache(a, B, 64, dtype, kv_dtype=kv_dtype)
    kv.ensure_initialized(B, 64)
    lens = torch.tensor([50, 41, 37, 44, 29, 48])
    prefix = {0: 32, 2: 32, 3: 32, 4: 16, 5: 16}
    src = {0: 0, 2: 0, 3: 0, 4: 4, 5: 4}
    for pos in range(S - 1):  # history: shared positions are the source row's values
        k, v = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
        for r, P in prefix.items():
            if pos < P:
                k[r], v[r] = k[src[r]], v[src[r]]
        kv.write_decode(0, torch.arange(B), torch.full((B,), pos), k, v)
    for r, P in prefix.items():  # identical stored bytes, INT8 scales included
        kk, vv = kv.read(0, slice(r, r + 1), P)
        k0, v0 = kv.read(0, slice(src[r], src[r] + 1), P)
        assert torch.equal(kk, k0) and torch.equal(vv, v0)
    q = torch.randn(B, nh, hd, generator=gen).to(dtype)
    k, v = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    mask = (torch.arange(S)[None, :] < lens[:, None]).view(B, 1, 1, S)

    def run(groups):
        batch = AttnBatch(is_prefill=False, slots=torch.arange(B), positions=lens - 1, kv_len=S, mask=mask,
                          slot_range=(0, B), groups=groups)
        return attn.decode_attn(q, k, v, batch, kv, 0, True)

    o_ref, p_ref = run(None)
    groups = [RowGroup(torch.tensor([0, 2, 3]), None, 0, 32), RowGroup(torch.tensor([4, 5]), slice(4, 6), 4, 16),
              RowGroup(torch.tensor([1]), slice(1, 2), 1, 0)]
    o, p = run(groups)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(p, p_ref, **tol)
    assert (p.view(B, nh, S)[4, :, 29:] == 0).all()  # masked positions still weigh exactly 0


def test_an_int8_read_of_a_partial_block_is_refused(lm):
    from sfcl.model.kv_cache import KVCache

    kv = KVCache(lm.args, 2, 64, torch.float32, kv_dtype="int8")
    with pytest.raises(ValueError, match="block boundary"):
        kv.read(0, slice(0, 1), 40, start=8)


def test_questions_about_one_document_decode_in_a_group_and_answer_as_without_it(lm_fp32):
    """Eight greedy questions about one document through the real engine: the first computes the
    document, the others wait for its blocks and restore them, their decode rows form groups, and
    every answer equals the answer of an engine that plans no groups.

    In float32, whatever the CPU: the grouped path sums its attention output in two parts, so in
    bf16 (the default on an AVX-512 BF16 CPU) a near tie may go the other way (seen on an AMD EPYC
    with avx512_bf16: one of 96 tokens)."""
    from sfcl.config import EngineConfig
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine

    lm = lm_fp32

    doc = " ".join(f"Clause {i}. The receiving party shall keep the information of clause {i} secret for "
                   f"{i + 2} years." for i in range(1, 25))
    prompts = [lm.tokenizer(f"{doc}\n\nQuestion {j}: how long for clause {j + 3}?")["input_ids"] for j in range(8)]

    def answers(shared: bool) -> tuple[list[str], list]:
        eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=8, shared_prefix_attention=shared))
        seen, execute = [], eng.runner.execute

        def spy(plan):
            seen.append([(g.rows, g.shared) for g in plan.decode_groups])
            return execute(plan)
        eng.runner.execute = spy
        evs = run_to_completion(eng, [(p, SamplingParams(max_tokens=12, snapshot_mode="off")) for p in prompts])
        return ["".join(e.text for e in ev if isinstance(e, TextDelta)) for ev in evs], seen

    grouped, seen = answers(True)
    assert max(len(r) for step in seen for r, _ in step) == 8  # the one that computed the document and the seven that restored it
    assert all(P % 16 == 0 and P >= 16 * 16 for step in seen for _, P in step)
    plain, seen = answers(False)
    assert not any(seen) and all(grouped) and grouped == plain
