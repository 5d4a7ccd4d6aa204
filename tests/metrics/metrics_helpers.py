"""How the tests start a stock vLLM (no batchtop scheduler class): eager (~25 s to start), one OpenMP
thread, a small KV pool (6 blocks of 128 tokens, max_model_len 512, 8 rows) so a short load makes
requests wait."""
from __future__ import annotations

import pytest

STOCK_VLLM_PORT = 8210


def stock_vllm_options(port: int, **overrides):
    from batchtop.engine.model.loading import smollm2_folder
    from batchtop.engine.vllm.launch import VllmOptions
    settings = dict(model=str(smollm2_folder(lambda *_: None)), port=port, scheduler_cls=None,
                    enforce_eager=True, max_num_seqs=8, max_model_len=512, num_gpu_blocks_override=6,
                    kv_cache_gib=1, omp_threads=1)
    settings.update(overrides)
    return VllmOptions(**settings)


def skip_without_vllm() -> None:
    from batchtop.engine.vllm.launch import vllm_available
    reason = vllm_available()
    if reason:
        pytest.skip(f"no vLLM here: {reason}")
