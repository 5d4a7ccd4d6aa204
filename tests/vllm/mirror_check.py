"""Run by vLLM's interpreter: vLLM's own InputBatch against batchtop's mirror over random steps.

Each step applies the worker's order (vllm/v1/worker/gpu_model_runner.py `_update_states`):
remove finished, remove unscheduled (in batch - (scheduled - resumed)), add new then cached-
but-absent requests, condense. Prints one JSON line: steps, moves seen, mismatches.
"""
import json
import random
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from batchtop.engine.vllm.slots import InputBatchMirror

MAX_REQS, MAX_LEN = 24, 64


def state(req_id: str, num_tokens: int) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=list(range(num_tokens)), mm_features=[],
                              sampling_params=SamplingParams(), generator=None, block_ids=([0],),
                              num_computed_tokens=0, output_token_ids=[])


def main(seed: int, num_steps: int) -> None:
    rng = random.Random(seed)
    batch = InputBatch(max_num_reqs=MAX_REQS, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN,
                       device=torch.device("cpu"), vocab_size=1000, block_sizes=[16],
                       max_num_blocks_per_req=[4])
    mirror = InputBatchMirror()
    live: dict[str, int] = {}            # running requests (in or out of the batch) -> tokens
    preempted: set[str] = set()
    next_id = mismatches = moves = 0
    for _ in range(num_steps):
        finished = set(rng.sample(sorted(live), k=min(len(live), rng.randint(0, 3))))
        for r in finished:
            del live[r]
        preempted -= finished                # an abort can end a waiting request too
        running = [r for r in live if r not in preempted]
        resumed = {r for r in preempted if rng.random() < 0.5}
        preempted -= resumed
        new = []
        while len(live) + len(new) < MAX_REQS - 2 and rng.random() < 0.6:
            new.append(f"r{next_id}")
            next_id += 1
        scheduled = {r for r in running if rng.random() < 0.85} | resumed | set(new)
        newly_preempted = {r for r in running if r not in scheduled and rng.random() < 0.3}
        preempted |= newly_preempted
        for r in new:
            live[r] = rng.randint(1, MAX_LEN - 1)
        cached = [r for r in running if r in scheduled] + sorted(resumed)
        for r in finished:
            batch.remove_request(r)
        for r in set(batch.req_id_to_index) - (scheduled - resumed):
            batch.remove_request(r)
        for r in new + [r for r in cached if r not in batch.req_id_to_index]:
            batch.add_request(state(r, live[r]))
        batch.condense()
        batch.refresh_metadata()
        update = mirror.update(finished, scheduled, resumed, new + cached, lambda r: live[r])
        moves += len(update.moves)
        mismatches += dict(batch.req_id_to_index) != mirror.slot_of
    print(json.dumps({"steps": num_steps, "moves": moves, "mismatches": mismatches, "requests": next_id}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
