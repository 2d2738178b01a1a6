# Set-up and entry points. `make demo` and `make test` do all installation
# themselves on a machine that has only Python 3.11.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP := $(VENV)/.installed
# chainer 7.8.1 builds only with setuptools<70, and needs numpy<2.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_BUILD_CONSTRAINT := $(CURDIR)/constraints.txt
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
NP_LIST ?= 1 2 3 4
TEST_TIMEOUT ?= 1200

.PHONY: venv demo test test-unit test-mpi test-netbed bench bench-deps clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt constraints.txt setup.py \
		chainermn_overlap/_native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: venv
	$(MPIEXEC) -n 2 $(PY) examples/imagenet/train_imagenet.py --arch resnet50 \
	    --optimizer overlap --batchsize 2 --iterations 6 --insize 224

test: venv test-unit test-mpi test-netbed

test-unit: venv
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

test-mpi: venv
	@set -e; for n in $(NP_LIST); do \
	    echo "== MPI tests at $$n rank(s) =="; \
	    $(PY) tests/mpi_run.py -n $$n --timeout $(TEST_TIMEOUT) -- tests/mpi; \
	done

# The network test bed needs root and iproute2; its tests skip (saying why)
# when either is missing.
test-netbed: venv
	@if [ "$$(id -u)" = 0 ] && ! command -v tc >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null 2>&1 \
	    || echo "could not install iproute2: the network test-bed tests will skip"; fi
	$(PY) -m pytest -q -p no:cacheprovider -rs tests/netbed

# The benchmark's own set-up: iproute2 (ip, tc) for the network namespaces,
# matplotlib for the plots, scikit-learn for its bundled digits data set
# (real data for the accuracy runs; nothing is downloaded).  BENCH_ARGS
# passes options to the overlap benchmark, e.g.
# make bench BENCH_ARGS='--model resnet_small --quick'
# COMPRESSION_ARGS to the compression benchmark, ACCURACY_ARGS to the
# accuracy runs.  bench-overlap, bench-compression and bench-accuracy run
# one part each.
BENCH_ARGS ?=
COMPRESSION_ARGS ?=
ACCURACY_ARGS ?=
bench-deps: venv
	@command -v ip >/dev/null && command -v tc >/dev/null || \
	    { apt-get update && apt-get install -y iproute2; }
	@$(PY) -c 'import matplotlib' 2>/dev/null || \
	    $(PY) -m pip install -q matplotlib
	@$(PY) -c 'import sklearn' 2>/dev/null || \
	    $(PY) -m pip install -q scikit-learn

bench: bench-overlap bench-compression bench-accuracy

.PHONY: bench-overlap bench-compression bench-accuracy
bench-overlap: bench-deps
	$(PY) -m benchmarks.overlap_bench $(BENCH_ARGS)

bench-compression: bench-deps
	$(PY) -m benchmarks.compression_bench $(COMPRESSION_ARGS)

bench-accuracy: bench-deps
	$(PY) -m benchmarks.accuracy $(ACCURACY_ARGS)

clean:
	rm -rf $(VENV) .mpi-logs build *.egg-info

# Spatial parallelism (distconv): strong and weak scaling at 1, 2 and 4
# processes, memory per process, exposed halo time with overlap on/off;
# benchmarks/results/spatial.json and spatial.png (matplotlib installed into
# the venv if missing).  SPATIAL_ARGS passes options, e.g. '--rounds 3'.
# Then a late-stage block spatial vs filter/channel parallel, and a 3x3 conv
# stack layer by layer vs tiled over a link with 1-5 ms latency (as root:
# the network test bed with netem; else latency emulated in-process):
# benchmarks/results/channel_tiling.json.  CHANNEL_TILING_ARGS passes
# options, e.g. '--quick'.
SPATIAL_ARGS ?=
CHANNEL_TILING_ARGS ?=
.PHONY: bench-spatial
bench-spatial: venv
	@$(PY) -c 'import matplotlib' 2>/dev/null || \
	    $(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.spatial_bench $(SPATIAL_ARGS)
	$(PY) -m benchmarks.channel_tiling_bench $(CHANNEL_TILING_ARGS)

# GPU variants of the optimizer equivalence, distconv exactness and snapshot
# suites (tests/gpu) with model and data on $(GPU_DEVICE), at 1 and 2 ranks
# (sharing the GPU), against CPU/numpy references.  Installs a cupy wheel
# matching the driver's CUDA when none works (benchmarks/gpu_bench.py
# install).  Without a GPU: one line, exit 0.  CI runs only `make test`;
# `bash benchmarks/gpu_check.sh` runs this and the rest of the GPU checks.
GPU_NP_LIST ?= 1 2
GPU_DEVICE ?= @cupy:0
GPU_TEST_TIMEOUT ?= 900
.PHONY: test-gpu
test-gpu: venv
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
	    echo "test-gpu: skipped: no NVIDIA GPU here (nvidia-smi lists none)"; \
	    exit 0; fi; \
	set -e; out=$${OUT:-benchmarks/results}; mkdir -p $$out; \
	$(PY) -m benchmarks.gpu_bench install --json $$out/gpu_install.json; \
	export LD_LIBRARY_PATH="$$($(PY) -m benchmarks.gpu_bench libpath):$${LD_LIBRARY_PATH:-}"; \
	export CHAINERMN_OVERLAP_TEST_DEVICE=$(GPU_DEVICE); \
	for n in $(GPU_NP_LIST); do \
	    echo "== GPU tests at $$n rank(s) on $(GPU_DEVICE) =="; \
	    $(PY) tests/mpi_run.py -n $$n --timeout $(GPU_TEST_TIMEOUT) -- \
	        tests/gpu -q -rs; \
	done
