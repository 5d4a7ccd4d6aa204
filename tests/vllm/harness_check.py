"""Run by vLLM's interpreter: batchtop's class inside vLLM's real scheduler, under the harness.

Each scenario checks after every step, against vLLM's own objects (its `requests`, `running`,
`waiting`, the KV cache manager's blocks per request, `num_computed_tokens`, the output tokens of
each `Request`), never against batchtop's bookkeeping. Prints one JSON object: per scenario, the
counts it saw and the list of failures (empty when it passed).
"""

import json
import random
import sys
import time

from vllm.v1.request import RequestStatus

from batchtop.engine.vllm.control import set_knob
from batchtop.engine.vllm.harness import Harness, Limits, TraceRequest, build_scheduler, on_virtual_time
from batchtop.telemetry import events as ev
from batchtop.telemetry.state import BatchState
from batchtop.telemetry.wait_clock import NEXT_STEP, WaitClock

STATUS = {
    RequestStatus.RUNNING: "running",
    RequestStatus.WAITING: "waiting",
    RequestStatus.PREEMPTED: "preempted",
}
PREFIX_LEN = 64


def random_trace(
    rng: random.Random,
    num_requests: int,
    *,
    rate: float,
    prompt=(8, 300),
    output=(1, 120),
    prefix_share=0.3,
    abort_share=0.1,
    long_prompts=False,
) -> list[TraceRequest]:
    prefixes = [[rng.randrange(10, 30_000) for _ in range(PREFIX_LEN)] for _ in range(3)]
    trace, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(rate)
        num_prompt = rng.randint(*prompt) if not long_prompts else rng.randint(400, 900)
        ids = [rng.randrange(10, 30_000) for _ in range(num_prompt)]
        if rng.random() < prefix_share:
            ids = rng.choice(prefixes) + ids
        output_len = rng.randint(*output)
        max_tokens = output_len if rng.random() < 0.7 else output_len + rng.randint(1, 20)
        abort = t + rng.uniform(0.0, 2.0) if rng.random() < abort_share else None
        trace.append(
            TraceRequest(
                arrival_s=t,
                output_len=output_len,
                prompt_token_ids=tuple(ids),
                max_tokens=max_tokens,
                priority=rng.randint(0, 3),
                abort_s=abort,
                request_id=f"r{i}",
            )
        )
    return trace


def vllm_state(s, in_flight_tokens: dict[str, int]) -> dict[str, tuple]:
    """Every live request as vLLM holds it: (status, computed, output tokens, KV blocks); the computed
    tokens of a step still in flight (async scheduling) are not yet reported by the events."""
    state = {}
    for request_id, request in s.requests.items():
        if request.is_finished():
            continue
        blocks = sum(len(ids) for ids in s.kv_cache_manager.get_block_ids(request_id))
        computed = request.num_computed_tokens - in_flight_tokens.get(request_id, 0)
        state[request_id] = (STATUS[request.status], computed, request.num_output_tokens, blocks)
    return state


