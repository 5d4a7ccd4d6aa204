"""Imported by harness_check.py (vLLM's interpreter): batchtop's class inside vLLM's real scheduler,
under the harness, with prefix caching on and a pool of 5 usable blocks of 16 tokens, over the three
loads of prefix_loads.py (each in a scheduler of its own; synchronous and async scheduling).

Read from vLLM's own objects, never from batchtop's: the prefix-cache stats vLLM's scheduler hands out
with each step's outputs (what its `vllm:prefix_cache_hits` / `queries` counters add up), and after every
step the free blocks of its pool that still hold a hash. Per load and mode: the admissions' cached
tokens and reasons, vLLM's hits per admission, the sums.
"""

from prefix_loads import USABLE_BLOCKS, loads

from batchtop.engine.vllm.harness import Harness, Limits, TraceRequest, build_scheduler, on_virtual_time
from batchtop.telemetry import events as ev

BLOCK_SIZE = 16
OUTPUT_LEN = 2


def cached_free_blocks(pool) -> int:
    return sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt == 0 and b.block_hash is not None)


def run(prompts: list[list[int]], async_scheduling: bool) -> dict:
    limits = Limits(block_size=BLOCK_SIZE, num_blocks=USABLE_BLOCKS + 1, enable_prefix_caching=True,
                    max_num_batched_tokens=256, async_scheduling=async_scheduling)
    scheduler = build_scheduler(limits, "batchtop")
    trace = [TraceRequest(arrival_s=float(i), output_len=OUTPUT_LEN, prompt_token_ids=tuple(p),
                          request_id=f"q{i}") for i, p in enumerate(prompts)]
    hits, queries, per_step_hits, exact_cached, preempted = 0, 0, [], [], 0
    update = scheduler.update_from_output

    def counted(output, runner_output):
        nonlocal hits, queries, preempted
        outputs = update(output, runner_output)
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                pcs = stats.prefix_cache_stats
                hits += pcs.hits
                queries += pcs.queries
                preempted += pcs.preempted_requests
                if pcs.requests:
                    per_step_hits.append(pcs.hits)
        if output.total_num_scheduled_tokens:
            exact_cached.append(cached_free_blocks(scheduler.kv_cache_manager.block_pool))
        return outputs

    scheduler.update_from_output = counted
    harness = Harness(scheduler, trace, step_time=lambda output: 0.01)
    with on_virtual_time(harness):
        harness.run()
    events = list(scheduler.batchtop_events.drain())
    admitted = [e for e in events if isinstance(e, ev.RequestAdmitted)]
    finished_cached = [e.kv_blocks_cached for e in events if isinstance(e, ev.StepFinished)]
    return {
        "prompts": prompts,
        "prompt_blocks": [list(e.prompt_blocks) for e in events if isinstance(e, ev.RequestArrived)],
        "reasons": [e.miss_reason for e in admitted],
        "cached": [e.num_cached_tokens for e in admitted],
        "known": [e.num_known_tokens for e in admitted],
        "vllm_hits": per_step_hits,
        "sum_cached": sum(e.num_cached_tokens for e in admitted if not e.resumed),
        "sum_known": sum(e.num_known_tokens for e in admitted if not e.resumed),
        "vllm_hits_total": hits,
        "vllm_queries_total": queries,
        "vllm_preempted": preempted,
        "evicted_blocks": sum(len(e.block_ids) for e in events if isinstance(e, ev.BlocksEvicted)),
        "kv_blocks_cached": finished_cached,
        "vllm_cached_free": exact_cached,
        "failure": scheduler.batchtop_failure,
    }


def run_all() -> dict:
    """Every load, synchronous and async (`NAME` and `NAME_async`)."""
    return {f"{name}{'_async' if mode else ''}": run(prompts, mode)
            for name, prompts in loads(BLOCK_SIZE, seed=1).items() for mode in (False, True)}
