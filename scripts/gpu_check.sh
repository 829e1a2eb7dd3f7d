#!/usr/bin/env bash
# GPU check: on a CUDA machine, run the CUDA-marked tests, the kernel tests compiled for the
# GPU, greedy-token agreement of the triton / flash / torch backends with transformers
# (SmolLM2, fp32 and bf16), and a throughput bench on a dummy-weight llama-1b; everything goes
# to one results file. Finishes within 8 minutes: every section has a time limit, and all of
# them together stop at a deadline of 7m40s.
#
#   bash scripts/gpu_check.sh [RESULTS_FILE]      (default: gpu_check_results.txt)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."

RESULTS="${1:-gpu_check_results.txt}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, not the interpreter

XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)  # compile kernel variants in parallel

START=$(date +%s)
DEADLINE=$((START + 460))
STATUS=0
: >"$RESULTS"

log() { echo "$*" | tee -a "$RESULTS"; }

# section TITLE SECONDS COMMAND...: run with a limit (capped by the deadline), log its output
section() {
    local title="$1" limit="$2"; shift 2
    local now left rc t0
    now=$(date +%s); left=$((DEADLINE - now))
    [ "$left" -lt "$limit" ] && limit="$left"
    log ""
    log "=== $title (limit ${limit}s) ==="
    if [ "$limit" -le 5 ]; then log "SKIPPED: out of time"; STATUS=1; return; fi
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RESULTS"
    rc=${PIPESTATUS[0]}
    log "--- $title: exit $rc after $(( $(date +%s) - t0 ))s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
    [ "$rc" -ne 0 ] && STATUS=1
}

log "cbgen GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
section "environment" 20 "$PY" scripts/gpu_check.py env
section "CUDA-marked tests (pytest -m cuda)" 100 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
section "kernel tests, compiled on the GPU" 60 "$PY" -m pytest -q ${XDIST[@]+"${XDIST[@]}"} -p no:cacheprovider tests/test_kernels.py
section "greedy tokens: backends vs transformers (SmolLM2)" 100 "$PY" scripts/gpu_check.py greedy
section "cbgen bench (llama-1b, dummy weights, triton)" 60 \
    "$PY" -c 'import sys; from cbgen.cli import main; sys.argv[0] = "cbgen"; main()' bench \
    --workload random --num-prompts 256 --input-len 512 --output-len 256 --range-ratio 0.5 \
    --model llama-1b --load-format dummy --max-num-seqs 256 --max-model-len 4096 \
    --attention-backend triton --num-warmup 4
section "throughput per backend (Engine API) and split-KV decodes" 110 "$PY" scripts/gpu_check.py bench

log ""
log "=== done in $(( $(date +%s) - START ))s, $([ "$STATUS" = 0 ] && echo 'all sections passed' || echo 'SOME SECTIONS FAILED') ==="
exit "$STATUS"
