"""batchtop's class inside vLLM's real scheduler on a virtual clock, on every vLLM version it supports
(0.32's CPU build in .venv-vllm, 0.33 in .venv-vllm033), each in its own interpreter: no model,
no server. harness_check.py runs the scenarios and checks every step against vLLM's own objects (the
`checked` fixture of conftest.py: one run per environment). The prefix-cache loads of prefix_loads.py
are one of its scenarios; on the real server: test_vllm_prefix_cache.py."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from prefix_loads import LOADS, expected_reasons
from vllm_helpers import VLLM_ENVS, env_python, env_skip_reason


@pytest.mark.parametrize("scenario", ["fold", "fold_async"])
def test_the_fold_of_the_events_is_vllms_state_after_every_step(checked, scenario):
    """Over > 2,000 steps of a random trace with a small pool, shared prefixes (prefix caching),
    chunked prefill, aborts and knobs turned at random steps: the fold equals vLLM's requests, queues,
    blocks and token counts, and every RequestPreempted is a real `_preempt_request`."""
    result = checked[scenario]
    assert result["failures"] == []
    counts = result["counts"]
    assert counts["steps"] >= 2000 and counts["checks"] >= 2000
    for seen in ("preemptions", "prefix_hits", "chunks", "aborts", "knob_changes"):
        assert counts[seen] > 0, (seen, counts)


def test_each_wait_is_split_by_what_stopped_admission_and_the_split_sums_to_the_wait(checked):
    """RequestAdmitted / RequestRetired carry the wait split as batchtop's engine gives it: exact sums,
    and the same split the AdmissionBlocked stream gives the dashboard, across every reason."""
    result = checked["waits"]
    assert result["failures"] == []
    counts = result["counts"]
    assert counts["admitted"] > 50 and counts["retired_waiting"] > 0 and counts["preemptions"] > 0
    assert {"max_num_seqs", "budget", "kv", "preemption"} <= {
        reason for reason, seconds in counts["by_reason"].items() if seconds > 0}


def test_max_num_seqs_lowered_under_load_never_preempts_and_binds_as_rows_finish(checked):
    result = checked["max_num_seqs"]
    assert result["failures"] == []
    assert result["counts"]["max_running_after_raise"] > 2


def test_the_budget_and_the_chunk_threshold_lowered_live_bound_every_later_step(checked):
    assert checked["budget"]["failures"] == []


@pytest.mark.parametrize("scenario", ["failure", "failure_async"])
def test_a_failure_in_batchtops_part_leaves_vllms_scheduling_as_stock_and_says_why(checked, scenario):
    """A fault in a step, and a side endpoint that cannot start (its port taken): vLLM schedules on as
    its own class would, batchtop's part is off with the reason, the start failure is logged (a server
    that serves on with it: test_sweep_launch.py)."""
    result = checked[scenario]
    assert result["failures"] == []
    assert result["counts"]["preemptions"] > 0
    assert "injected fault" in result["counts"]["failure"]
    assert "could not start" in result["counts"]["start_failure"]
    assert "Address already in use" in result["counts"]["start_failure"]


def test_an_untested_vllm_version_is_refused_naming_the_tested_ones_and_the_override(checked):
    gate = checked["gate_and_check"]["counts"]
    assert "tested on vLLM 0.32.0, 0.33.0; this is vLLM 0.34.0" in gate["refused"]
    assert "BATCHTOP_VLLM_ANY_VERSION=1" in gate["refused"] and gate["overridden"]


def test_the_check_says_version_class_and_whether_the_events_port_is_free(checked):
    """`batchtop.engine.vllm.check` in this vLLM: supported, the class for this machine's async setting
    (the CPU build, or no device: the synchronous class), the port free (ready, 0) or taken (1)."""
    gate = checked["gate_and_check"]["counts"]
    port = gate["port"]
    free, taken = gate["free"], gate["taken"]
    assert gate["free_status"] == 0 and free.strip().endswith("\nready")
    assert f"vLLM {checked['vllm']}: supported" in free
    assert "--scheduler-cls batchtop.engine.vllm.scheduler.BatchtopScheduler" in free
    assert f"events port {port + 1} (rank 0): free" in free
    assert gate["taken_status"] == 1 and f"events port {port} (rank 0): taken" in taken

    assert taken.strip().endswith("not ready")


@pytest.mark.parametrize("argv", [["--events-port", "70000"],
                                  ["--data-parallel-size", "0", "--events-port", "1"]])
def test_the_check_refuses_bad_input_in_one_line(argv):
    env = next((e for e in sorted(VLLM_ENVS) if not env_skip_reason(e)), None)
    if env is None:
        pytest.skip("no vLLM environment here")
    done = subprocess.run([str(env_python(env)), "-m", "batchtop.engine.vllm.check", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_the_harness_runs_as_a_module_with_json_in_and_out(checked):
    """`python -m batchtop.engine.vllm.harness --trace T --limits L --scheduler batchtop --events`:
    each request ends as its trace says (a stop token, max_tokens, an abort), the limits hold, and
    batchtop's events come out; a trace with an unknown field is refused in one line, exit 2."""
    result = checked["module"]
    assert result["failures"] == []
    assert "RequestRetired" in result["counts"]["kinds"] and "StepFinished" in result["counts"]["kinds"]


