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

.PHONY: venv test test-serial test-mpi lint typecheck demo bench clean

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

test-serial: venv
	$(BIN)/python -m pytest -q -m "not mpi" --timeout=300 tests

test-mpi: venv
	timeout 900 $(RUN) -n 2 -- $(MPIPYTEST) --timeout=240 tests
	timeout 900 $(RUN) -n 3 -- $(MPIPYTEST) --timeout=300 tests
	timeout 900 $(RUN) -n 4 -- $(MPIPYTEST) --timeout=300 tests
	MPITRAIN_BACKEND=torch timeout 600 $(RUN) -n 3 -- $(MPIPYTEST) --timeout=240 tests/comm

test: lint test-serial test-mpi

demo: venv
	$(BIN)/mpitrain demo --ranks $(NP) --strategy data --checkpoint --no-progress

bench: venv
	$(BIN)/mpitrain bench allreduce -n $(NP)

clean:
	rm -rf $(VENV) build src/*.egg-info