class FoldCheck:
    """Between steps: the fold of batchtop's events equals vLLM's state; knobs turned at random steps."""

    def __init__(self, rng: random.Random, knob_every: int, limits: Limits):
        self.rng, self.knob_every, self.limits = rng, knob_every, limits
        self.fold = BatchState()
        self.events: list = []
        self.failures: list[str] = []
        self.preempt_calls: list[str] = []
        self.knob_changes = 0
        self.checks = 0

    def install(self, s) -> None:
        real = s._preempt_request

        def preempt(request, *args, **kwargs):
            self.preempt_calls.append(request.request_id)
            return real(request, *args, **kwargs)

        s._preempt_request = preempt

    def __call__(self, h: Harness) -> None:
        s = h.scheduler
        new = s.batchtop_events.drain()
        self.events.extend(new)
        self.fold.feed(new)
        in_flight = {}
        for output, _, _ in h.in_flight:
            for request_id, n in output.num_scheduled_tokens.items():
                in_flight[request_id] = in_flight.get(request_id, 0) + n
        folded = {
            rid: (st, computed, out, blocks)
            for rid, (st, _, computed, out, blocks) in self.fold.keys().items()
        }
        expected = vllm_state(s, in_flight)
        self.checks += 1
        if folded != expected and len(self.failures) < 5:
            diff = {
                rid: (folded.get(rid), expected.get(rid))
                for rid in set(folded) | set(expected)
                if folded.get(rid) != expected.get(rid)
            }
            self.failures.append(f"step {len(h.steps)}: fold != vLLM: {dict(list(diff.items())[:4])}")
        if self.knob_every and len(h.steps) and self.rng.random() < 1 / self.knob_every:
            name = self.rng.choice(["max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"])
            high = {
                "max_num_seqs": self.limits.max_num_seqs,
                "max_num_batched_tokens": self.limits.max_num_batched_tokens,
                "long_prefill_token_threshold": self.limits.max_num_batched_tokens,
            }[name]
            low = 0 if name == "long_prefill_token_threshold" else max(1, high // 4)
            if set_knob(s, name, self.rng.randint(low, high), "test") is None:
                self.knob_changes += 1


def fold_scenario(async_scheduling: bool, seed: int = 1, num_steps: int = 2200) -> dict:
    limits = Limits(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=0,
        num_blocks=64,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
        policy="fcfs",
    )
    rng = random.Random(seed)
    s = build_scheduler(limits, "batchtop")
    check = FoldCheck(rng, knob_every=40, limits=limits)
    check.install(s)
    h = Harness(s, random_trace(rng, 400, rate=6.0), between_steps=check)
    h.run(num_steps)
    check(h)
    events = check.events
    preempted = [e.request_id for e in events if isinstance(e, ev.RequestPreempted)]
    failures = list(check.failures)
    # Under async scheduling vLLM can preempt a request in step N+1 whose last token is in flight in
    # step N: it retires in N, and the held plan of N+1 drops its preemption (observer._emit_plan).
    retired = {e.request_id for e in events if isinstance(e, ev.RequestRetired)}
    unreported, matched = [], 0
    for request_id in check.preempt_calls:  # the events: the calls, in order, less the unreported
        if matched < len(preempted) and preempted[matched] == request_id:
            matched += 1
        else:
            unreported.append(request_id)
    if matched != len(preempted):
        failures.append("RequestPreempted events that are not _preempt_request calls, in their order")
    if unreported and (not async_scheduling or any(r not in retired for r in unreported)):
        failures.append(f"_preempt_request calls without a RequestPreempted event: {unreported[:5]}")
    counts = {
        "steps": len(h.steps),
        "checks": check.checks,
        "preemptions": len(preempted),
        "preempted_while_last_token_in_flight": len(unreported),
        "prefix_hits": sum(
            isinstance(e, ev.RequestAdmitted) and not e.resumed and e.num_computed_tokens > 0 for e in events
        ),
        "chunks": sum(
            isinstance(e, ev.PrefillChunk) and e.num_computed_tokens < e.num_known_tokens for e in events
        ),
        "aborts": sum(isinstance(e, ev.RequestRetired) and e.reason == "abort" for e in events),
        "knob_changes": sum(isinstance(e, ev.KnobChanged) for e in events),
        "retired": sum(isinstance(e, ev.RequestRetired) for e in events),
    }
    return {"counts": counts, "failures": failures}


def steady_trace(num_requests: int, prompt: int, output: int, every_s: float) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=i * every_s, num_prompt_tokens=prompt, output_len=output, request_id=f"q{i}")
        for i in range(num_requests)
    ]


