#!/usr/bin/env bash
# Accelerator check (issue 8, item 8): run it on a GPU machine from the repository root, e.g.
# through the device tool. Not part of CI. It expects jax with CUDA, flax, optax, chex,
# pytest, hypothesis and scipy to be installed there, and installs jaxcert itself from this
# folder (no dependencies, no network). Writes its logs to $OUT (default /tmp/jaxcert-device).
#   1. bench_certify.py on the GPU: B=64 float32 (the CPU benchmark's shape), then
#      [4096, 151936] bfloat16 logits: positions/s against the memory-bandwidth bound;
#   2. the solver, losses and jit/no-jit tests on the GPU (plain lax.top_k path: the CPU
#      tricks are off there), against the NumPy / float64 references;
#   3. the sharding tests (8 virtual devices; pinned to the host CPU platform, since the GPU
#      machine has one GPU);
#   4. the decoder's passes on the GPU: the 1.5B target's pass time by width at batch 1 and 8
#      and the 0.5B drafter's step (random weights of their shapes from scripts/shapes/, in
#      bfloat16: the weights cannot travel to such a machine), i.e. the cost model `goodput`
#      calibrates there and target-only tokens/s; a draft head's cost per drafted token;
#      target-only, the 0.5B drafter and an EAGLE-3 head decoding at batch 1 and 8
#      (bench_decode_device.py: tokens/s measured, speedups projected at the CPU benchmark's
#      tokens per round); and the decoder's n-gram and goodput tests (tiny models) on the GPU.
#   5. certificates (under 8 minutes on one GPU): all 8 rules together and greedy alone on
#      [4096, 151936] bfloat16 and float32, the two-pass row summary beside the separate
#      reductions it replaced (--baseline), the losses' value_and_grad, each against one
#      read of the logits at the device's measured copy bandwidth; then the solver's tests.
# Arguments: the sections to run (certify, tests, sharding, decode, certificates); none: the
# first four.
# WHEELS: a folder of wheels to install first (e.g. gguf, which such a machine lacks).
set -uo pipefail
OUT=${OUT:-/tmp/jaxcert-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SECTIONS=${*:-certify tests sharding decode}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
# pytest on the GPU: from a copy of tests/ (from the repository root, ./jaxcert would shadow
# the installed package, whose jaxcert.models comes from models/), with none of the suite's
# CPU-only XLA flags (JAXCERT_TEST_XLA_FLAGS=0: a GPU build of XLA aborts on them).
# Usage: gpu_pytest SECONDS TEST_FILE...
gpu_pytest() {
  local limit=$1
  shift
  rm -rf /tmp/jaxcert-tests && mkdir -p /tmp/jaxcert-tests && cp -r tests /tmp/jaxcert-tests/
  (cd /tmp/jaxcert-tests && JAXCERT_TEST_XLA_FLAGS=0 timeout "$limit" python3 -m pytest -q -x \
    -p no:cacheprovider "$@" 2>&1)
  local rc=$?
  # A killed run prints no summary: say so instead of ending on a line of dots.
  if [ "$rc" -eq 124 ]; then echo; echo "TIMED OUT after ${limit} s (not a pass)"; fi
  return "$rc"
}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/jaxcert-site "$WHEELS"/*.whl \
    > "$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/jaxcert-site . \
  > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/jaxcert-site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

if want certify; then
echo "== bench_certify B=64 float32"
python3 scripts/bench_certify.py --repeats 20 --numpy-rows 2 --json "$OUT/bench_b64.json" \
  2>&1 | tee "$OUT/bench_b64.txt"
echo "== bench_certify B=4096 bfloat16"
python3 scripts/bench_certify.py --batch 4096 --dtype bfloat16 --repeats 10 --numpy-rows 1 \
  --json "$OUT/bench_b4096.json" 2>&1 | tee "$OUT/bench_b4096.txt"

fi
if want tests; then
echo "== solver tests on the GPU"
gpu_pytest 480 tests/core/test_jit_agreement.py tests/core/test_losses.py \
  tests/core/test_bounds.py tests/core/test_certificate.py | tail -15 | tee "$OUT/tests_gpu.txt"

fi
if want sharding; then
echo "== sharding tests (virtual CPU devices)"
JAX_PLATFORMS=cpu timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
  tests/core/test_sharding.py 2>&1 | tail -8 | tee "$OUT/tests_sharding.txt"
fi
if want decode; then
echo "== decoder passes on the GPU (random weights of the real shapes, bfloat16)"
python3 scripts/bench_pass_width.py --random-weights --dtype bfloat16 \
  --model scripts/shapes/qwen2.5-coder-1.5b-instruct \
  --drafter scripts/shapes/qwen2.5-coder-0.5b-instruct --rows 1,8 --widths 1,2,3,4,8,16 \
  --repeats 20 --json "$OUT/pass_width_gpu.json" 2>&1 | tee "$OUT/pass_width_gpu.txt"
echo "== draft head cost (float32, batch 1)"
python3 scripts/bench_head_cost.py --json "$OUT/head_cost_gpu.json" 2>&1 \
  | tee "$OUT/head_cost_gpu.txt"
echo "== decoding: target only, the 0.5B drafter and a draft head (bfloat16, batch 1 and 8)"
python3 scripts/bench_decode_device.py --dtype bfloat16 --batch-sizes 1,8 \
  --json "$OUT/decode_gpu.json" 2>&1 | tee "$OUT/decode_gpu.txt"
echo "== decoder tests on the GPU (n-gram drafting, goodput)"
gpu_pytest 300 tests/decoding/test_ngram.py tests/decoding/test_goodput.py | tail -8 \
  | tee "$OUT/tests_decode_gpu.txt"
fi
if want certificates; then
for dtype in bfloat16 float32; do
  echo "== certificates, [4096, 151936] $dtype: two passes vs separate reductions, losses"
  timeout 200 python3 scripts/bench_certify.py --batch 4096 --dtype "$dtype" --repeats 10 \
    --numpy-rows 1 --each greedy --baseline --losses --measure-bandwidth \
    --json "$OUT/certificates_$dtype.json" 2>&1 | tee "$OUT/certificates_$dtype.txt"
done
echo "== solver tests on the GPU"
gpu_pytest 150 tests/core/test_row_summary.py tests/core/test_certificate.py \
  tests/core/test_losses.py | tail -8 | tee "$OUT/tests_certificates_gpu.txt"
fi
