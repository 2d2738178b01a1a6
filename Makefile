# Set-up and entry points. `make demo` and `make test` do all installation
# themselves on a machine that has only Python (3.11, 3.12 or 3.13).
# PYTHON=python3.12 names the interpreter; without it python3 is used when
# it is one of those, else the Makefile looks for one (tools/python.sh says
# which it took, or stops naming the versions that work).  A .venv of
# another Python than the one named is replaced.
PYTHON ?=
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
TEST_TIMEOUT ?= 1200
export TEST_TIMEOUT

.PHONY: venv demo test test-unit test-commands test-mpi test-netbed bench \
	bench-deps clean docs docs-deps test-wheel

.PHONY: venv-python
venv: venv-python $(STAMP)

venv-python:
	@sh tools/python.sh venv $(VENV) "$(PYTHON)"

$(STAMP): requirements.txt requirements-test.txt constraints.txt setup.py pyproject.toml \
		chainermn_overlap/_native.c _chainermn_overlap_compat.py chainermn_overlap-compat.pth
	@test -x $(PY) || sh tools/python.sh venv $(VENV) "$(PYTHON)"
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	@sh tools/numpy_blas.sh $(PY)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: venv
	$(MPIEXEC) -n 2 $(PY) examples/imagenet/train_imagenet.py --arch resnet50 \
	    --optimizer overlap --batchsize 2 --iterations 6 --insize 224

# make test: every tier (tests/tiers.py --list names them), the MPI ones in
# one lane beside the unit tier in a second and the command and network-bed
# tiers in a third, then the tests that assert a measured time alone.  TIERS='unit mpi-2' runs some.
TIERS ?=
test: venv netbed-deps
	$(PY) tests/tiers.py $(if $(TIERS),--only $(TIERS))

test-unit: venv
	$(PY) tests/tiers.py --only unit

test-commands: venv
	$(PY) tests/tiers.py --only commands

test-mpi: venv
	$(PY) tests/tiers.py --only mpi

# The equivalence suites again with every sharding mode (shard=...), bit
# for bit at 2 ranks, uneven shards at 3; tests/mpi/test_sharding.py runs
# in test-mpi.
.PHONY: test-shard test-timing netbed-deps
test-shard: venv
	$(PY) tests/tiers.py --only shard

test-timing: venv
	$(PY) tests/tiers.py --only timing

# The network test bed needs root and iproute2, its multi-host tests also
# openssh-server and util-linux (unshare); as root they are installed here
# when missing.  Without root or namespaces the tests skip, saying why.
netbed-deps:
	@if [ "$$(id -u)" = 0 ] && { ! command -v tc >/dev/null || \
	    ! [ -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null || \
	    ! command -v unshare >/dev/null; }; then \
	    echo "installing iproute2, openssh-server, util-linux for the network test bed"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
	     install -y -qq --no-install-recommends iproute2 openssh-server \
	     openssh-client util-linux) >/dev/null 2>&1 \
	    || echo "could not install iproute2/openssh-server: the tests that need them will skip"; fi

test-netbed: venv netbed-deps
	$(PY) tests/tiers.py --only netbed

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

.PHONY: bench-overlap bench-compression bench-accuracy bench-hosts
bench-overlap: bench-deps
	$(PY) -m benchmarks overlap $(BENCH_ARGS)

bench-compression: bench-deps
	$(PY) -m benchmarks compression $(COMPRESSION_ARGS)

bench-accuracy: bench-deps
	$(PY) -m benchmarks accuracy $(ACCURACY_ARGS)

# Multi-host soak (as root): 20 real host faults (processes killed, link
# cut, host lost) in one run on the ssh test bed, recovery times to
# benchmarks/results/hosts_soak.json.  HOSTS_SOAK_ARGS passes options,
# e.g. '--faults 30 --hosts 3 --slots 1'.
HOSTS_SOAK_ARGS ?=
bench-hosts: venv
	@[ -x /usr/sbin/sshd ] && command -v tc >/dev/null || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
	      install -y -qq --no-install-recommends iproute2 openssh-server \
	      openssh-client util-linux; }
	$(PY) -m benchmarks hosts_soak $(HOSTS_SOAK_ARGS)

clean:
	rm -rf $(VENV) .mpi-logs .test-logs build dist *.egg-info docs/_build

# The documentation site: HTML into docs/_build/html, warnings as errors, a
# fresh environment each time (the API completeness check needs every page
# read), then a check of every internal link of the output.  Its
# dependencies (docs/requirements.txt) go into the venv.  Offline the
# intersphinx links to Chainer/NumPy are left out (docs/conf.py).
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): docs/requirements.txt $(STAMP)
	$(PY) -m pip install -q -r docs/requirements.txt
	touch $@

docs-deps: $(DOCS_STAMP)

