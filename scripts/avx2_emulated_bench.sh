#!/usr/bin/env bash
# The default server against llama.cpp's llama-server with both restricted to AVX2 code paths, on an
# AVX-512 CPU: what can be measured of an AVX2-only machine without one (2026-12-05, thirteenth
# session; docs/benchmarks.md). Not an AVX2-only machine: the cores, caches and memory are the
# AVX-512 CPU's. Until 2026-12-07 (thirty-sixth session) FBGEMM (SFCL's fp16 dense path for prompts and
# for decode batches above the int4 kernels' rows) still ran AVX-512 code here: it reads
# FBGEMM_ENABLE_INSTRUCTIONS, set below (its fp16 GEMM then runs ~1.3x slower at 512 rows on a Zen 4).
#
#   bash scripts/avx2_emulated_bench.sh OUT_DIR [extra sfcl bench args]
#
# - torch: ATEN_CPU_CAPABILITY=avx2 (ATen's vectorised kernels), ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's
#   GEMMs: bf16 then runs at ~3 GFLOP/s, so `--dtype auto` picks float32, as on an AVX2-only CPU),
#   MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's float32 GEMMs), FBGEMM_ENABLE_INSTRUCTIONS=AVX2 (FBGEMM's fp16
#   and int8 GEMMs);
# - SFCL's kernels: SFCL_KERNEL_MARCH=haswell (a build of their own in the kernel cache);
# - llama-server: built once from the llama-cpp-python sdist's vendored llama.cpp with
#   GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/BMI2 on and AVX-512 off (no zmm instruction in the binary),
#   into ~/.cache/sfcl/llama-server-avx2 (about 5 minutes on 2 cores), and passed to the bench
#   with SFCL_LLAMA_SERVER.
set -euo pipefail
out=${1:?usage: bash scripts/avx2_emulated_bench.sh OUT_DIR [extra sfcl bench args]}
shift
cache=${SFCL_CACHE_DIR:-$HOME/.cache/sfcl}/llama-server-avx2
bin=$cache/llama-server
version=$(python -c "from sfcl.bench.llama_server import installed_version as v; print(v() or '0.3.36')")
if [ ! -x "$bin" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$work/cmake.log"
  cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log"
  mkdir -p "$cache"
  cp "$work/build/bin/llama-server" "$bin"
fi
if objdump -d "$bin" | grep -q '%zmm'; then
  echo "$bin uses AVX-512 registers: not an AVX2 build" >&2
  exit 1
fi
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
  SFCL_KERNEL_MARCH=haswell
# inductor's own cache for these runs: code it compiled under ATEN_CPU_CAPABILITY=avx2 and reused by a
# native process corrupted that process's heap (2026-12-05, docs/benchmarks.md)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_avx2_$(id -u)}
export SFCL_LLAMA_SERVER=$bin
exec sfcl bench --systems sfcl-triggered,llama-server --sfcl-args "--max-num-seqs 16" \
  --workloads single,concurrent,longdoc --concurrency 16,32 --requests-per-level 32 --single-requests 6 \
  --rounds 1 --longdoc-questions 3 --out "$out" "$@"