def max_num_seqs_scenario() -> dict:
    """The cap lowered from 8 to 2 with 8 running and more arriving: no preemption, no admission
    while above the cap, running falls to 2 as rows finish and stays; raised back, it climbs."""
    limits = Limits(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=400)  # no KV pressure
    s = build_scheduler(limits, "batchtop")
    failures, phase, seen = (
        [],
        {"lowered_at": None, "raised_at": None},
        {"max_after_raise": 0, "min_before": 99},
    )

    def between(h: Harness) -> None:
        running = len(s.running)
        if phase["lowered_at"] is None and running >= 8:
            assert set_knob(s, "max_num_seqs", 2, "test") is None
            phase["lowered_at"] = len(h.steps)
        elif (
            phase["lowered_at"] is not None
            and phase["raised_at"] is None
            and len(h.steps) > phase["lowered_at"] + 200
        ):
            assert set_knob(s, "max_num_seqs", 8, "test") is None
            phase["raised_at"] = len(h.steps)
        seen["running_before"] = running

    prev = {"running": 0}

    def step_time(output) -> float:
        step = len(h.steps) + 1
        lowered, raised = phase["lowered_at"], phase["raised_at"]
        if lowered is not None and step > lowered and (raised is None or step <= raised):
            if output.preempted_req_ids:
                failures.append(
                    f"step {step}: preempted {sorted(output.preempted_req_ids)} after the cap was lowered"
                )
            admitted = [r.req_id for r in output.scheduled_new_reqs] + list(
                output.scheduled_cached_reqs.resumed_req_ids
            )
            if admitted and prev["running"] >= 2:
                failures.append(
                    f"step {step}: admitted {admitted} with {prev['running']} running, above the cap 2"
                )
            if len(s.running) > max(2, prev["running"]):
                failures.append(f"step {step}: running rose to {len(s.running)}")
            if step > lowered + 150 and len(s.running) > 2:
                failures.append(f"step {step}: still {len(s.running)} running 150 steps after the cap of 2")
        if raised is not None and step > raised:
            seen["max_after_raise"] = max(seen["max_after_raise"], len(s.running))
        return 0.02

    h = Harness(s, steady_trace(120, 32, 60, 0.05), step_time=step_time, between_steps=between)

    def track(hh: Harness) -> None:
        prev["running"] = len(s.running)
        between(hh)

    h.between_steps = track
    h.run(1500)
    events = s.batchtop_events.drain()
    if phase["lowered_at"] is None:
        failures.append("the running count never reached 8")
    if seen["max_after_raise"] <= 2:
        failures.append(f"raised back to 8, running only reached {seen['max_after_raise']}")
    retired = sum(isinstance(e, ev.RequestRetired) for e in events)
    if retired != 120:
        failures.append(f"{retired} of 120 requests retired")
    return {
        "counts": {
            "steps": len(h.steps),
            "lowered_at": phase["lowered_at"],
            "raised_at": phase["raised_at"],
            "max_running_after_raise": seen["max_after_raise"],
            "retired": retired,
        },
        "failures": failures,
    }


def budget_scenario() -> dict:
    """The token budget and long_prefill_token_threshold lowered under a long-prompt load: every later
    step schedules at most the budget, and no prompt chunk exceeds the threshold."""
    limits = Limits(
        max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=0, num_blocks=600
    )
    s = build_scheduler(limits, "batchtop")
    failures, state = [], {"budget": 512, "threshold": 0, "changes": 0, "chunks_at_threshold": 0}
    plan = {
        30: ("max_num_batched_tokens", 200),
        90: ("long_prefill_token_threshold", 48),
        160: ("max_num_batched_tokens", 96),
        240: ("long_prefill_token_threshold", 0),
    }

    def between(h: Harness) -> None:
        change = plan.get(len(h.steps))
        if change and state.get("done") != len(h.steps):
            state["done"] = len(h.steps)
            assert set_knob(s, *change, "test") is None
            state["budget" if change[0] == "max_num_batched_tokens" else "threshold"] = change[1]
            state["changes"] += 1

    def step_time(output) -> float:
        step = len(h.steps) + 1
        if output.total_num_scheduled_tokens > state["budget"]:
            failures.append(
                f"step {step}: {output.total_num_scheduled_tokens} tokens over the budget {state['budget']}"
            )
        for request_id, n in output.num_scheduled_tokens.items():
            request = s.requests[request_id]
            prefill = request.num_computed_tokens - n < request.num_prompt_tokens
            if prefill and state["threshold"] and n > state["threshold"]:
                failures.append(f"step {step}: a chunk of {n} over the threshold {state['threshold']}")
            state["chunks_at_threshold"] += prefill and n == state["threshold"]
        return 0.02

    h = Harness(s, steady_trace(60, 700, 8, 0.1), step_time=step_time, between_steps=between)
    h.run(3000)
    if state["changes"] != 4 or not state["chunks_at_threshold"]:
        failures.append(f"changes {state['changes']}, chunks at the threshold {state['chunks_at_threshold']}")
    return {
        "counts": {"steps": len(h.steps), **{k: v for k, v in state.items() if k != "done"}},
        "failures": failures,
    }


