#!/usr/bin/env bash
# The GPU path in one run, with no network, on a machine with an NVIDIA GPU:
#
#     bash benchmarks/gpu_check.sh
#
# Needs the wheelhouse made by `make gpu-wheelhouse` where pip reaches PyPI,
# in .gpu-wheels/part1, part2, ... (docs/gpu.md, "Offline", gives the device
# tool's calls that carry it).  No step reaches a registry: pip runs only as
# `pip install --no-index` of the carried wheels (PIP_NO_INDEX=1, no pip
# configuration read).  Steps, each logged, each going on past failures:
#
#   wheels      every part present and every wheel intact (MANIFEST.json)
#   env         a venv of $GPU_PYTHON (default python3, the image's) that sees
#               the image's site-packages after its own: the carried numpy
#               1.26.4, cupy 13, Chainer, MPICH, mpi4py and this package
#   imports     numpy < 2, Chainer through the Python 3.12 start-up stand-ins,
#               chainermn_overlap, mpi4py with MPICH, cupy (absence recorded)
#   mpi-probe   an allreduce at 2 ranks; whether the MPI is CUDA-aware
#   test-nccl-engine-standin   the NCCL engine's suite on its CPU stand-in
#   --- the steps below need a GPU; without one they are recorded as skipped
#   nvidia-smi, libpath (CUDA, NCCL, cuDNN libraries found where the image
#   keeps them), probe (chainer + cupy; a convolution against numpy, with
#   cuDNN off where there is none, recorded as information), nccl-probe at
#   1 and 2 ranks, tests/gpu at 1 and 2 ranks, and a short ResNet-50
#   benchmark (ours, both wait modes, against ChainerMN where the MPI is
#   CUDA-aware, else against our own host-staged blocking reduction).
#
# Results go to $OUT when set (the device tool fetches it), else to
# benchmarks/results/: gpu.json (each step's outcome and time, and what each
# step recorded) and gpu_check.log.  Exit status 0 when every step that ran
# passed (also when no GPU was found: the last line says so), else 1.
# GPU_CHECK_BUDGET (default 570 s) bounds the run; a step that would start
# later is recorded as skipped for time.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-benchmarks/results}"
mkdir -p "$OUTDIR"
JSON="$OUTDIR/gpu.json"
LOG="$OUTDIR/gpu_check.log"
BASE_PY=${GPU_PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
ENV_DIR=${GPU_ENV:-.gpu-env}
PY="$ENV_DIR/bin/python"
MPIEXEC="$ENV_DIR/bin/mpiexec"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
export OUT="$OUTDIR"
# No pip call can reach an index: none named, none configured.
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT \
    PIP_BUILD_CONSTRAINT
rm -f "$JSON"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-570}

record() {  # record NAME RC SECONDS [NOTE]
    "$BASE_PY" - "$JSON" "$1" "$2" "$3" "${4:-}" <<'PYEOF' || echo "(could not record $1 in $JSON)"
import sys
from benchmarks.gpu_bench import merge_json
import json, os
path, name, rc, secs, note = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
data = json.load(open(path)) if os.path.exists(path) else {}
steps = data.get('steps', [])
entry = {'step': name, 'rc': rc, 'seconds': secs,
         'ok': rc == 0, 'timed_out': rc in (124, 137),
         'skipped_for_time': rc == 125, 'skipped_no_gpu': rc == 126}
if note:
    entry['note'] = note
steps.append(entry)
merge_json(path, 'steps', steps)
PYEOF
}

step() {  # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    local left=$(( BUDGET - (t0 - START) ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: SKIPPED, only $left s of the ${BUDGET} s budget left"
        record "$name" 125 0 "skipped: the time budget was spent"
        return 0
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    echo "=== [$(( t0 - START )) s] $name: $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    echo "=== $name: rc=$rc after $dt s"
    record "$name" "$rc" "$dt"
    return 0
}

