"""The engine end to end with the Triton kernels forced (through the interpreter on the CPU)."""
import random

from batchtop import kernels
from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.kernels import cpu


def test_tiny_engine_gives_the_same_greedy_tokens_on_triton_and_torch(monkeypatch):
    rng = random.Random(11)
    loaded = load_model("tiny")
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=6)
    config = dict(model="tiny", max_num_seqs=3, max_num_batched_tokens=32, long_prefill_token_threshold=12)
    try:
        triton = Engine(EngineConfig(attention_backend="triton", **config), loaded=loaded)
        assert kernels.resolve_backend("cpu") == "triton"
        with monkeypatch.context() as patch:      # the torch path's C++ decode kernel must not serve any step
            patch.setattr(cpu, "paged_decode", _not_on_triton)
            on_triton = [c.token_ids for c in triton.generate(prompts, params)]
    finally:
        kernels.select_backend("auto")
    on_torch = [c.token_ids for c in Engine(EngineConfig(attention_backend="torch", **config),
                                            loaded=loaded).generate(prompts, params)]
    assert on_triton == on_torch
    assert all(len(t) == 6 for t in on_torch)


def _not_on_triton(*args, **kwargs):
    raise AssertionError("the C++ decode kernel ran with the triton backend selected")
