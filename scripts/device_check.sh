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
#      machine has one GPU).
set -uo pipefail
OUT=${OUT:-/tmp/jaxcert-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/jaxcert-site . \
  > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/jaxcert-site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

echo "== bench_certify B=64 float32"
python3 scripts/bench_certify.py --repeats 20 --numpy-rows 2 --json "$OUT/bench_b64.json" \
  2>&1 | tee "$OUT/bench_b64.txt"
echo "== bench_certify B=4096 bfloat16"
python3 scripts/bench_certify.py --batch 4096 --dtype bfloat16 --repeats 10 --numpy-rows 1 \
  --json "$OUT/bench_b4096.json" 2>&1 | tee "$OUT/bench_b4096.txt"

echo "== solver tests on the GPU"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
  tests/test_jit_agreement.py tests/test_losses.py tests/test_bounds.py \
  tests/test_certificate.py 2>&1 | tail -15 | tee "$OUT/tests_gpu.txt"

echo "== sharding tests (virtual CPU devices)"
JAX_PLATFORMS=cpu timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o addopts="" \
  tests/test_sharding.py 2>&1 | tail -8 | tee "$OUT/tests_sharding.txt"
