"""HF transformers ``generate()`` as a benchmark peer, run in its own process
(``python -m sfcl.bench.hf_runner SPEC.json OUT.json``) so that its peak RSS is its own.

How requests map onto ``generate()`` (static batching, the way a plain transformers user serves):
at concurrency c the requests are taken c at a time, their chat prompts left-padded into one
batch, and one ``generate()`` call runs until every row has its tokens; the next batch starts
after that. So a request's TTFT is its batch's prefill + first step, and a short row waits for the
longest one. Times per step come from a ``StoppingCriteria`` that only records
``time.monotonic()`` (it is called once per generated token position, after the logits are
sampled). With ``ignore_eos`` every row generates exactly ``max_tokens`` (``min_new_tokens``);
without it a row's tokens end at its first EOS. Greedy decoding, KV cache on (transformers'
default ``DynamicCache``), SDPA attention (``attn``: "eager" to compare), weights dequantised from
the same GGUF (see ``load``).
Device: ``--device`` of the spec (CPU or CUDA); on CUDA ``torch.cuda.max_memory_allocated`` per job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def hf_state_dict(model, args) -> dict:
    """transformers-style state dict (``model.layers.N.self_attn.q_proj.weight`` ...) from our
    ``LlamaModel``: the inverse of ``sfcl.model.llama.load_weights`` (un-fuses qkv and gate/up)."""
    q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, blk in enumerate(model.layers):
        p, at = f"model.layers.{i}.", blk.self_attn
        for n, w in zip("qkv", at.qkv_proj.weight.split([q_out, kv_out, kv_out], 0)):
            sd[p + f"self_attn.{n}_proj.weight"] = w
        if args.attention_bias:
            for n, b in zip("qkv", at.qkv_proj.bias.split([q_out, kv_out, kv_out], 0)):
                sd[p + f"self_attn.{n}_proj.bias"] = b
        if args.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = at.q_norm.weight, at.k_norm.weight
        sd[p + "self_attn.o_proj.weight"] = at.o_proj.weight
        gate, up = blk.mlp.gate_up_proj.weight.chunk(2, 0)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = blk.mlp.down_proj.weight
        sd[p + "input_layernorm.weight"] = blk.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = blk.post_attention_layernorm.weight
    return {k: v.detach() for k, v in sd.items()}


def load(spec: dict):
    """(tokenizer, transformers model) with the same weights SFCL serves, dense in ``spec["dtype"]``.

    Why not ``from_pretrained(gguf_file=...)`` directly: transformers 5 keeps GGUF weights packed
    and dequantises inside every matmul (its own warning says so), which is 10x+ slower on a CPU
    than a dense model and not how a transformers user would serve. So the weights come from
    SFCL's loader (GGUF dequantised once, cached under ~/.cache/sfcl) and are copied into the
    transformers class named by the GGUF's config; the tokenizer and chat template are the same."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sfcl.config import default_cache_dir
    from sfcl.model.loader import load_model, resolve_model

    lm = load_model(spec.get("model"), dtype=torch.float32, device="cpu", cache_dir=default_cache_dir())
    src = resolve_model(spec.get("model"))
    kw = {"local_files_only": True, **({"gguf_file": src.gguf_file} if src.gguf_file else {})}
    cfg = AutoConfig.from_pretrained(src.folder, **kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=spec.get("attn", "sdpa"))
    missing, unexpected = model.load_state_dict(hf_state_dict(lm.model, lm.args), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if "lm_head.weight" in missing:
        model.tie_weights()
    tok = lm.tokenizer
    del lm
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = model.to(device=spec.get("device", "cpu"), dtype=getattr(torch, DTYPES[spec["dtype"]])).eval()
    return tok, model


def run_batch(tok, model, batch: list[list[dict]], max_tokens: int, ignore_eos: bool,
              temperature: float = 0.0) -> list[dict]:
    """One ``generate()`` over ``batch`` (chat messages each); returns one sample dict per row
    (fields of ``sfcl.bench.stats.RequestSample``, times in ms from the call). temperature > 0
    samples (top_p 1, no top-k cut, as the servers are asked); 0 is greedy."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
    enc = tok(texts, return_tensors="pt", padding=True).to(model.device)
    gc_eos = model.generation_config.eos_token_id
    eos = {tok.eos_token_id, *(gc_eos if isinstance(gc_eos, list) else [gc_eos])} - {None}
    B = len(batch)
    done = [False] * B
    times: list[list[float]] = [[] for _ in range(B)]
    start = time.monotonic()

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t = (time.monotonic() - start) * 1e3
            last = input_ids[:, -1].tolist()
            for i in range(B):
                if not done[i]:
                    times[i].append(t)
                    if not ignore_eos and last[i] in eos:
                        done[i] = True
            return torch.zeros(B, dtype=torch.bool, device=input_ids.device)

    gen_kw = dict(max_new_tokens=max_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([Clock()]),
                  pad_token_id=tok.pad_token_id)
    if temperature > 0:
        gen_kw.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
    if ignore_eos:
        gen_kw["min_new_tokens"] = max_tokens
    with torch.inference_mode():
        model.generate(**enc, **gen_kw)
    end = time.monotonic()
    n_prompt = int(enc["attention_mask"].sum(1).max())
    return [{"ttft_ms": t[0] if t else None, "e2e_ms": (end - start) * 1e3, "chunk_times_ms": t,
             "output_tokens": len(t), "tokens_from_usage": True, "prompt_tokens": n_prompt,
             "start_s": start, "end_s": end} for t in times]


def main(argv: list[str] | None = None) -> int:
    """SPEC.json: {"model", "dtype", "device", "threads", "ignore_eos", "jobs": [{"key", "concurrency",
    "max_tokens", "prompts": [messages...]}]}. Writes {"jobs": {key: {"samples", "wall_s",
    "gpu_mem_bytes"}}} to OUT.json."""
    import torch
    from tqdm import tqdm

    spec_path, out_path = (argv or sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    tok, model = load(spec)
    cuda = model.device.type == "cuda"
    run_batch(tok, model, [[{"role": "user", "content": "Hello"}]], 2, False)  # warm-up
    out = {"jobs": {}}
    for job in spec["jobs"]:
        c, prompts = int(job["concurrency"]), job["prompts"]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        samples, t0 = [], time.monotonic()
        bar = tqdm(total=len(prompts), desc=f"{spec['name']} {job['key']}", unit="req", leave=False)
        for i in range(0, len(prompts), c):
            got = run_batch(tok, model, prompts[i:i + c], int(job["max_tokens"]), bool(spec.get("ignore_eos")),
                            float(spec.get("temperature", 0.0)))
            samples += got
            bar.update(len(got))
        bar.close()
        out["jobs"][job["key"]] = {"samples": samples, "wall_s": time.monotonic() - t0,
                                   "gpu_mem_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None}
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
