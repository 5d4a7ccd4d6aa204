"""The Makefile's vLLM environments: a failed build is retried by the next `make setup`; `make clean`
removes them. Run with a stand-in for engine/vllm/setup-venv.sh, in a temporary folder."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")

# A stand-in for the setup script: fails (says why in UNAVAILABLE, exit status 3) while a file `fail`
# lies beside it.
FAKE_SETUP = """mkdir -p "$VLLM_VENV"
rm -f "$VLLM_VENV/UNAVAILABLE"
echo run >> "$VLLM_VENV/runs"
if [ -e "$(dirname "$0")/fail" ]; then echo "no wheel for this CPU" > "$VLLM_VENV/UNAVAILABLE"; exit 3; fi
exit 0
"""


def make(tmp_path: Path, *targets: str) -> subprocess.CompletedProcess:
    venvs = f"{tmp_path}/venv-a {tmp_path}/venv-b"
    return subprocess.run(["make", "-C", str(ROOT), f"VLLM_VENVS={venvs}", f"VLLM_SETUP={tmp_path}/setup.sh",
                           *targets], capture_output=True, text=True)


def test_a_failed_vllm_environment_is_retried_until_it_succeeds(tmp_path):
    (tmp_path / "setup.sh").write_text(FAKE_SETUP)
    (tmp_path / "fail").touch()
    stamps = [f"{tmp_path}/venv-a/.setup-done", f"{tmp_path}/venv-b/.setup-done"]
    for _ in range(2):
        result = make(tmp_path, *stamps)
        assert result.returncode == 0, result.stderr
        assert not any(Path(stamp).exists() for stamp in stamps)
    assert (tmp_path / "venv-a" / "UNAVAILABLE").read_text() == "no wheel for this CPU\n"
    (tmp_path / "fail").unlink()
    assert make(tmp_path, *stamps).returncode == 0
    assert all(Path(stamp).exists() for stamp in stamps)
    assert make(tmp_path, *stamps).returncode == 0                     # done: not run again
    assert (tmp_path / "venv-a" / "runs").read_text() == "run\n" * 3
    assert (tmp_path / "venv-b" / "runs").read_text() == "run\n" * 3


def test_make_clean_removes_every_vllm_environment(tmp_path):
    result = make(tmp_path, "-n", "clean")
    assert result.returncode == 0, result.stderr
    assert f"rm -rf .venv {tmp_path}/venv-a {tmp_path}/venv-b" in result.stdout
