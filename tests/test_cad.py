"""The no-document side sequences of CAD (sfcl.snapshot.cad.ContextFreeSequences) on the real
model: catching up in pieces gives the logits of one forward over the whole sequence."""

from __future__ import annotations

import torch

from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch
from sfcl.snapshot.cad import ContextFreeSequences


def full_logits(lm, ids):
    kv = KVCache(lm.args, 1, len(ids) + 1, next(lm.model.parameters()).dtype, "cpu")
    b = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(len(ids)), kv_len=len(ids))
    return lm.model(torch.tensor([ids]), b, kv, 0, want_probs=False).logits[0].float()


def test_side_sequences_catch_up_incrementally_and_release_their_slot(lm_fp32):
    """In float32 whatever the CPU: in bf16 a token fed in a later piece rounds differently from
    the same token inside one whole-sequence forward (logits ~0.1 apart), beyond what 1e-3 allows."""
    lm = lm_fp32
    dtype = next(lm.model.parameters()).dtype
    side = ContextFreeSequences(lm.model, lm.args, n_slots=2, max_len=64, dtype=dtype, device="cpu")
    a = lm.tokenizer("Question: how long is the term? Answer: The term is", add_special_tokens=False)["input_ids"]
    b = lm.tokenizer("Which law governs? Answer:", add_special_tokens=False)["input_ids"]
    first = side.logits([("ra", a[:-3]), ("rb", b)])  # two rows, one forward
    assert torch.allclose(first[1], full_logits(lm, b), atol=1e-3)
    later = side.logits([("ra", a)])[0]  # only the 3 new tokens are fed
    assert side.seqs["ra"].fed == len(a)
    assert torch.allclose(later, full_logits(lm, a), atol=1e-3)
    assert torch.equal(side.logits([("ra", a)])[0], later) and side.seqs["ra"].fed == len(a)  # nothing new: kept
    assert side.logits([("rc", a)]) == [None]  # both slots taken: no CAD for a third request
    side.release("rb")
    assert side.logits([("rc", a)])[0] is not None
    assert side.logits([("rd", list(range(100)))]) == [None]  # longer than max_len
