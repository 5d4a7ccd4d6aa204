"""The Triton kernels compile for sm_90 as the launchers configure them (no GPU needed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=230)
    if result.returncode == 77:
        pytest.skip("this triton has no NVIDIA backend")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("attention ok") == 5 and result.stdout.count("write ok") == 5
