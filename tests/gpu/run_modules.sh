#!/usr/bin/env bash
# Run GPU test modules, each in a pytest process of its own (as their docstrings ask), until a
# time budget is spent; the engines' logs stay in LOG_DIR (UNIPREFILL_GPU_TEST_LOG_DIR).
#   bash tests/gpu/run_modules.sh [MODULE ...]     e.g. gpt_oss deepseek_mla (default: every module)
# Environment: BUDGET_S (default 3600) for all modules together, LOG_DIR (default
# /tmp/uniprefill_gpu_tests), PYTEST_ARGS (default -x -q).
set -uo pipefail
cd "$(dirname "$0")/../.."
budget=${BUDGET_S:-3600}
export UNIPREFILL_GPU_TEST_LOG_DIR=${LOG_DIR:-/tmp/uniprefill_gpu_tests}
mkdir -p "$UNIPREFILL_GPU_TEST_LOG_DIR"
modules=("$@")
[ ${#modules[@]} -eq 0 ] && modules=($(ls tests/gpu/test_*_gpu.py | sed 's#.*/test_\(.*\)_gpu.py#\1#'))
start=$(date +%s)
for m in "${modules[@]}"; do
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then echo "$m: not run (budget spent)"; continue; fi
  log="$UNIPREFILL_GPU_TEST_LOG_DIR/pytest_$m.log"
  timeout "$left" python -m pytest ${PYTEST_ARGS:--x -q} -p no:cacheprovider \
      "tests/gpu/test_${m}_gpu.py" > "$log" 2>&1
  rc=$?
  echo "$m: rc $rc, $(tail -n 1 "$log")"
done
