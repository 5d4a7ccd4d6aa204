"""The dispatcher stays cheap: building every command's parser imports no torch, transformers, Textual
or FastAPI, and a command imports only what it runs. Each check runs in a fresh interpreter."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchtop.tui.cli import COMMANDS

HEAVY = ("torch", "transformers", "textual", "fastapi")
FIXTURE_LOG = Path(__file__).parent / "tui" / "fixtures" / "small.jsonl"

# Runs main(argv) (argv: JSON in sys.argv[1]) and prints the exit code and which HEAVY modules were imported.
CHILD = f"""
import contextlib, io, json, sys
from batchtop.tui.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(json.loads(sys.argv[1]))
    except SystemExit as exit:
        code = exit.code
print(json.dumps({{"code": code, "imported": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def run_main(*argv: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True, text=True,
                            timeout=120, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def batchtop_command() -> list[str]:
    script = Path(sys.executable).parent / "batchtop"
    return [str(script)] if script.exists() else [sys.executable, "-m", "batchtop.tui.cli"]


def test_help_lists_every_command_within_a_second():
    timings = []
    for _ in range(3):                   # the best of three: a busy machine slows one start, not all
        started = time.perf_counter()
        result = subprocess.run([*batchtop_command(), "--help"], capture_output=True, text=True, timeout=60,
                                check=True)
        timings.append(time.perf_counter() - started)
    assert all(name in result.stdout for name in COMMANDS)
    assert min(timings) < 1.0, f"batchtop --help took {min(timings):.2f} s at best"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["top", "--help"], ["bench", "--help"],
                                  ["export", str(FIXTURE_LOG), "--format", "summary"]],
                         ids=lambda argv: " ".join(a for a in argv if not a.startswith("/")))
def test_a_command_imports_nothing_heavy_it_does_not_run(argv):
    child = run_main(*argv)
    assert child == {"code": 0, "imported": []}


@pytest.mark.parametrize("module", sorted(set(COMMANDS.values())))
def test_each_command_module_is_cheap_to_import(module):
    code = f"import sys, {module}; print([m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]"
