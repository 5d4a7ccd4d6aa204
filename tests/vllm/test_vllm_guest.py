"""The part of batchtop that runs inside vLLM: its event order under async scheduling (a failure of its own
that vLLM survives, the version gate and the check: test_vllm_harness.py)."""
from __future__ import annotations

from types import SimpleNamespace

from batchtop.engine.vllm.observer import StepObserver
from batchtop.telemetry import events as ev


def _request(rid: str, prompt: int, outputs: int = 0, computed: int = 0):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_tokens=prompt + outputs,
                           num_output_placeholders=0, num_computed_tokens=computed, max_tokens=8, priority=0,
                           arrival_time=0.0, num_preemptions=0)


def _output(new: dict[str, int], scheduled: dict[str, int], requests: dict):
    for rid, n in scheduled.items():
        requests[rid].num_computed_tokens += n
    cached = [r for r in scheduled if r not in new]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=0) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=cached, resumed_req_ids=set(),
                                              num_computed_tokens=[0] * len(cached)),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set())


def test_under_async_scheduling_the_stream_reads_plan_finish_plan_with_steps_in_order():
    """vLLM's async scheduling plans step N+1 before N's outputs: the observer holds N+1 back."""
    events = []
    observer = StepObserver(events.append, blocks_of=lambda rid: 1, kv_usage=lambda: (1, 5))
    requests = {"a": _request("a", 4)}
    observer.arrived(requests["a"])
    observer.before_schedule([])
    first = _output({"a": 4}, {"a": 4}, requests)                  # step 1: the prompt
    observer.scheduled(first, requests, 64, (1, 0), 0.001)
    requests["a"].num_output_placeholders = 1                     # async: step 2 planned on a placeholder
    observer.before_schedule([requests["a"]])
    second = _output({}, {"a": 1}, requests)
    observer.scheduled(second, requests, 64, (1, 0), 0.001)
    assert [type(e) for e in events][-1] is ev.StepPlanned and events[-1].step == 1
    token = SimpleNamespace(outputs=[SimpleNamespace(request_id="a", new_token_ids=[7], finish_reason=None)])
    observer.updated(first, {0: token}, (1, 0), 0.001)
    requests["a"].num_tokens, requests["a"].num_output_placeholders = 5, 0
    observer.updated(second, {0: token}, (1, 0), 0.001)
    kinds = [(type(e).__name__, e.step) for e in events if isinstance(e, (ev.StepPlanned, ev.StepFinished))]
    assert kinds == [("StepPlanned", 1), ("StepFinished", 1), ("StepPlanned", 2), ("StepFinished", 2)]
    assert [e.step for e in events] == sorted(e.step for e in events)
    planned = [e for e in events if isinstance(e, ev.StepPlanned)]
    assert (planned[0].prefill_tokens, planned[0].decode_tokens) == (4, 0)
    assert (planned[1].prefill_tokens, planned[1].decode_tokens) == (0, 1)     # the placeholder's decode row
