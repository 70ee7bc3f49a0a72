# Scratch timing of the twenty-sixth session: an MLP over 4,096 bf16 rows in one GEMM pair against row blocks of
# 256-2,048 rows (so that gate_up stays in L2), 2 threads, Intel Xeon AMX. Not kept: see mlp_row_blocks.txt.
import time, torch
from sfcl.model import decode_kernel
decode_kernel.load(verbose=False)
torch.manual_seed(0)
N,H,I=4096,576,1536
x=torch.randn(N,H).bfloat16(); Wgu=(torch.randn(2*I,H)*0.04).bfloat16(); Wd=(torch.randn(H,I)*0.03).bfloat16()
h=torch.randn(N,H).bfloat16()
def full():
    hh=h.clone(); hh.addmm_(torch.ops.sfcl.silu_mul(torch.mm(x,Wgu.t())), Wd.t()); return hh
def blocked(B):
    def f():
        hh=h.clone()
        for a in range(0,N,B):
            hh[a:a+B].addmm_(torch.ops.sfcl.silu_mul(torch.mm(x[a:a+B],Wgu.t())), Wd.t())
        return hh
    f.__name__=f"blocked{B}"; return f
fs=[full]+[blocked(B) for B in (256,512,1024,2048)]
for rep in range(3):
    for f in fs:
        for _ in range(2): f()
        t=time.perf_counter()
        for _ in range(20): f()
        print(rep, f.__name__, f"{(time.perf_counter()-t)/20*1e3:.2f} ms", flush=True)
print((full().float()-blocked(512)().float()).abs().max())