docs: venv docs-deps
	rm -rf docs/_build/html docs/_build/doctrees
	$(PY) -m sphinx -b html -W --keep-going -E -q -d docs/_build/doctrees \
	    docs docs/_build/html
	$(PY) docs/_ext/check_links.py docs/_build/html

# The tables and figures written into docs/*.md, rewritten from
# benchmarks/results/*.json: run it after a benchmark rewrote its JSON
# (make docs and make test fail while a page differs from the results).
.PHONY: docs-figures
docs-figures: venv
	$(PY) docs/_ext/benchtables.py --write

# The package as users get it: sdist and wheel by `python -m build`, the
# wheel installed into a fresh venv (not editable), the unit tests, one MPI
# test file and the console script run against it from a folder without
# the package source (tests/wheel_check.py says each step).
test-wheel: venv
	@$(PY) -c 'import build' 2>/dev/null || $(PY) -m pip install -q build
	$(PY) tests/wheel_check.py --python "$$(sh tools/python.sh find "$(PYTHON)")"

# Spatial parallelism (distconv): strong and weak scaling at 1, 2 and 4
# processes, memory per process, exposed halo time with overlap on/off;
# benchmarks/results/spatial.json and spatial.png (matplotlib installed into
# the venv if missing).  SPATIAL_ARGS passes options, e.g. '--rounds 3'.
# Then a late-stage block spatial vs filter/channel parallel, and a 3x3 conv
# stack layer by layer vs tiled over a link with 1-5 ms latency (as root:
# the network test bed with netem; else latency emulated in-process):
# benchmarks/results/channel_tiling.json.  CHANNEL_TILING_ARGS passes
# options, e.g. '--quick'.  Last, the 3-D U-Net of
# examples/spatial/train_unet3d_spatial.py at 1 -> 2 processes: strong
# scaling (as root on the network test bed, else over shared memory), the
# bound of each rank computing its block with no exchange, and memory per
# process against one process, benchmarks/results/unet.json.  UNET_ARGS
# passes options, e.g. '--insize 64' or '--rate 100mbit'.
SPATIAL_ARGS ?=
CHANNEL_TILING_ARGS ?=
UNET_ARGS ?=
.PHONY: bench-spatial
bench-spatial: venv
	@$(PY) -c 'import matplotlib' 2>/dev/null || \
	    $(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks spatial $(SPATIAL_ARGS)
	$(PY) -m benchmarks channel_tiling $(CHANNEL_TILING_ARGS)
	$(PY) -m benchmarks unet $(UNET_ARGS)

# Sharding (shard='optimizer' | 'gradients' | 'parameters'): bytes per rank
# of a 37.7 M-parameter MLP with Adam at 1, 2 and 4 ranks (tracemalloc),
# then step time and scalability on the network test bed at 2 ranks (as
# root) for that MLP and ResNet-50, against the unsharded optimizer in the
# same run: benchmarks/results/sharding.json and sharding.png.
# SHARDING_ARGS passes options, e.g. '--skip-speed'.
SHARDING_ARGS ?=
.PHONY: bench-sharding
bench-sharding: bench-deps
	$(PY) -m benchmarks sharding $(SHARDING_ARGS)

# Scaling beyond two ranks (as root): 2 to 8 ranks on the time-dilated
# bed (testbed/cpuquota.py), the SimGrid replay of a recorded iteration and
# its projection to 1,024 nodes: benchmarks/results/scale.json and
# scale.png.  The replay runs under the system Python with the Debian
# package python3-simgrid, installed here.  SCALE_ARGS passes options,
# e.g. '--full' (ResNet-50 and -18, k = 1, 2, 4) or '--validate-only'.
SCALE_ARGS ?=
.PHONY: bench-scale
bench-scale: bench-deps
	@/usr/bin/python3 -c 'import simgrid' 2>/dev/null || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
	      install -y -qq python3-simgrid; }
	$(PY) -m benchmarks scale $(SCALE_ARGS)

# Snapshots of sharded optimizers (4 ranks, Adam MLP of 4.2 M parameters):
# bytes on disk and memory per rank while saving, sharded files against
# whole states in every file.
SNAPSHOT_ARGS ?=
.PHONY: bench-snapshot
bench-snapshot: venv
	$(PY) -m benchmarks snapshot $(SNAPSHOT_ARGS)

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
	$(PY) -m benchmarks gpu install --json $$out/gpu_install.json; \
	export LD_LIBRARY_PATH="$$($(PY) -m benchmarks gpu libpath):$${LD_LIBRARY_PATH:-}"; \
	export CHAINERMN_OVERLAP_TEST_DEVICE=$(GPU_DEVICE); \
	for n in $(GPU_NP_LIST); do \
	    echo "== GPU tests at $$n rank(s) on $(GPU_DEVICE) =="; \
	    $(PY) tests/mpi_run.py -n $$n --timeout $(GPU_TEST_TIMEOUT) -- \
	        tests/gpu -q -rs; \
	done