def failure_scenario(async_scheduling: bool) -> dict:
    """vLLM's stock class, batchtop's class, batchtop's class whose part fails at step 300 (injected)
    and batchtop's class whose side endpoint cannot start (its port is taken, as inside a server): the
    same steps, the same request outcomes; each failure's reason is kept and the start failure logged."""
    import logging
    import os
    import socket

    limits = Limits(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_blocks=64,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )

    def run(kind: str, fail_at: int | None, endpoint: bool = False):
        s = build_scheduler(limits, kind, endpoint=endpoint)
        h = Harness(s, random_trace(random.Random(5), 160, rate=8.0))
        if fail_at is not None:

            def between(hh: Harness) -> None:
                if len(hh.steps) == fail_at and s.batchtop_observer is not None:

                    def broken(*args, **kwargs):
                        raise RuntimeError("injected fault")

                    s.batchtop_observer.scheduled = broken

            h.between_steps = between
        h.run(800)
        steps = [(r.num_scheduled_tokens, r.preempted_req_ids, r.finished_req_ids) for r in h.steps]
        outcome = {
            r.request_id: (r.finish_reason, r.num_output_tokens, r.num_preemptions)
            for r in h.requests.values()
        }
        return s, steps, outcome

    _, stock_steps, stock_outcome = run("vllm", None)
    _, ours_steps, ours_outcome = run("batchtop", None)
    broken, broken_steps, broken_outcome = run("batchtop", 300)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("vllm.batchtop.engine.vllm.scheduler")
    logger.addHandler(handler)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        os.environ["BATCHTOP_EVENTS_PORT"] = str(taken.getsockname()[1])
        try:
            unstarted, unstarted_steps, unstarted_outcome = run("batchtop", None, endpoint=True)
        finally:
            del os.environ["BATCHTOP_EVENTS_PORT"]
            logger.removeHandler(handler)
    failures = []
    if ours_steps != stock_steps or ours_outcome != stock_outcome:
        failures.append("batchtop's class scheduled differently from vLLM's own")
    if broken_steps != stock_steps or broken_outcome != stock_outcome:
        failures.append("after batchtop's part failed, vLLM scheduled differently from stock")
    reason = broken.batchtop_failure or ""
    if (
        "schedule failed" not in reason
        or "injected fault" not in reason
        or broken.batchtop_observer is not None
    ):
        failures.append(f"batchtop_failure is {broken.batchtop_failure!r}")
    if ours_steps and build_scheduler(limits, "batchtop").batchtop_failure is not None:
        failures.append("a working batchtop class has a batchtop_failure")
    if unstarted_steps != stock_steps or unstarted_outcome != stock_outcome:
        failures.append("with batchtop's side endpoint not started, vLLM scheduled differently from stock")
    if unstarted.batchtop_observer is not None or unstarted.batchtop_endpoint is not None:
        failures.append("batchtop's part still runs after its side endpoint could not start")
    if "batchtop: could not start; vLLM goes on without it" not in logged:
        failures.append(f"the start failure was not logged: {logged}")
    return {
        "counts": {
            "steps": len(stock_steps),
            "preemptions": sum(len(p) for _, p, _ in stock_steps),
            "failure": reason,
            "start_failure": unstarted.batchtop_failure,
        },
        "failures": failures,
    }


