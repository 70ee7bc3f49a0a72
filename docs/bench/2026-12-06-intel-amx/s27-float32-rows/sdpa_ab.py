import time, torch, torch.nn.functional as F, sys
exec(open('/work/scratch/sdpa_split.py').read().split("for r in range(3)")[0].replace("dt = torch.float32", f"dt = torch.{sys.argv[1]}"))
ts = {"mask": [], "split": []}
for r in range(6):
    for name, fn in (("mask", cur), ("split", split)) if r % 2 == 0 else (("split", split), ("mask", cur)):
        t, o = run(fn); ts[name].append(t * 1e3)
for k, v in ts.items(): print(sys.argv[1], k, " ".join(f"{x:.0f}" for x in sorted(v)), "ms/layer")
