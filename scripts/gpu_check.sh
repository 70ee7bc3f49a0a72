#!/usr/bin/env bash
# One-call GPU check for a session that has a GPU machine (about 3-5 minutes on an H200, < 8 min):
#   1. tests/gpu (CUDA-graph replay == eager, bf16 and INT8 KV; the engine on CUDA with graphs and the
#      fused lookup == eager / unfused; host synchronisations per pure-decode step; gpu_bench --tiny);
#   2. scripts/gpu_bench.py on the random Llama-3.1-8B-shaped model in bf16: decode forward eager vs
#      graphs, the engine step (ModelRunner.execute) eager vs graphs vs every-token lookup, HBM floor,
#      HF generate(); then the ratios.
# Needs only python3 with torch (+ transformers for HF, pytest for the tests); no network, no checkpoint.
# Outputs (logs, JSON) go to $OUT when set (the device tool's folder), else /tmp/sfcl-gpu-check.
#   usage: bash scripts/gpu_check.sh            (env PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/sfcl-gpu-check}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$DEST/nvidia_smi.txt"
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)" \
    || { echo "gpu_check: CUDA is not available to $PY"; exit 3; }

echo "== tests/gpu"
timeout 270 $PY -m pytest -q -m gpu tests/gpu -rs -s -p no:cacheprovider 2>&1 | tee "$DEST/tests_gpu.log"
rc_tests=${PIPESTATUS[0]}

echo "== scripts/gpu_bench.py (8B shape, bf16)"
timeout 300 $PY scripts/gpu_bench.py --out "$DEST/gpu_bench.json" 2>&1 | tee "$DEST/gpu_bench.log"
rc_bench=${PIPESTATUS[0]}

if [ -f "$DEST/gpu_bench.json" ]; then
  $PY - "$DEST/gpu_bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = lambda x, nd=2: "n/a" if x is None else f"{x:.{nd}f}"
print(f"== ratios ({d['device_name']}, {d['date']}, context {d['context']})")
for r in d["rows"]:
    print(f"batch {r['batch']:>2}: forward graph speed-up {f(r.get('graph_speedup'))}x, best/floor {f(r.get('best_over_floor'))}, "
          f"HF/best {f(r.get('hf_over_best'), 1)}x | engine step graph speed-up {f(r.get('engine_graph_speedup'))}x, "
          f"engine/floor {f(r.get('engine_over_floor'))}, HF/engine {f(r.get('hf_over_engine'), 1)}x, "
          f"always-lookup/off {f((r.get('engine_always_ms') or 0) / (r.get('engine_graph_ms') or r.get('engine_eager_ms') or 1))}")
for t in d["targets"]:
    print(f"{t['mark']}: {t['name']} = {f(t['value'])} (goal {t['op']} {t['threshold']:g})")
PY
fi
echo "gpu_check: tests/gpu rc=$rc_tests, gpu_bench rc=$rc_bench (outputs in $DEST)"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
