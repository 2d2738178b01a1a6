#!/usr/bin/env bash
# The GPU path in one run, on a machine with an NVIDIA GPU:
#
#     bash benchmarks/gpu_check.sh
#
# About 5-8 minutes on one H200 (16 cores): the virtualenv if missing, a
# cupy wheel matching the driver's CUDA (pip), a compatibility probe (chainer
# + cupy, a cuDNN convolution forward/backward against numpy, an NCCL
# allreduce between two ranks on one device), `make test-gpu` (1 and 2
# ranks), and a short ResNet-50 benchmark (ChainerMN blocking vs ours, both
# wait modes, 2 ranks sharing the GPU).  Every step logs and the run goes on
# past failures; each step's outcome is in gpu.json.  Results go to $OUT
# when set (the device tool fetches it), else to benchmarks/results/:
# gpu.json (steps, install, probe, nccl probes, benchmark) and gpu_check.log.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-benchmarks/results}"
mkdir -p "$OUTDIR"
JSON="$OUTDIR/gpu.json"
LOG="$OUTDIR/gpu_check.log"
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
export OUT="$OUTDIR"
rm -f "$JSON"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
# The whole run stays inside this many seconds (the device tool allows one
# command 600 s); a step that would start later is recorded as skipped.
BUDGET=${GPU_CHECK_BUDGET:-570}

record() {  # record NAME RC SECONDS
    "$PY" - "$JSON" "$1" "$2" "$3" <<'PYEOF' || echo "(could not record $1 in $JSON)"
import sys
from benchmarks.gpu_bench import merge_json
path, name, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import json, os
data = json.load(open(path)) if os.path.exists(path) else {}
steps = data.get('steps', [])
steps.append({'step': name, 'rc': rc, 'seconds': secs,
              'ok': rc == 0, 'timed_out': rc in (124, 137),
              'skipped_for_time': rc == 125})
merge_json(path, 'steps', steps)
PYEOF
}

step() {  # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    local left=$(( BUDGET - (t0 - START) ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: SKIPPED, only $left s of the ${BUDGET} s budget left"
        if [ -x "$PY" ]; then record "$name" 125 0; fi
        return 0
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    echo "=== [$(( t0 - START )) s] $name: $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    echo "=== $name: rc=$rc after $dt s"
    if [ -x "$PY" ]; then record "$name" "$rc" "$dt"; fi
    return 0
}

step nvidia-smi 20 nvidia-smi
step venv 240 make venv
step install 240 "$PY" -m benchmarks.gpu_bench install --json "$JSON"
export LD_LIBRARY_PATH="$("$PY" -m benchmarks.gpu_bench libpath 2>/dev/null):${LD_LIBRARY_PATH:-}"
step probe 90 "$PY" -m benchmarks.gpu_bench probe --json "$JSON"
step nccl-probe-2-ranks 60 "$MPIEXEC" -n 2 "$PY" -m benchmarks.gpu_bench \
    nccl-probe --json "$JSON"
step nccl-probe-1-rank 45 "$MPIEXEC" -n 1 "$PY" -m benchmarks.gpu_bench \
    nccl-probe --json "$JSON"
step test-nccl-engine-standin 60 "$PY" tests/mpi_run.py -n 2 --timeout 50 \
    -- tests/mpi/test_nccl_engine.py -q
step make-test-gpu 200 make test-gpu GPU_TEST_TIMEOUT=95
step bench-resnet50 150 "$MPIEXEC" -n 2 "$PY" -m benchmarks.gpu_bench bench \
    --json "$JSON" --arch resnet50 --batchsize 32 --iterations 8 --warmup 3

"$PY" - "$JSON" <<'PYEOF' || true
import json, sys
data = json.load(open(sys.argv[1]))
failed = [s['step'] for s in data.get('steps', []) if not s['ok']]
print('gpu_check: failed steps: {}'.format(failed or 'none'))
PYEOF
echo "gpu_check: done after $(( $(date +%s) - START )) s; results in $JSON, log in $LOG"
