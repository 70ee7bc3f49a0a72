import time, torch, torch.nn.functional as F
torch.manual_seed(0)
nh, nkv, hd, P, C = 9, 3, 64, 4096, 512
dt = torch.float32
q_all = torch.randn(1, nh, P, hd, dtype=dt); k_all = torch.randn(1, nkv, P, hd, dtype=dt); v_all = torch.randn(1, nkv, P, hd, dtype=dt)
def mask(T, start): return torch.ones(T, start+T, dtype=torch.bool).tril(diagonal=start)
def cur(q, k, v, start):
    T = q.shape[2]
    return F.scaled_dot_product_attention(q, k, v, is_causal=not start, enable_gqa=True, attn_mask=mask(T, start) if start else None)
def rep(x, g): return x.repeat_interleave(g, 1)
def split(q, k, v, start):
    T = q.shape[2]
    if not start: return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    g = nh // nkv
    fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kp, vp = rep(k[:, :, :start], g), rep(v[:, :, :start], g)
    kc, vc = rep(k[:, :, start:], g), rep(v[:, :, start:], g)
    o1, l1 = fa(q, kp, vp)[:2]; o2, l2 = fa(q, kc, vc, is_causal=True)[:2]
    m = torch.maximum(l1, l2); w1 = (l1 - m).exp(); w2 = (l2 - m).exp(); s = w1 + w2
    return (o1 * (w1/s)[..., None] + o2 * (w2/s)[..., None]).to(q.dtype)
def run(fn):
    outs=[]; t=time.perf_counter()
    for st in range(0, P, C):
        q = q_all[:, :, st:st+C]; k = k_all[:, :, :st+C]; v = v_all[:, :, :st+C]
        outs.append(fn(q, k, v, st))
    return time.perf_counter()-t, torch.cat(outs, 2)
for r in range(3):
    for name, fn in (("mask", cur), ("split", split)):
        t, o = run(fn); print(name, f"{t*1e3:.1f} ms per layer", flush=True)
_, a = run(cur); _, b = run(split); print("max diff", (a-b).abs().max().item())
full = F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True, enable_gqa=True)
print("vs one causal call", (a-full).abs().max().item(), (b-full).abs().max().item())
t=time.perf_counter(); F.scaled_dot_product_attention(q_all, k_all, v_all, is_causal=True, enable_gqa=True); print("one causal call", (time.perf_counter()-t)*1e3)
