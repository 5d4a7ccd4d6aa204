"""Bad input is refused with a message naming the problem, and the running batch never notices."""
import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def engine_with(tiny, **config):
    return Engine(EngineConfig(model="tiny", **config), loaded=tiny)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
])
def test_invalid_sampling_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_larger_than_the_whole_pool_is_rejected_not_left_waiting(tiny):
    engine = engine_with(tiny, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError,
                       match=r"prompt \(30 tokens\) \+ max_tokens \(5\) = 35 exceeds the whole KV pool "
                                         r"of 32 tokens"):
        engine.add_request([7] * 30, SamplingParams(max_tokens=5))
    assert not engine.has_unfinished()
    engine.add_request([7] * 30, SamplingParams(max_tokens=3))     # 30 + 3 - 1 = 32 positions: fits exactly
    while engine.has_unfinished():
        engine.step()


def test_prompt_beyond_the_context_names_the_lengths(tiny):
    engine = engine_with(tiny)
    with pytest.raises(ValueError, match=r"prompt \(2000 tokens\) \+ max_tokens \(100\) = 2100 exceeds the "
                                         r"model's context of 2048 tokens"):
        engine.add_request([5] * 2000, SamplingParams(max_tokens=100))


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([5, -1], r"prompt token ids must be in \[0, "),
    ([5, 10**9], r"prompt token ids must be in \[0, "),
])
def test_empty_or_out_of_vocabulary_prompts_are_refused(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine_with(tiny).add_request(prompt)


def test_bad_input_never_disturbs_running_requests(tiny):
    prompts = [[11, 12, 13], [21] * 9, [31] * 4]
    params = SamplingParams(max_tokens=12)
    expected = [c.token_ids for c in engine_with(tiny).generate(prompts, params)]
    engine = engine_with(tiny, max_num_seqs=3)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()
    for bad in ([], [5] * 5000, [-3]):
        with pytest.raises(ValueError):
            engine.add_request(bad, params)
    with pytest.raises(ValueError):
        engine.set_knob("max_num_batched_tokens", -4)
    with pytest.raises(ValueError):
        engine.add_request([1], params, request_id=ids[0])          # an id already in use
    assert engine.abort("no-such-request") is False
    while engine.has_unfinished():
        engine.step()
    assert [engine.completion(i).token_ids for i in ids] == expected
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_engine_config_refuses_bad_values():
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer in \[1, 256\]"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="layout must be one of condense, indexmap, gather"):
        EngineConfig(layout="zigzag")
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")
