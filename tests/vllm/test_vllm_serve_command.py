"""`batchtop vllm serve --print-command`: the line it would run (no vLLM starts)."""
from __future__ import annotations

import pytest
from vllm_helpers import skip_reason

from batchtop.tui.cli import main


@pytest.fixture(autouse=True)
def needs_vllm():
    if skip_reason():
        pytest.skip(f"no vLLM here: {skip_reason()}")


def printed_line(capsys, *flags: str) -> str:
    assert main(["vllm", "serve", "--print-command", *flags]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_max_num_seqs_is_vllms_own_unless_given(capsys):
    line = printed_line(capsys)
    assert "--scheduler-cls batchtop.engine.vllm.scheduler.BatchtopScheduler" in line
    assert "--max-num-seqs" not in line, "vLLM's own default, not one of batchtop's"
    assert "--max-num-seqs 8 " in printed_line(capsys, "--max-num-seqs", "8") + " "