# The GPU run offline (the lent GPU machines reach no registry; docs/gpu.md,
# "Offline").  gpu-wheelhouse, here where pip reaches PyPI: every wheel the
# device lacks, for Python 3.12 (numpy 1.26.4, cupy-cuda13x 13.6.0,
# fastrlock, MPICH, mpi4py, Chainer 7.8.1 and this package built here, small
# pure-Python ones installed only where missing) into .gpu-wheels/part1,
# part2, ... of at most GPU_PART_MIB MiB each (one device call carries one
# part; 64 MiB with the working tree).  gpu-dry-run: that flow here, with
# Python 3.12, no GPU and no registry (benchmarks/gpu_dry_run.sh, 2-3 min).
GPU_PYTHON ?= python3.12
GPU_PART_MIB ?= 56
.PHONY: gpu-wheelhouse gpu-dry-run
gpu-wheelhouse:
	@py=$$(sh tools/python.sh find $(GPU_PYTHON)) && set -x && \
	    "$$py" -m benchmarks.gpu_offline wheelhouse --out .gpu-wheels \
	    --python "$$py" --part-mib $(GPU_PART_MIB)

gpu-dry-run:
	bash benchmarks/gpu_dry_run.sh $(GPU_PYTHON)

# The peer framework of benchmarks/harness/peers_torch.py (PyTorch DDP), in
# a venv of its own: torch's CPU wheel, pinned (an unpinned torch pulls a
# CUDA build of several GB).  The main venv provides mpiexec.  The project's pip
# constraints (setuptools<70, for chainer) are not this venv's: torch needs
# a newer setuptools, so they are left out here.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
.PHONY: peers-venv
peers-venv: $(PEERS_STAMP)

$(PEERS_STAMP):
	@sh tools/python.sh venv $(PEERS_VENV) "$(PYTHON)"
	env -u PIP_CONSTRAINT -u PIP_BUILD_CONSTRAINT \
	    $(PEERS_VENV)/bin/python -m pip install -q torch==2.13.0 'numpy<2'
	touch $(PEERS_STAMP)

# Ours against PyTorch DDP (float32, fp16 hook, PowerSGD hook r1/r4) on the
# same bed in the same run, compute-matched, interleaved rounds with
# intervals: benchmarks/results/peers.json.  Optional: never run by `make
# test`.  The default is the lighter model (ResNet-18 at 128 px, batch 8),
# where the communication is largest against the compute; PEERS_ARGS='--model
# resnet50 --batch 4 --insize 224' measures ResNet-50.
# Then our sharding (shard='optimizer' | 'gradients' | 'parameters',
# Adam) against ZeroRedundancyOptimizer, FSDP2 and FSDP1 on the same bed
# in the same run, compute-matched, and bytes per parameter per rank of
# both sides: benchmarks/results/peers_sharding.json.  bench-peers-sharding
# runs it alone; PEERS_SHARDING_ARGS passes options, e.g. '--stages 0 3'.
PEERS_ARGS ?= --model resnet18 --batch 8 --insize 128
PEERS_SHARDING_ARGS ?= --model resnet18 --batch 8 --insize 128
.PHONY: bench-peers bench-peers-sharding
bench-peers: bench-deps peers-venv
	$(PY) -m benchmarks peers $(PEERS_ARGS)
	$(PY) -m benchmarks peers_sharding $(PEERS_SHARDING_ARGS)

bench-peers-sharding: bench-deps peers-venv
	$(PY) -m benchmarks peers_sharding $(PEERS_SHARDING_ARGS)

# PowerSGD's arithmetic per step, kernel by kernel, on ResNet-18's matrices
# (one process; KERNELS_ARGS='--build OLD.so' times another build alongside).
KERNELS_ARGS ?=
.PHONY: bench-kernels
bench-kernels: bench-deps
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
	$(PY) -m benchmarks powersgd_kernels $(KERNELS_ARGS)

# The start-up file's cost (chainermn_overlap-compat.pth, the stand-ins that
# let Chainer import on Python 3.12+): python -c pass and import chainer,
# with and without, interleaved: benchmarks/results/startup.json (or
# startup-3.12.json and so on: STARTUP_ARGS='--out ...').
STARTUP_ARGS ?=
.PHONY: bench-startup
bench-startup: venv
	$(PY) -m benchmarks startup $(STARTUP_ARGS)

# Two revisions side by side on the same bed, interleaved rounds, paired
# differences with intervals: make bench-ab A=main~1 B=WORKTREE
# [AB_ARGS='--modes alone overlap_forward --rounds 12'].
A ?= HEAD
B ?= WORKTREE
AB_ARGS ?=
.PHONY: bench-ab
bench-ab: bench-deps
	$(PY) -m benchmarks ab --a $(A) --b $(B) $(AB_ARGS)
