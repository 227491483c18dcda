#!/usr/bin/env bash
# One lent GPU session (the device call carries .whl, made here by benchmarks/device_wheels.sh): the packages the
# image lacks installed (once per machine), then the side-by-side benchmark and the GPU tests, each within its own
# time limit (0 skips it). Results in $OUT: bench.md, bench.log, gpu_tests.log.
#   BENCH_S=420 TESTS_S=240 bash benchmarks/on_device.sh
# BENCH_ONLY picks runs by name, e.g. BENCH_ONLY="xtrain compile,xtrain fp8 MLP only + compile"; BENCH_ARGS passes
# more of gpu.py's arguments (BENCH_ARGS=--wide: a model of width 4096).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/xtrain-device}
mkdir -p "$out"
if [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/launchers PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
if [ "${BENCH_S:-420}" != 0 ]; then
  timeout "${BENCH_S:-420}" python3 benchmarks/gpu.py ${BENCH_ARGS:-} ${BENCH_ONLY:+--only "$BENCH_ONLY"} \
    --out "$out/bench.md" 2>&1 \
    | tee "$out/bench.log"
fi
if [ "${ASYNC_S:-0}" != 0 ]; then  # checkpoints behind training against in step, the 856 M Llama
  timeout "$ASYNC_S" python3 benchmarks/async_save.py --gpu --repeats 1 --steps 30 --save-every 10 2>&1 \
    | tee "$out/async_save.log"
fi
if [ "${TESTS_S:-240}" != 0 ]; then
  # (SIGINT at the limit: pytest still prints the failures it has, with their tracebacks)
  timeout -s INT -k 20 "${TESTS_S:-240}" python3 -m pytest -m gpu -s -q -p no:cacheprovider -p benchmarks.as_it_goes \
    --durations=10 tests/test_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log"
fi