# --- steps that need no GPU -------------------------------------------------
step wheels 60 "$BASE_PY" -m benchmarks.gpu_offline verify --wheels "$WHEELS"
step env 240 "$BASE_PY" -m benchmarks.gpu_offline env --wheels "$WHEELS" \
    --env "$ENV_DIR" --base-python "$BASE_PY" --json "$JSON"
step imports 60 "$PY" -m benchmarks.gpu_offline imports --json "$JSON"
step mpi-probe-2-ranks 60 "$MPIEXEC" -n 2 "$PY" -m benchmarks.gpu_bench \
    mpi-probe --json "$JSON"
step test-nccl-engine-standin 120 "$PY" tests/mpi_run.py -n 2 --timeout 110 \
    -- tests/mpi/test_nccl_engine.py -q -p no:cacheprovider

# --- steps that need a GPU --------------------------------------------------
GPU_STEPS="nvidia-smi libpath probe nccl-probe-1-rank nccl-probe-2-ranks
tests-gpu-1-rank tests-gpu-2-ranks bench-resnet50"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    why="no GPU found: nvidia-smi $(command -v nvidia-smi >/dev/null \
        && echo 'lists none' || echo 'is not installed')"
    echo "=== gpu: $why; the GPU steps are skipped"
    record gpu 0 0 "$why"
    for s in $GPU_STEPS; do record "$s" 126 0 "skipped: $why"; done
else
    record gpu 0 0 "$(nvidia-smi -L | head -1)"
    step nvidia-smi 20 nvidia-smi
    # Where the image keeps CUDA, NCCL and cuDNN, found now (nvidia-* wheels
    # on the environment's path, CUDA_PATH, the folder of nvcc).
    t0=$(date +%s)
    LIBS=$("$PY" -m benchmarks.gpu_bench libpath --json "$JSON")
    rc=$?
    echo "=== libpath: $LIBS"
    record libpath $rc $(( $(date +%s) - t0 ))
    export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    step probe 120 "$PY" -m benchmarks.gpu_bench probe --json "$JSON"
    step nccl-probe-1-rank 45 "$MPIEXEC" -n 1 "$PY" -m benchmarks.gpu_bench \
        nccl-probe --json "$JSON"
    step nccl-probe-2-ranks 60 "$MPIEXEC" -n 2 "$PY" -m benchmarks.gpu_bench \
        nccl-probe --json "$JSON"
    for n in 1 2; do
        step tests-gpu-$n-rank$([ $n = 1 ] || echo s) 110 \
            env CHAINERMN_OVERLAP_TEST_DEVICE=@cupy:0 "$PY" tests/mpi_run.py \
            -n $n --timeout 100 -- tests/gpu -q -rs -p no:cacheprovider
    done
    step bench-resnet50 150 "$MPIEXEC" -n 2 "$PY" -m benchmarks.gpu_bench \
        bench --json "$JSON" --arch resnet50 --batchsize 32 --iterations 8 \
        --warmup 3 --baseline auto
fi

"$BASE_PY" - "$JSON" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
steps = data.get('steps', [])
ran = [s for s in steps if not (s['skipped_no_gpu'] or s['skipped_for_time'])]
failed = [s['step'] for s in ran if not s['ok']]
no_gpu = [s for s in steps if s['skipped_no_gpu']]
late = [s['step'] for s in steps if s['skipped_for_time']]
print('gpu_check: {} steps ran, failed: {}{}'.format(
    len(ran), failed or 'none',
    '; skipped for time: {}'.format(late) if late else ''))
if no_gpu:
    gpu = [s for s in steps if s['step'] == 'gpu'][0]
    print('gpu_check: {}: the {} GPU steps were skipped (recorded in {})'
          .format(gpu['note'], len(no_gpu), sys.argv[1]))
sys.exit(1 if failed or late else 0)
PYEOF
rc=$?
echo "gpu_check: done after $(( $(date +%s) - START )) s; results in $JSON, log in $LOG"
exit $rc
