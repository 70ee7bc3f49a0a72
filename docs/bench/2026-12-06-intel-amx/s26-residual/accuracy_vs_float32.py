# Scratch check of the twenty-sixth session (run from the repository root: python docs/bench/2026-12-06-intel-amx/s26-residual/accuracy_vs_float32.py):
# the anchor pass in bf16 with the residual adds inside the GEMMs and after them, each against the pass in float32,
# over 8 windows of 1,024 tokens of ContractNLI dev documents 10-19.
import torch
from sfcl.config import contractnli_path
from sfcl.anchors.corpus import read_corpus
from sfcl.anchors import model_pass, builder
from sfcl.anchors.model_pass import run_windows
from sfcl.model.loader import load_model
from sfcl.model import decode_kernel
decode_kernel.load(verbose=False)
docs = read_corpus([str(contractnli_path())])
ref = load_model(None, dtype="float32")
ids = ref.tokenizer(" ".join(d.text for d in docs[10:20]), add_special_tokens=False)["input_ids"]
W = 1024; wins = [ids[i*W:(i+1)*W] for i in range(8)]
layer = builder.default_layer(ref.args.n_layers)
r = run_windows(ref.model, wins, layer, 8)
del ref
lm = load_model(None, dtype="bfloat16")
def cat(o, f): return torch.cat([getattr(x, f) for x in o])
for flag in (True, False):
    model_pass.RESIDUAL_IN_GEMM = flag
    o = run_windows(lm.model, wins, layer, 8)
    cos = torch.nn.functional.cosine_similarity(cat(o, "hidden"), cat(r, "hidden"), dim=-1)
    agree = (cat(o, "top_ids")[:, 0] == cat(r, "top_ids")[:, 0]).float().mean()
    ds = (cat(o, "surprisal") - cat(r, "surprisal")).abs().mean()
    print(f"residual_in_gemm={flag}: tap cos vs fp32 mean {cos.mean():.6f} min {cos.min():.4f}; top1 agree {agree:.4f}; |dsurprisal| {ds:.4f}")