def gate_and_check_scenario() -> dict:
    """The version gate (an untested version refused, then let through by the override) and the check
    command's answers with the events port free and taken, in this vLLM's interpreter."""
    import contextlib
    import io
    import os
    import socket

    from batchtop.engine.vllm import check
    from batchtop.engine.vllm.scheduler import check_vllm_version

    out = {}
    check_vllm_version()
    try:
        check_vllm_version("0.34.0")
        out["refused"] = None
    except RuntimeError as refused:
        out["refused"] = str(refused)
    os.environ["BATCHTOP_VLLM_ANY_VERSION"] = "1"
    try:
        check_vllm_version("0.34.0")
        out["overridden"] = True
    finally:
        del os.environ["BATCHTOP_VLLM_ANY_VERSION"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        for name, argv in (
            ("taken", ["--events-port", str(port)]),
            ("free", ["--events-port", str(port + 1)]),
        ):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                out[f"{name}_status"] = check.main(argv)
            out[name] = text.getvalue()
    out["port"] = port
    # a dense model's data-parallel ranks are independent engines: vLLM resets each one's
    # data_parallel_rank to 0 and keeps the rank in data_parallel_index (rank 1 here)
    scheduler = build_scheduler(Limits(), "batchtop")
    config = scheduler.vllm_config.parallel_config
    config.data_parallel_index = 1
    config.reconfigure_for_independent_dp_rank()
    out["dp_rank"] = [config.data_parallel_rank, scheduler._batchtop_rank(), scheduler._batchtop_lock_step()]
    config.data_parallel_size = 2              # a mixture-of-experts model's ranks keep their group
    out["dp_lock_step"] = scheduler._batchtop_lock_step()
    return {"counts": out, "failures": []}


def module_scenario() -> dict:
    """`python -m batchtop.engine.vllm.harness` (its main, in this interpreter): JSON in, JSON out."""
    import contextlib
    import io
    import tempfile

    from batchtop.engine.vllm import harness

    failures = []
    with tempfile.TemporaryDirectory() as folder:
        trace, limits, bad = (f"{folder}/{name}.json" for name in ("trace", "limits", "bad"))
        with open(trace, "w") as f:
            json.dump(
                [
                    {"arrival_s": 0.0, "num_prompt_tokens": 40, "output_len": 5, "max_tokens": 8},
                    {"arrival_s": 0.01, "prompt_token_ids": list(range(10, 30)), "output_len": 6},
                    {"arrival_s": 0.02, "num_prompt_tokens": 30, "output_len": 50, "abort_s": 0.2},
                ],
                f,
            )
        with open(limits, "w") as f:
            json.dump({"max_num_seqs": 2, "num_blocks": 20}, f)
        with open(bad, "w") as f:
            json.dump([{"arrival_s": 0.0, "output_len": 3, "colour": "red"}], f)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            status = harness.main(
                [
                    "--trace",
                    trace,
                    "--limits",
                    limits,
                    "--scheduler",
                    "batchtop",
                    "--events",
                    "--step-time-s",
                    "0.01",
                ]
            )
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            bad_status = harness.main(["--trace", bad])
    result = json.loads(text.getvalue())
    reasons = {r["request_id"]: r["finish_reason"] for r in result["requests"]}
    if status != 0 or reasons != {"0": "stop", "1": "length", "2": "abort"}:
        failures.append(f"status {status}, finish reasons {reasons}")
    if max(len(s["num_scheduled_tokens"]) for s in result["steps"]) > 2:
        failures.append("more rows than max_num_seqs 2")
    kinds = {e["kind"] for e in result["events"]}
    if bad_status != 2 or "unknown field(s) colour" not in errors.getvalue():
        failures.append(f"bad trace: status {bad_status}, {errors.getvalue()!r}")
    return {
        "counts": {
            "steps": len(result["steps"]),
            "events": len(result["events"]),
            "kinds": sorted(kinds),
            "reasons": reasons,
        },
        "failures": failures,
    }


def waits_scenario() -> dict:
    """Each wait split by reason (RequestAdmitted / RequestRetired from the queue): the split sums to the
    wait (from the request's RequestArrived or RequestPreempted), and equals the split a WaitClock gets
    from the events' own AdmissionBlocked stream (what the dashboard runs). A load that waits for the
    row cap, the token budget and the pool, preempts, and aborts requests while they wait."""
    limits = Limits(max_num_seqs=3, max_num_batched_tokens=48, num_blocks=14, block_size=16)
    rng = random.Random(3)
    trace = [TraceRequest(arrival_s=0.013 * i, num_prompt_tokens=rng.randint(10, 90),
                          output_len=rng.randint(5, 60), request_id=f"w{i}",
                          abort_s=0.013 * i + 0.05 if i % 9 == 4 else None) for i in range(60)]
    s = build_scheduler(limits, "batchtop")
    events: list = []
    h = Harness(s, trace, step_time=lambda output: 0.02, events_to=events.extend)
    with on_virtual_time(h):
        h.run()
    failures, clock, marks, joined = [], WaitClock(), {}, {}
    waits = {"admitted": 0, "retired_waiting": 0, "by_reason": {}}
    for e in events:
        if isinstance(e, ev.AdmissionBlocked):
            clock.set(e.t, e.reason)
        elif isinstance(e, ev.StepPlanned) and not e.num_waiting:
            clock.set(e.t, NEXT_STEP)
        elif isinstance(e, (ev.RequestArrived, ev.RequestPreempted)):
            marks[e.request_id], joined[e.request_id] = clock.mark(e.t), e.t
        elif isinstance(e, (ev.RequestAdmitted, ev.RequestRetired)) and e.request_id in marks:
            mark, start = marks.pop(e.request_id), joined.pop(e.request_id)
            expected = dict(zip(*clock.split(mark, e.t)))
            split = dict(zip(e.wait_reasons, e.wait_s))
            waits["admitted" if isinstance(e, ev.RequestAdmitted) else "retired_waiting"] += 1
            for reason, seconds in split.items():
                waits["by_reason"][reason] = waits["by_reason"].get(reason, 0.0) + seconds
            if abs(sum(split.values()) - (e.t - start)) > 1e-9 or split.keys() != expected.keys() or any(
                    abs(split[r] - expected[r]) > 1e-9 for r in split):
                failures.append(f"{e.kind} {e.request_id} at {e.t:.3f}: split {split}, waited "
                                f"{e.t - start:.6f} s, the AdmissionBlocked stream gives {expected}")
        elif isinstance(e, ev.RequestRetired) and e.wait_s:
            failures.append(f"RequestRetired {e.request_id}: a wait split though it was not waiting")
    return {"counts": {**waits, "preemptions": sum(isinstance(e, ev.RequestPreempted) for e in events)},
            "failures": failures[:5]}


def prefix_cache_scenario() -> dict:
    """prefix_cache_check.py's loads (test_vllm_harness.py reads them)."""
    from prefix_cache_check import run_all

    return {"runs": run_all(), "counts": {}, "failures": []}


SCENARIOS = {
    "fold": lambda: fold_scenario(False),
    "fold_async": lambda: fold_scenario(True),
    "max_num_seqs": max_num_seqs_scenario,
    "budget": budget_scenario,
    "failure": lambda: failure_scenario(False),
    "failure_async": lambda: failure_scenario(True),
    "gate_and_check": gate_and_check_scenario,
    "waits": waits_scenario,
    "module": module_scenario,
    "prefix_cache": prefix_cache_scenario,
}


def main(names: list[str]) -> None:
    import vllm

    result = {"vllm": vllm.__version__}
    for name in names or SCENARIOS:
        started = time.perf_counter()
        result[name] = SCENARIOS[name]()
        result[name]["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
