#!/usr/bin/env bash
# Check hetpipe on a machine with a CUDA GPU, in one go (issue 11): the whole suite with the GPU visible, the CUDA
# tests, gpu.py's acceptance systems against the plain loop, and host_time.py on the CPU-bound ones. The suite runs
# first, on every core, and the benchmarks after it on the lower half of the cores with nothing beside them: the
# host-bound rows (a step the device finishes faster than the CPU issues it) moved by a quarter when the suite ran
# beside them, and the suite's PS fuzz test timed out there once (2026-11-26, H200). About 12 minutes on a
# 16-core H100 or H200 machine, more than one device call may run: split it with BENCH=0, SUITE=0 and ROWS (below).
# The two rows nearest their targets (c: char-gpt bf16, d: resnet50 fp32) also run profiled (gpu.py --profile
# $PROFILE, untimed) and host_time.py profiles the same models in one process: where a stage process's host time
# goes that one process's does not; ps_agent_overlap.py then measures, on this host's CPU, how much a PS push
# beside it (agent process and shard) slows a host-bound thread. Everything lands in OUT (default
# runs/gpu-check): test and suite logs, a.json ... e.json and their merge gpu.json and gpu.md, host-*.json,
# overlap.json, machine.txt (the GPU, the cores and which share one).
#
#   bash launch/gpu_check.sh [OUT]                     # PYTHON=python3 to use another interpreter than .venv's
#   REPEATS=1 MINIBATCHES=60 bash launch/gpu_check.sh  # a quicker, rougher pass
#   KEEP=runs/gpu-runs bash launch/gpu_check.sh         # keep every run folder (traces, logs) there
#   BENCH=0 bash launch/gpu_check.sh                    # the suite and the CUDA tests only (~3 minutes)
#   SUITE=0 ROWS="c d" bash launch/gpu_check.sh         # only those gpu.py rows (c, d: ~5 minutes; a, b, e: ~4)
#   PROFILE=0 bash launch/gpu_check.sh                  # no profiled runs
#   DIAG=0 bash launch/gpu_check.sh                     # no host_time.py or ps_agent_overlap.py after the rows
#
# The suite runs in parallel when pytest-xdist is installed, else serially.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
PY=${PYTHON:-.venv/bin/python}
REPEATS=${REPEATS:-3}
MINIBATCHES=${MINIBATCHES:-120}
ROWS=${ROWS:-a b c d e}
PROFILE=${PROFILE:-40:40}
mkdir -p "$OUT"
started=$(date +%s)
stamp() { echo "=== $1 at $(( $(date +%s) - started )) s"; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs one')" || exit 2
cores=$(nproc); half=$(( cores / 2 ))
low=()
if command -v taskset >/dev/null && [ "$half" -ge 2 ]; then
  low=(taskset -c "0-$(( half - 1 ))")
fi
workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "$(( cores > 2 ? cores - 1 : 1 ))")

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; lscpu -e 2>/dev/null || true
} >"$OUT/machine.txt" 2>&1  # which cores share a physical core (SMT) matters to the host-bound rows

if [ "${SUITE:-1}" != 0 ]; then
  stamp "the suite, GPU visible"
  "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" --ignore tests/test_cuda.py tests >"$OUT/suite.log" 2>&1
  echo "suite rc $? at $(( $(date +%s) - started )) s" >>"$OUT/suite.log"; tail -3 "$OUT/suite.log"

  stamp "CUDA tests"
  "${low[@]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$OUT/test_cuda.log" 2>&1; echo "rc $?"
  tail -3 "$OUT/test_cuda.log"
fi
[ "${BENCH:-1}" = 0 ] && { stamp done; exit 0; }

G=("${low[@]}" "$PY" launch/bench/gpu.py --repeats "$REPEATS" --minibatches "$MINIBATCHES" ${KEEP:+--keep "$KEEP"})
run() {  # NAME, then gpu.py's arguments: in order of what the issue's acceptance needs most
  local name=$1; shift
  [[ " $ROWS " == *" $name "* ]] || return 0
  stamp "gpu.py $name: $*"
  "${G[@]}" "$@" --out "$OUT/$name.json" 2>&1 >/dev/null | grep -v '^|'
}
run a --model char-gpt --precision fp32 --system 1x1:4 --system 2x1:4:1
run b --model char-gpt --precision fp32 --repeats 1 --minibatches 200 --system 1x1:4@1f1b-flush \
  --system 1x2:4@1f1b-flush
# the host-bound rows also beside the same system with half the push's bytes (bfloat16 on the wire): whether
# the PS's own CPU work (the agent process and the shard, busy the whole run) slows the stage's thread
V=1x1:4+ps.wire_dtype=bfloat16
P=(); [ "$PROFILE" != 0 ] && P=(--profile "$PROFILE")
run c --model char-gpt --precision bf16 --system 1x1:4 --system 1x1:4@1f1b-flush --system $V "${P[@]}"
run d --model resnet50 --precision fp32 --minibatches $(( 2 * MINIBATCHES )) --system 1x1:4 --system $V "${P[@]}"  # the noisiest row
run e --model resnet50 --precision bf16 --system 1x1:4 --system 1x1:4@1f1b-flush
rows=()
for f in "$OUT"/[a-e].json; do [ -f "$f" ] && rows+=(--rows "$f"); done
[ ${#rows[@]} -gt 0 ] && "$PY" launch/bench/gpu.py "${rows[@]}" --out "$OUT/gpu.json" --table "$OUT/gpu.md" >/dev/null 2>&1
[ -f "$OUT/gpu.md" ] && cat "$OUT/gpu.md"

if [ "${DIAG:-1}" != 0 ] && [[ " $ROWS " == *" c "* || " $ROWS " == *" d "* ]]; then
  stamp "host time, in one process"  # where a CPU-bound row's host time goes: plain step against StageCompute
  HP=(); [ "$PROFILE" != 0 ] && HP=(--profile)
  for m in "char-gpt --precision bf16" "resnet50 --precision fp32"; do
    "${low[@]}" "$PY" launch/bench/host_time.py --model $m "${HP[@]}" --out "$OUT/host-${m%% *}.json" 2>&1 \
      | grep -E '^(plain|stage) '
  done
  stamp "a host-bound thread beside a 101.5 MB push (agent process + shard) every 4 minibatches, on this host"
  "${low[@]}" "$PY" launch/bench/ps_agent_overlap.py --out "$OUT/overlap.json" 2>&1 | tail -4
fi

stamp done
