#!/usr/bin/env bash
# Check hetpipe on a machine with a CUDA GPU, in one go (issue 11): the CUDA tests, gpu.py's acceptance systems
# against the plain loop, host_time.py on the CPU-bound ones, then the whole suite with the GPU visible.
# Everything lands in OUT (default runs/gpu-check): test and suite logs, gpu.json and gpu.md (merge of the
# per-model runs), host-*.json, the run folders.
#
#   bash launch/gpu_check.sh [OUT]                     # PYTHON=python3 to use another interpreter than .venv's
#   REPEATS=1 MINIBATCHES=100 bash launch/gpu_check.sh # a quicker, rougher pass
#
# The suite runs in parallel when pytest-xdist is installed (-n of half the cores), else serially.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
PY=${PYTHON:-.venv/bin/python}
REPEATS=${REPEATS:-3}
MINIBATCHES=${MINIBATCHES:-200}
mkdir -p "$OUT"
started=$(date +%s)
stamp() { echo "=== $1 at $(( $(date +%s) - started )) s"; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs one')" || exit 2
stamp "CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$OUT/test_cuda.log" 2>&1; echo "rc $?"; tail -3 "$OUT/test_cuda.log"

G=("$PY" launch/bench/gpu.py --repeats "$REPEATS" --minibatches "$MINIBATCHES" --keep "$OUT/runs")
stamp "gpu.py char-gpt"
"${G[@]}" --model char-gpt --system 1x1:4 --system 2x1:4:1 --system 1x1:4@1f1b-flush --system 1x2:4@1f1b-flush \
  --out "$OUT/char-gpt.json" 2>&1 >/dev/null | grep -v '^|'
stamp "gpu.py resnet50"
"${G[@]}" --model resnet50 --system 1x1:4 --out "$OUT/resnet50.json" 2>&1 >/dev/null | grep -v '^|'
rows=()
for f in "$OUT/char-gpt.json" "$OUT/resnet50.json"; do [ -f "$f" ] && rows+=(--rows "$f"); done
[ ${#rows[@]} -gt 0 ] && "$PY" launch/bench/gpu.py "${rows[@]}" --out "$OUT/gpu.json" --table "$OUT/gpu.md" >/dev/null 2>&1
[ -f "$OUT/gpu.md" ] && cat "$OUT/gpu.md"

stamp "host time, in one process"  # where a CPU-bound row's host time goes: plain step against StageCompute
for m in "char-gpt --precision bf16" "resnet50 --precision fp32"; do
  "$PY" launch/bench/host_time.py --model $m --out "$OUT/host-${m%% *}.json" 2>&1 | grep -E '^(plain|stage) '
done

stamp "the suite, GPU visible"
workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "$(( ( $(nproc) + 1 ) / 2 ))")
"$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" tests >"$OUT/suite.log" 2>&1; echo "rc $?"; tail -5 "$OUT/suite.log"
stamp done
