#!/bin/sh
# NumPy below 2 has no wheel for Python 3.13: pip builds it from source, and
# without OpenBLAS's development files the build falls back to NumPy's own
# unoptimised linear algebra (measured: the ResNet-50 demo 20x slower).
#
#   sh tools/numpy_blas.sh VENV_PYTHON
#
# Does nothing when the venv's NumPy has a BLAS.  Otherwise, as root with
# apt-get, installs libopenblas-dev and pkg-config and rebuilds NumPy
# against them (replacing pip's cached build, the one without); else
# says in one line what to do.  Messages go to stderr.
set -u
py=$1
has_blas() {
    "$py" - <<'PY' 2>/dev/null
import sys, numpy
blas = numpy.show_config(mode='dicts')['Build Dependencies']['blas']
sys.exit(0 if blas.get('found') else 1)
PY
}
has_blas && exit 0
fix="apt-get install libopenblas-dev pkg-config, then $py -m pip install --no-cache-dir --force-reinstall --no-deps 'numpy<2'"
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "numpy was built without a BLAS (no numpy<2 wheel for this Python): its linear algebra is slow; to fix: $fix" >&2
    exit 0
fi
echo "numpy was built without a BLAS (no numpy<2 wheel for this Python): installing libopenblas-dev and rebuilding numpy against it" >&2
if ! pkg-config --exists openblas 2>/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
        -y -qq --no-install-recommends libopenblas-dev pkg-config) >/dev/null 2>&1 \
        || { echo "could not install libopenblas-dev; to fix: $fix" >&2; exit 0; }
fi
# pip's cache keeps the build without BLAS: drop it, so that the new build
# is the one cached (and later venvs of this Python get it at once).
"$py" -m pip cache remove 'numpy' >/dev/null 2>&1
"$py" -m pip install -q --force-reinstall --no-deps 'numpy<2' || exit 1
has_blas || echo "numpy still has no BLAS after the rebuild; to fix: $fix" >&2
exit 0
