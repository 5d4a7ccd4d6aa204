"""The reference text's phenomena, one load and set of knobs each, on the embedded engine.

A scenario is engine settings (`config`: what must be set at start, such as the KV pool or
the layout), a Poisson load, requests scripted at given steps, and knob changes at given
steps (`phases`). `batchtop --scenario NAME` opens the dashboard on it; `run_scenario` runs it
headless for a bounded number of steps on a virtual clock (`STEP_S` per step, so arrivals
are the same whatever the machine), which the tests and `python -m batchtop.engine.workload.scenarios`
(the figures of docs/scenarios.md) use.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from batchtop.engine.core.config import EngineConfig
from batchtop.telemetry import events as ev

from .arrivals import LengthDist, PoissonLoad, SharedPrefixes, item_prompt, synthetic_prompt

STEP_S = 0.02                   # headless runs: virtual seconds per step, for the load's arrivals


@dataclass(frozen=True)
class Scenario:
    name: str
    watch: str                  # one line: what to look at on the dashboard
    claim: str                  # what the reference text says happens
    config: dict = field(default_factory=dict)                 # EngineConfig fields
    rate: float = 0.0           # Poisson arrivals per second
    prompt: LengthDist = LengthDist("exponential", 64.0, 1, 512)
    output: LengthDist = LengthDist("exponential", 64.0, 1, 512)
    script: tuple[tuple[int, int, int], ...] = ()              # (step, prompt tokens, output tokens)
    phases: tuple[tuple[int, str, object], ...] = ()           # (step, knob, value)
    prefixes: SharedPrefixes | None = None                     # the load's prompts start with these

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(**{**self.config, **overrides})

    def load(self, seed: int = 0) -> PoissonLoad:
        return PoissonLoad(self.rate, self.prompt, self.output, seed=seed, prefixes=self.prefixes)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "static-vs-continuous",
        watch="static batches until step 100, then continuous: batch utilisation (useful / total row-steps) "
              "and the ░ padding rows in the grid",
        claim="a static batch runs until its longest row finishes; finished rows are padding, so utilisation "
              "falls with the spread of output lengths (the padding tax); continuous batching refills them",
        config={"batching_mode": "static", "static_batch_size": 8, "max_num_seqs": 8},
        rate=12.0, prompt=LengthDist("uniform", 32.0, 8, 64), output=LengthDist("exponential", 32.0, 4, 128),
        phases=((100, "batching_mode", "continuous"),)),
    Scenario(
        "kv-exhaustion",
        watch="a KV pool of 40 blocks for 16 rows: × preemptions in the grid, recompute chunks in the log",
        claim="when the pool runs dry the scheduler frees a running request's blocks (recompute) or "
              "retracts it; its tokens are computed again later: the recompute tax",
        config={"num_kv_blocks": 40, "max_num_seqs": 16, "max_num_batched_tokens": 256},
        rate=10.0, prompt=LengthDist("uniform", 48.0, 16, 96), output=LengthDist("uniform", 96.0, 32, 160)),
    Scenario(
        "long-prefill",
        watch="a 1536-token prompt joins 8 decoding rows at step 20: that step's decode tokens wait for it; "
              "from step 60 the chunked-prefill threshold (64) caps every step's prompt tokens",
        claim="a long prompt in one step stalls every decode row's inter-token latency; a chunked-prefill "
              "threshold splits it over steps and caps the stall",
        config={"max_num_seqs": 16, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 0},
        script=tuple((0, 16, 400) for _ in range(8)) + ((20, 1536, 8), (70, 1536, 8)),
        phases=((60, "long_prefill_token_threshold", 64),)),
    Scenario(
        "alternating",
        watch="one-token requests leave below longer-lived rows every other step: ↓ moves under condense; "
              "run with --layout indexmap and nothing moves",
        claim="condense repairs holes by sliding the highest row down, so churn under long-lived rows "
              "costs copies nearly every step; an index map never moves rows",
        config={"max_num_seqs": 32, "layout": "condense"},
        # every other step: four one-token requests (they leave at the next step) and one that stays 30 steps,
        # admitted after them, so it sits above the holes they leave
        script=tuple(item for k in range(1, 2000, 2) for item in [(k, 8, 1)] * 4 + [(k, 8, 30)]),
    ),
    Scenario(
        "max-num-seqs",
        watch="max_num_seqs 4 until step 60, then 32 on a pool of 64 blocks: throughput rises a little, "
              "then preemptions (×) take over",
        claim="raising max_num_seqs without the KV memory to back it turns into preemptions, not throughput",
        config={"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 512},
        rate=20.0, prompt=LengthDist("uniform", 48.0, 16, 96), output=LengthDist("uniform", 96.0, 48, 160),
        phases=((60, "max_num_seqs", 32),)),
    Scenario(
        "shared-system-prompt",
        watch="every request starts with one 384-token system prompt: the cached column, the hit-rate "
              "line near 90%, prefill tokens a tenth of the prompt tokens (--no-enable-prefix-caching: all)",
        claim="with prefix caching a shared prefix is computed once: admission needs only the tokens after "
              "it, so prefill tokens and TTFT fall by the shared share",
        config={"max_num_seqs": 16, "max_num_batched_tokens": 512},
        rate=8.0, prompt=LengthDist("uniform", 40.0, 16, 64), output=LengthDist("uniform", 20.0, 8, 32),
        prefixes=SharedPrefixes(count=1, num_tokens=384)),
    Scenario(
        "below-block",
        watch="a 15-token common prefix with 16-token blocks: 0% hits, and every miss says below_block",
        claim="only full blocks are cached, so a shared prefix shorter than one block never hits",
        config={"max_num_seqs": 16},
        rate=8.0, prompt=LengthDist("uniform", 64.0, 32, 96), output=LengthDist("uniform", 20.0, 8, 32),
        prefixes=SharedPrefixes(count=1, num_tokens=15)),
    Scenario(
        "cache-eviction",
        watch="12 system prompts of 10 blocks each in a pool of 64 blocks: the cache section's evictions, "
              "hits falling and evicted misses climbing as the pool churns",
        claim="freed blocks stay cached until a new block is needed; when the prefixes outgrow the pool, "
              "the least recently freed are evicted and tomorrow's hit becomes an evicted miss",
        config={"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 512},
        rate=10.0, prompt=LengthDist("uniform", 24.0, 8, 40), output=LengthDist("uniform", 24.0, 8, 40),
        prefixes=SharedPrefixes(count=12, num_tokens=160)),
)}


def run_scenario(scenario: Scenario, steps: int, *, loaded=None, seed: int = 0,
                 **overrides) -> list[ev.Event]:
    """Run `steps` steps headless on the virtual clock; every event, in order."""
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.sampling import SamplingParams
    events: list[ev.Event] = []
    config = scenario.engine_config(model=overrides.pop("model", "tiny"), **overrides)
    engine = Engine(config, sink=events.append, loaded=loaded)
    load = scenario.load(seed) if scenario.rate > 0 else None
    rng = random.Random(seed)
    script = sorted(scenario.script)
    phases = sorted(scenario.phases)
    for step in range(steps):
        while phases and phases[0][0] <= step:
            _, name, value = phases.pop(0)
            engine.set_knob(name, value, source="test")
        items = [(p, o) for s, p, o in script if s == step]
        prompts = [(synthetic_prompt(p, rng), o) for p, o in items]
        if load is not None:
            prompts += [(item_prompt(item, rng), item.output_tokens) for item in load.due(step * STEP_S)]
        for prompt, output_tokens in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=output_tokens, ignore_eos=True))
        engine.step()
    return events


def report(name: str, events: list[ev.Event]) -> str:
    """The figure a scenario shows, from its events (docs/scenarios.md)."""
    steps = [e for e in events if isinstance(e, ev.StepFinished)]
    planned = {e.step: e for e in events if isinstance(e, ev.StepPlanned)}
    knob_steps = [e.step for e in events if isinstance(e, ev.KnobChanged)]
    cut = knob_steps[0] if knob_steps else None

    def util(part):
        total = sum(e.num_rows for e in part)
        return sum(len(e.sampled_request_ids) for e in part) / total if total else 0.0

    if name == "static-vs-continuous":
        before, after = [e for e in steps if e.step < cut], [e for e in steps if e.step >= cut]
        return (f"batch utilisation: static {util(before):.3f} over {len(before)} steps, "
                f"continuous {util(after):.3f} over {len(after)} steps")
    if name in ("kv-exhaustion", "max-num-seqs"):
        preempted = [e for e in events if isinstance(e, (ev.RequestPreempted, ev.RequestRetracted))]
        recomputed = sum(e.tokens_to_recompute for e in preempted)
        computed = sum(e.num_tokens for e in steps)
        out = sum(len(e.sampled_request_ids) for e in steps)
        text = (f"{len(preempted)} preemptions, recompute tax {recomputed / max(1, computed):.3f} "
                f"({recomputed} of {computed} tokens), {out} output tokens in {len(steps)} steps")
        if cut is not None:
            early = sum(1 for e in preempted if e.step < cut)
            text += f"; preemptions before step {cut}: {early}, after: {len(preempted) - early}"
        return text
    if name == "long-prefill":
        def median(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] * 1e3 if xs else float("nan")

        def stall(part):
            decode_only = [e.step_s for e in part if planned[e.step].num_decode_rows
                           and not planned[e.step].prefill_tokens]
            mixed = [e for e in part if planned[e.step].num_decode_rows and planned[e.step].prefill_tokens]
            if not mixed:
                return "no step with prompt tokens and decode rows"
            most = max(planned[e.step].prefill_tokens for e in mixed)
            biggest = [e.step_s for e in mixed if planned[e.step].prefill_tokens == most]
            return (f"{len(biggest)} step(s) of {most} prompt tokens + decode rows took "
                    f"{median(biggest):.1f} ms (median), decode-only steps {median(decode_only):.1f} ms")
        before, after = [e for e in steps if e.step < cut], [e for e in steps if e.step >= cut]
        return f"threshold off: {stall(before)}; threshold 64: {stall(after)}"
    if name == "alternating":
        rebuilt = [e for e in events if isinstance(e, ev.BatchRebuilt)]
        moved = sum(1 for e in rebuilt if e.rows_moved)
        return (f"layout {rebuilt[0].layout if rebuilt else '?'}: rows moved on {moved} of {len(steps)} "
                f"steps ({sum(e.rows_moved for e in rebuilt)} rows, {sum(e.num_bytes for e in rebuilt)} "
                "bytes)")
    if name in PREFIX_SCENARIOS:
        return prefix_report(events)
    return ""


def prefix_report(events: list[ev.Event]) -> str:
    """Hits, prefill tokens, misses by reason and evictions, in the first and second half of the run."""
    admitted = [e for e in events if isinstance(e, ev.RequestAdmitted) and not e.resumed]
    chunks = [e for e in events if isinstance(e, ev.PrefillChunk)]
    ttft = sorted(e.ttft_s for e in events if isinstance(e, ev.FirstToken))
    half = len(admitted) // 2

    def rate(part):
        return sum(e.num_cached_tokens for e in part) / max(1, sum(e.num_known_tokens for e in part))

    reasons: dict[str, int] = {}
    for e in admitted:
        reasons[e.miss_reason or "none"] = reasons.get(e.miss_reason or "none", 0) + 1
    evicted = sum(len(e.block_ids) for e in events if isinstance(e, ev.BlocksEvicted))
    p50 = ttft[len(ttft) // 2] * 1e3 if ttft else float("nan")
    queried = sum(e.num_known_tokens for e in admitted)
    computed = sum(e.num_tokens for e in chunks)
    return (f"{len(admitted)} requests, token hit rate {rate(admitted):.3f} (first half "
            f"{rate(admitted[:half]):.3f}, second {rate(admitted[half:]):.3f}); prompt tokens {queried}, "
            f"prefill computed {computed}; misses {dict(sorted(reasons.items()))}; {evicted} blocks evicted; "
            f"TTFT p50 {p50:.1f} ms")


PREFIX_SCENARIOS = ("shared-system-prompt", "below-block", "cache-eviction")
REPORT_STEPS = {"static-vs-continuous": 250, "kv-exhaustion": 200, "long-prefill": 120, "alternating": 120,
                "max-num-seqs": 160, "shared-system-prompt": 120, "below-block": 100, "cache-eviction": 200}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run each scenario headless and print its figure")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("names", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args(argv)
    from batchtop.engine.model.loading import load_model
    loaded = load_model(args.model, __import__("torch").float32)
    for name in args.names:
        scenario = SCENARIOS[name]
        runs = {"alternating": [{"layout": "condense"}, {"layout": "indexmap"}],
                "shared-system-prompt": [{}, {"enable_prefix_caching": False}]}.get(name, [{}])
        for overrides in runs:
            start = time.perf_counter()
            events = run_scenario(scenario, REPORT_STEPS[name], loaded=loaded, model=args.model, **overrides)
            label = "".join(f" ({key}={value})" for key, value in overrides.items() if key != "layout")
            print(f"{name}{label}: {report(name, events)}  [{time.perf_counter() - start:.1f} s wall]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


