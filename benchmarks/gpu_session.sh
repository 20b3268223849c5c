#!/usr/bin/env bash
# One lent-GPU session in one command: the GPU-marked tests, then the kernel and end-to-end
# benchmarks (docs/benchmarks.md, "Kernels and GPU end to end"), each logged to $OUT/<step>.log.
#
#   bash benchmarks/gpu_session.sh              # on the GPU machine, from the repository root
#   SMOKE=1 bash benchmarks/gpu_session.sh      # here, on CPU: the same steps with --smoke
#
# The GPU machine has python3 with torch, triton, transformers and pytest but no pip registry, so
# kvasir is made importable without installing it: a link tree /tmp/kvasir-pkg/kvasir/<sub> ->
# <sub>/ (kvasir is a namespace package; pyproject.toml's package-dir). A missing pure-Python
# dependency (gguf, which the loader imports) is installed from the wheels in .whl/ if present;
# make them here (and carry .whl with the device call):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
# Every step runs even if the one before it failed; each gets min(its cap, what is left of
# GPU_SESSION_BUDGET_S), so the whole command ends inside the device tool's limit.

set -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_session}  # /out/ is git-ignored
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET_S:-550}
SMOKE=${SMOKE:-0}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvasir-triton-cache}  # compiled kernels shared by the steps
SUMMARY=$OUT/summary.log

log() { echo "$*" | tee -a "$SUMMARY"; }

{
    echo "== gpu_session.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), smoke=$SMOKE, budget ${BUDGET}s"
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 || true
    uname -r
    "$PY" -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], sys.executable); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("triton", triton.__version__); print("transformers", transformers.__version__)' 2>&1
    "$PY" -m pytest --version 2>&1
} | tee -a "$SUMMARY"

# ---- import setup: no pip install of kvasir --------------------------------------------------
SITE=/tmp/kvasir-site
if ! "$PY" -c 'import gguf' 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl 2>&1 | tee -a "$SUMMARY"
    else
        log "gguf missing and no .whl/ wheels carried: the engine's loader will not import"
    fi
fi
PKG=/tmp/kvasir-pkg
rm -rf "$PKG"
mkdir -p "$PKG/kvasir"
for sub in cli runtime operator simulator observability kernels; do
    ln -s "$ROOT/$sub" "$PKG/kvasir/$sub"
done
# The repository root too (tests.*); its operator/ has no __init__.py, so it never shadows stdlib's.
export PYTHONPATH=$SITE:$PKG:$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import gguf, kvasir.runtime.engine.llm_engine as e, kvasir.kernels.triton_ops.attention as a; print("kvasir imports from", e.__file__, a.__file__)' 2>&1 | tee -a "$SUMMARY"

# ---- steps -----------------------------------------------------------------------------------
# step NAME CAP_SECONDS COMMAND...: runs COMMAND under a timeout, output into $OUT/NAME.log.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 20 ]; then
        log "== $name: not run (${left}s of the budget left)"
        return
    fi
    log "== $name (timeout ${limit}s, at ${SECONDS}s): $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    local note=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note=" (TIMED OUT)"
    log "== $name: rc=$rc$note in $((SECONDS - start))s"
}

GPU_TESTS=(tests/runtime/engine/test_engine_parity_triton.py tests/runtime/worker/test_cuda_graphs.py)
PYTEST=("$PY" -m pytest -q --no-header -p no:cacheprovider -W ignore::pytest.PytestConfigWarning)
if [ "$SMOKE" = 1 ]; then
    step gpu_tests 120 "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}"
    step attention_decode 300 "$PY" benchmarks/attention_decode.py --smoke
    step attention_prefill 300 "$PY" benchmarks/attention_prefill.py --smoke
    step e2e_qwen3 300 "$PY" benchmarks/e2e_gpu.py --smoke --model qwen3-0.6b
    step quantized_linear 120 "$PY" benchmarks/quantized_linear.py --smoke --batch 1 5
    step quantized_decode 120 "$PY" benchmarks/quantized_decode.py --smoke
else
    # STEPS picks which steps run (all by default), for a second call that reruns a few.
    STEPS=${STEPS:-gpu_tests attention_decode attention_prefill e2e_qwen3 kernel_tests}
    wanted() { [[ " $STEPS " == *" $1 "* ]]; }
    wanted gpu_tests && step gpu_tests 110 "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}"
    wanted attention_decode && step attention_decode 150 "$PY" benchmarks/attention_decode.py
    wanted attention_prefill && step attention_prefill 100 "$PY" benchmarks/attention_prefill.py
    wanted e2e_qwen3 && step e2e_qwen3 190 "$PY" benchmarks/e2e_gpu.py --model qwen3-0.6b --hf-max-seconds 60
    # The kernel tests run on the GPU (compiled Triton) when it has one.
    wanted kernel_tests && step kernel_tests 150 "${PYTEST[@]}" --maxfail=20 -m "not slow" tests/kernels
    # Quantized weights: the int4/FP8 kernel tests and the GPU-marked model tests on
    # CUDA, then the layer-stack and whole-model decode benchmarks against bf16.
    wanted quant_gpu_tests && step quant_gpu_tests 120 "${PYTEST[@]}" -m gpu tests/runtime/models/test_quantized_models.py
    wanted quant_kernel_tests && step quant_kernel_tests 120 "${PYTEST[@]}" tests/kernels/test_int4_matmul.py \
        tests/kernels/test_fp8_linear.py
    wanted quantized_decode && step quantized_decode 150 "$PY" benchmarks/quantized_decode.py --batch 1 16 64
    wanted quantized_linear && step quantized_linear 150 "$PY" benchmarks/quantized_linear.py --sweep
    # Kvasir alone: the decode step against its roofline (transformers' side is the run above).
    wanted e2e_llama3 && step e2e_llama3 240 "$PY" benchmarks/e2e_gpu.py --model llama3-8b --skip-hf
    wanted e2e_qwen3_kvasir && step e2e_qwen3_kvasir 120 "$PY" benchmarks/e2e_gpu.py --model qwen3-0.6b --skip-hf
fi
log "== done at ${SECONDS}s"
