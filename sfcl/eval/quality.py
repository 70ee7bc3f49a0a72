"""Shared pieces of the quality scripts that compare a cheaper numeric path against bf16
(``scripts/kv_int8_quality.py``: INT8 KV cache; ``scripts/weight_quant_quality.py``: weight-only
INT8/INT4): teacher-forced negative log-likelihood, NDA question prompts, greedy agreement."""

from __future__ import annotations

import torch

from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch

NDA_QUESTIONS = ("How long do the confidentiality obligations last?", "Which law governs this agreement?",
                 "Who are the parties to this agreement?", "What must the recipient do with confidential "
                 "information when the agreement ends?")


@torch.inference_mode()
def token_nll(model, args, ids: list[int], chunk: int, layer: int = 0, kv_dtype: str = "auto",
              keep_taps: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed ``ids`` in ``chunk``-token prefill chunks (every chunk after the first attends to the
    *stored* KV, in ``kv_dtype``). Returns each position's next-token negative log-likelihood
    ((len(ids) - 1,) float32 nats; position i predicts ids[i + 1]) and with ``keep_taps`` the hidden
    states after block ``layer`` ((len(ids) - 1, H) float32; else None). Raises ValueError when the
    positions would pass the model's context (len(ids) - 1 > ``args.max_position_embeddings``)."""
    model.fit_rope(len(ids) - 1, f"{len(ids)} tokens")
    kv = KVCache(args, 1, len(ids) + 16, model.embed_tokens.weight.dtype, kv_dtype=kv_dtype)
    nll, taps = [], []
    for a in range(0, len(ids) - 1, chunk):
        b = min(len(ids) - 1, a + chunk)
        out = model(torch.tensor([ids[a:b]]), AttnBatch(True, torch.tensor([0]), torch.arange(a, b), b), kv, layer,
                    all_positions=True, want_probs=False)
        logp = out.logits[0].float().log_softmax(-1)  # (T, V)
        tgt = torch.tensor(ids[a + 1:b + 1])
        nll.append(-logp.gather(1, tgt[:, None])[:, 0])  # (T,)
        if keep_taps:
            taps.append(out.tap_hidden[0].float())  # (T, H)
    return torch.cat(nll), torch.cat(taps) if keep_taps else None


def teacher_forced(model, args, ids: list[int], chunk: int, layer: int = 0, kv_dtype: str = "auto",
                   keep_taps: bool = False) -> tuple[float, int, torch.Tensor | None]:
    """:func:`token_nll` summed: the next-token negative log-likelihood of ``ids`` (nats), the token
    count, and with ``keep_taps`` the hidden states after block ``layer`` ((len(ids) - 1, H) float32;
    else None)."""
    nll, taps = token_nll(model, args, ids, chunk, layer, kv_dtype, keep_taps)
    return float(nll.double().sum()), nll.shape[0], taps


def nda_prompts(tokenizer, docs, n: int, chars: int = 3000) -> list[list[int]]:
    """Chat-template token ids of ``n`` questions (``NDA_QUESTIONS`` in turn) over the first
    ``chars`` characters of each document."""
    out = []
    for i, d in enumerate(docs[:n]):
        msg = d.text[:chars] + "\n\n" + NDA_QUESTIONS[i % len(NDA_QUESTIONS)]
        text = tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def greedy_agreement(tokenizer, ref: list[str], other: list[str]) -> dict:
    """Share of ``ref``'s tokens that ``other`` reproduces up to its first divergence, and the
    share of identical answers (one pair per prompt)."""
    agree, total, same = 0, 0, 0
    for x, y in zip(ref, other):
        tx, ty = tokenizer(x)["input_ids"], tokenizer(y)["input_ids"]
        k = 0
        while k < min(len(tx), len(ty)) and tx[k] == ty[k]:
            k += 1
        agree += k
        total += max(len(tx), 1)
        same += x == y
    return {"prompts": len(ref), "prefix_agreement": agree / total, "identical_answers": same / len(ref)}
