"""Run with .venv-vllm's Python: vLLM's real `Scheduler` (batchtop's subclass), built without a model
or a device as vLLM's own tests/v1/core build it, stepped on a thread with made-up runner outputs,
its side endpoint on $BATCHTOP_EVENTS_PORT. Prints `ready` once the endpoint answers.

Lines on stdin: `add N` adds N requests (16-token prompts, 24 output tokens); `fail` makes the
observer raise at the next step (batchtop's part switches itself off; vLLM's scheduling goes on);
`steps` prints the number of steps run; `quit` ends.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from batchtop.engine.vllm.scheduler import BatchtopScheduler

BLOCK_SIZE = 16
MAX_NUM_SEQS = 8
MAX_TOKENS = 512


def build(model_dir: str) -> BatchtopScheduler:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=MAX_TOKENS, dtype="float32")
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)   # requests here carry no hashes
    config = VllmConfig(model_config=model, cache_config=cache,
                        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                                         max_num_batched_tokens=MAX_TOKENS,
                                                         max_model_len=MAX_TOKENS, is_encoder_decoder=False),
                        device_config=DeviceConfig(device="cpu"))
    config.cache_config.num_gpu_blocks = 65
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=65, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return BatchtopScheduler(vllm_config=config, kv_cache_config=kv,
                             structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
                             log_stats=True)


def step(scheduler) -> None:
    out: SchedulerOutput = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        done = request.num_computed_tokens + out.num_scheduled_tokens[rid] >= request.num_tokens
        sampled.append([7] if done else [])
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                               sampled_token_ids=sampled)
    scheduler.update_from_output(out, runner)


def main() -> None:
    scheduler = build(sys.argv[1])
    lock, stop, steps, ids = threading.Lock(), threading.Event(), [0], itertools.count()

    def run():
        while not stop.is_set():
            with lock:
                step(scheduler)
                steps[0] += 1
            time.sleep(0.002)
    threading.Thread(target=run, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        with lock:
            if command == "add":
                for _ in range(int(arg or 1)):
                    scheduler.add_request(Request(f"r{next(ids)}", list(range(1, 17)),
                                                  SamplingParams(max_tokens=24, ignore_eos=True), None))
            elif command == "fail":
                def broken(*args, **kwargs):
                    raise RuntimeError("injected observer failure")
                scheduler.batchtop_observer.scheduled = broken
            elif command == "steps":
                pass
            elif command == "quit":
                break
        print(f"ok {steps[0]}", flush=True)
    stop.set()
    scheduler.shutdown()


if __name__ == "__main__":
    main()