def test_batchtop_vllm_check_runs_the_check_with_vllms_python():
    """From batchtop's side: `batchtop vllm check` hands its flags to vLLM's interpreter (a bad port
    comes back as the check's exit 2, before vLLM is imported)."""
    if env_skip_reason(".venv-vllm"):
        pytest.skip(f"no vLLM 0.32 here: {env_skip_reason('.venv-vllm')}")
    batchtop = Path(sys.executable).with_name("batchtop")
    done = subprocess.run([str(batchtop), "vllm", "check", "--events-port", "70000"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "events port must be 1..65535" in done.stderr


def shared_blocks(a, b) -> int:
    """Leading entries two lists share."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("load", LOADS)
def test_under_the_harness_reasons_and_sums_are_vllms(checked, load):
    """Synchronous and async scheduling: each admission's reason as expected, its cached tokens vLLM's
    hits for it, the sums vLLM's hits and queries, the cached free blocks vLLM's after every step
    (harness_check.py's `prefix_cache` scenario: the `checked` fixture of conftest.py)."""
    for mode in (load, f"{load}_async"):
        run = checked["prefix_cache"]["runs"][mode]
        assert run["failure"] is None and run["vllm_preempted"] == 0
        assert run["reasons"] == expected_reasons(load), mode
        assert run["cached"] == run["vllm_hits"]
        assert (run["sum_cached"], run["sum_known"]) == (run["vllm_hits_total"], run["vllm_queries_total"])
        assert run["kv_blocks_cached"] == run["vllm_cached_free"], mode
        # each arrival names its prompt's full blocks by vLLM's hashes: equal leading names where the
        # prompts' leading blocks are equal, and only there
        prompts, names = run["prompts"], run["prompt_blocks"]
        assert [len(n) for n in names] == [len(p) // 16 for p in prompts]
        for (p, n), (q, m) in itertools.combinations(zip(prompts, names), 2):
            assert shared_blocks(n, m) == shared_blocks(
                [tuple(p[k:k + 16]) for k in range(0, len(p) // 16 * 16, 16)],
                [tuple(q[k:k + 16]) for k in range(0, len(q) // 16 * 16, 16)])
        if load == "shared":
            assert run["sum_cached"] == 2 * 48
        if load == "eviction":
            assert run["evicted_blocks"] > 0


def test_the_rank_of_a_dense_models_data_parallel_engine_is_vllms_index(checked):
    """vLLM runs a dense model's ranks as independent engines, each with data_parallel_rank 0: batchtop's
    class takes the rank from data_parallel_index, so rank 1 serves its endpoint on the base port + 1
    (reading data_parallel_rank, both ranks took the base port and rank 0's endpoint failed to start),
    and says the ranks do not run in lock step (the fleet then names no pacer)."""
    counts = checked["gate_and_check"]["counts"]
    assert counts["dp_rank"] == [0, 1, False]          # rank 1, not in lock step with rank 0
    assert counts["dp_lock_step"] is True
