#!/usr/bin/env bash
# The offline GPU run, proved on a machine with no GPU and no registry:
#
#     make gpu-wheelhouse && make gpu-dry-run      # or:
#     bash benchmarks/gpu_dry_run.sh [PYTHON3.12]
#
# Copies what the device tool sends (the tracked and untracked-not-ignored
# files: a fresh clone of this working tree, no .venv) and the wheelhouse's
# parts into a new folder, then runs benchmarks/gpu_check.sh there with
# Python 3.12 as the image's Python, in a network namespace with no route out
# (`unshare -n`, as root; elsewhere every proxy variable points at a closed
# port), no pip configuration and PIP_NO_INDEX=1.  It passes when every step
# that needs no GPU passed and the run ended recording that no GPU was found
# (on a machine with a GPU it stops: run gpu_check.sh itself there).
# About 2-3 minutes on 2 cores; the folder is kept (GPU_DRY_RUN_DIR, default
# .gpu-dry-run) with out/gpu.json and out/gpu_check.log.
set -eu
cd "$(dirname "$0")/.."
PY312=$(sh tools/python.sh find "${1:-python3.12}")
case $("$PY312" -c 'import sys; print("%d.%d" % sys.version_info[:2])') in
    3.12) ;;
    *) echo "gpu_dry_run: the device runs Python 3.12; $PY312 is not: name one, e.g. bash benchmarks/gpu_dry_run.sh /root/.pyenv/versions/3.12.1/bin/python3.12" >&2
       exit 2 ;;
esac
WHEELS=${GPU_WHEELS:-.gpu-wheels}
if ! ls "$WHEELS"/part*/MANIFEST.json >/dev/null 2>&1; then
    echo "gpu_dry_run: no wheelhouse in $WHEELS: run make gpu-wheelhouse first (it needs PyPI)" >&2
    exit 2
fi
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_dry_run: this machine has a GPU: run bash benchmarks/gpu_check.sh instead" >&2
    exit 2
fi
DEST=$(realpath -m "${GPU_DRY_RUN_DIR:-.gpu-dry-run}")
rm -rf "$DEST"
mkdir -p "$DEST/tree" "$DEST/out"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$DEST/tree"
mkdir -p "$DEST/tree/.gpu-wheels"
cp -r "$WHEELS"/part* "$DEST/tree/.gpu-wheels/"
echo "gpu_dry_run: fresh tree in $DEST/tree ($(du -sm "$DEST/tree" | cut -f1) MiB with the wheels); image Python $PY312"

closed=http://127.0.0.1:9
run=(env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL
     -u PIP_CONSTRAINT -u PIP_BUILD_CONSTRAINT
     PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null
     http_proxy=$closed https_proxy=$closed HTTP_PROXY=$closed
     HTTPS_PROXY=$closed ALL_PROXY=$closed no_proxy= NO_PROXY=
     GPU_PYTHON="$PY312" OUT="$DEST/out" bash benchmarks/gpu_check.sh)
cd "$DEST/tree"
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null \
        && unshare -n ip link set lo up 2>/dev/null; then
    echo "gpu_dry_run: in a network namespace with loopback only (unshare -n)"
    unshare -n sh -c 'ip link set lo up && exec "$@"' sh "${run[@]}" || true
else
    echo "gpu_dry_run: no network namespace here (needs root and ip): proxies point at a closed port"
    "${run[@]}" || true
fi
"$PY312" - "$DEST/out/gpu.json" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
steps = data.get('steps', [])
bad = [s['step'] for s in steps
       if not (s['ok'] or s.get('skipped_no_gpu'))]
gpu = [s for s in steps if s['step'] == 'gpu']
for s in steps:
    print('  {:28s} {:>4} s  {}'.format(
        s['step'], s['seconds'],
        'skipped (no GPU)' if s.get('skipped_no_gpu') else
        'ok' if s['ok'] else 'FAILED rc={}'.format(s['rc'])))
if bad or not gpu or 'no GPU found' not in gpu[0].get('note', ''):
    print('gpu_dry_run: FAILED: {} (see {})'.format(
        bad or 'the run did not record that no GPU was found',
        sys.argv[1].replace('gpu.json', 'gpu_check.log')))
    sys.exit(1)
print('gpu_dry_run: passed: every step that needs no GPU ran offline, then '
      '"{}"'.format(gpu[0]['note']))
PYEOF
