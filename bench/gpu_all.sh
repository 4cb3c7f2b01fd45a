#!/usr/bin/env bash
# Every GPU test and benchmark, in one go, for a session that is lent a GPU (issue 43, item 6).
#
#   bench/gpu_all.sh [OUT_DIR]          # default runs/gpu; logs and JSON records there
#   QUICK=1 bench/gpu_all.sh            # the short versions (fits a 15-minute device lease)
#   QUICK=1 MODEL=.gpu/smollm2-135m-instruct SCORER=... LEARNED_MODEL=.gpu/qwen2.5-coder-0.5b-instruct bench/gpu_all.sh
#   SCORER=runs/train/scorer bench/gpu_all.sh   # the learned policy in the decode benchmark too
#
# 1. the kernel tests compiled on the GPU (TRITON_INTERPRET=0: the same tests that run in the interpreter on CPU,
#    plus the GPU-only large shapes, the no-sync selection and the decode loop's kept sets with and without kernels);
# 2. bench/kernel_bench.py: every kernel against its torch reference (do_bench, GB/s against copy bandwidth), then
#    whole decode steps;
# 3. bench/decode.py --long on CUDA in bf16: every policy at 25% and 50% of the final length against the full cache.
# A step that fails is reported and the next one still runs; the exit status is 1 if any failed.
set -uo pipefail
export PYTHONUNBUFFERED=1  # a step cut at its cap keeps the rows it printed
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
status=0

run() {
    local name=$1
    shift
    echo "== $name: $*"
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok ($((SECONDS - t0)) s)"
    else
        echo "   FAILED (rc $?, $((SECONDS - t0)) s): $OUT/$name.log"
        status=1
    fi
    tail -n 30 "$OUT/$name.log"
}

$PY - <<'PY' || exit 1
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
PY

# MODEL=DIR: a folder with the model's config.json and tokenizer but no weights (a lease takes 64 MiB along, not a
# model): the decode benchmarks build that shape with seeded random weights (bench/decode.py --random-weights),
# timing only. LEARNED_MODEL=DIR with SCORER: the learned policy's decode benchmark on the shape its scorer is bound to.
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL" --random-weights)
xdist=()
$PY -c "import xdist" 2>/dev/null && xdist=(-n 8)  # the H200 machine has 16 cores
if [ -n "${QUICK:-}" ]; then
    # each step capped, so a slow one leaves the next its time (a 15-minute lease, a 10-minute command); the
    # largest shapes first, so a step cut short has printed the rows the goals are about
    run kernel-tests timeout 120 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        tests/test_kernels.py tests/test_kernels_features.py tests/test_kernels_state.py tests/test_kernel_path.py
    # where the KV read outweighs the host's launches by far (the 2026-11-30 lease: eager launches cost a 2-layer step
    # ~2.5 ms of host time, as much as batch 32 at 32k tokens reads): batch 128 and 64 at 32k, slack 64
    for budget in 0.25 0.5; do
        run "bench-steps-b128-$budget" timeout 140 "$PY" bench/kernel_bench.py --skip-kernels --batches 128,64 \
            --contexts 32768 --budget $budget --slacks 64 --policies learned,h2o,tova,knorm,lazy,paged,snapkv
    done
    # twice: run-to-run spread of each kernel's time (one run cannot tell a 7% change from noise)
    run bench-kernels timeout 70 "$PY" bench/kernel_bench.py --quick --skip-steps
    run bench-kernels-again timeout 40 "$PY" bench/kernel_bench.py --quick --skip-steps
    # 2 layers of a 7B-like attention at batch 32 and 8, 32k and 8k tokens (host-bound since the one-pass attention:
    # the 2026-11-30 lease): every policy that scores per token, the learned one with a seeded untrained scorer
    # (timing only), at 25% and 50%
    for budget in 0.25 0.5; do
        run "bench-steps-$budget" timeout $([ $budget = 0.25 ] && echo 120 || echo 100) "$PY" bench/kernel_bench.py \
            --skip-kernels --batches 32,8 --contexts 32768,8192 --budget $budget --slacks 0,64 \
            --policies learned,h2o,snapkv,tova,knorm,lazy,paged
    done
    # host time, syncs and launches of a budgeted step (the 2026-11-28 lease found mid-decode compiles here)
    run profile-step timeout 25 "$PY" bench/profile_step.py --policies learned,h2o --batch 8 --context 8192 --top 15
    # whole decodes of a bundled model's shape (host-bound on a GPU: the 2026-11-27 lease), the learned scorer's
    if [ -n "${SCORER:-}" ] && [ -n "${LEARNED_MODEL:-}" ]; then
        run bench-decode-learned timeout 120 "$PY" bench/decode.py --long --dtype bfloat16 --model "$LEARNED_MODEL" \
            --random-weights --scorer "$SCORER" --long-settings 8:1280 --long-fractions 0.5 \
            --policies full,learned,snapkv,h2o --slack 16 --repeats 1 --json "$OUT/bench-decode-learned.json"
    fi
else
    run kernel-tests env TRITON_INTERPRET=0 "$PY" -m pytest -q "${xdist[@]}" tests/test_kernels.py \
        tests/test_kernels_features.py tests/test_kernels_state.py tests/test_kernel_path.py
    run bench-kernels "$PY" bench/kernel_bench.py
    run bench-decode-long "$PY" bench/decode.py --long --dtype bfloat16 "${model_args[@]}" \
        ${SCORER:+--scorer "$SCORER"} --slack 16 --repeats 3 --json "$OUT/bench-decode-long.json"
fi
exit $status
