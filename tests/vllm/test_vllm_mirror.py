"""The guest's mirror of vLLM's persistent batch against vLLM's own InputBatch (mirror_check.py, in
vLLM's interpreter): no server, so it runs on whichever worker is free."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_helpers import skip_reason

from batchtop.engine.vllm.launch import vllm_python


def test_the_mirrored_slots_are_vllms_own_input_batch_rows():
    """vLLM's InputBatch (its real code, in vLLM's interpreter) and the mirror agree over random steps."""
    if skip_reason():
        pytest.skip(f"no vLLM here: {skip_reason()}")
    script = Path(__file__).with_name("mirror_check.py")
    done = subprocess.run([str(vllm_python()), str(script), "7", "2000"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mismatches"] == 0 and result["moves"] > 500, result
