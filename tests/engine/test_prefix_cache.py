"""Automatic prefix caching: the block pool's hashes, reference counts and eviction, the reason for every
miss, and greedy outputs identical with caching on and off (and to transformers)."""
import random

import pytest
from test_outputs_match_transformers import hf_greedy

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.kv_cache import KVCacheManager, block_hash
from batchtop.engine.core.sampling import SamplingParams
from batchtop.engine.model.loading import load_model
from batchtop.telemetry import events as ev

BS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def admit(kv: KVCacheManager, request_id: str, tokens: list[int]):
    """Look up, allocate every known token, compute them all, as the scheduler and the step do."""
    found = kv.lookup(request_id, tokens)
    assert kv.try_allocate(request_id, len(tokens), found) is not None
    kv.cache_computed(request_id, tokens, len(tokens))
    assert kv.audit() == []
    return found


def test_full_blocks_are_shared_and_the_last_token_is_never_a_hit():
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 13))                            # 3 full blocks
    first = admit(kv, "a", prompt)
    assert (first.num_cached_tokens, first.reason, first.num_full_blocks) == (0, "no_prefix", 2)
    same = admit(kv, "b", prompt)
    # the last known token is computed to sample: a block-aligned prompt hits all but its last block
    assert same.num_cached_tokens == 8 and same.reason is None
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2] and kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert kv.num_used_blocks == 4                         # two shared, one each of its own
    longer = admit(kv, "c", prompt + [99, 98])
    assert longer.num_cached_tokens == 12 and longer.reason is None   # the last partial block is no miss
    assert kv.num_used_blocks + kv.num_cached_blocks + kv.num_empty_blocks == kv.num_blocks


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    clock = Clock()
    kv = KVCacheManager(6, BS, clock=clock)
    admit(kv, "a", list(range(1, 10)))                    # 3 blocks, 2 full and cached
    kv.free("a")
    assert (kv.num_used_blocks, kv.num_cached_blocks, kv.num_empty_blocks) == (0, 2, 4)
    clock.t = 5.0
    admit(kv, "b", list(range(50, 62)))                    # 3 blocks: the 3 empty ones at the head
    assert kv.take_evictions() == []
    clock.t = 7.0
    again = admit(kv, "c", list(range(100, 106)))          # 2 blocks: one empty, then the oldest cached
    evicted = kv.take_evictions()
    assert len(evicted) == 1 and evicted[0].t == 7.0
    # "a" was freed last block first: its second full block was evicted before its first
    clock.t = 10.0
    hit = kv.lookup("d", list(range(1, 10)))
    assert hit.num_cached_tokens == BS and hit.reason == "evicted" and hit.evicted_ago_s == 3.0
    assert again.reason == "no_prefix"
    assert kv.audit() == []


def test_a_cached_free_block_hit_leaves_the_free_queue():
    kv = KVCacheManager(4, BS)
    admit(kv, "a", list(range(1, 10)))
    kv.free("a")
    found = kv.lookup("b", list(range(1, 10)))
    assert found.num_hit_blocks == 2
    # 3 blocks needed, 2 of them cached: 1 new; the 2 hit ones no longer count as free
    assert kv.can_allocate("b", 9, cached=found) and not kv.can_allocate("b", 9, reserve=2, cached=found)
    kv.try_allocate("b", 9, found)
    assert (kv.num_used_blocks, kv.num_cached_blocks, kv.num_free_blocks) == (3, 0, 1)
    assert kv.audit() == []


@pytest.mark.parametrize("second, reason, matched", [
    ([1, 2, 3, 77, 5, 6, 7, 8, 9], "below_block", 3),       # shares 3 of a 4-token block
    ([1, 55, 56, 57, 5, 6, 7, 8, 9], "no_prefix", 0),       # a common first token is no prefix
    ([1, 2, 3, 4, 66, 6, 7, 8, 9], "partial", 0),           # 1 of 2 full blocks, then one never seen
])
def test_the_reason_for_a_miss(second, reason, matched):
    kv = KVCacheManager(16, BS)
    admit(kv, "a", list(range(1, 10)))
    found = kv.lookup("b", second)
    assert (found.reason, found.num_matched_tokens) == (reason, matched)
    assert found.prefix_id


def test_caching_off_shares_nothing_and_says_disabled():
    kv = KVCacheManager(16, BS, enable_caching=False)
    admit(kv, "a", list(range(1, 10)))
    found = admit(kv, "b", list(range(1, 10)))
    assert (found.num_cached_tokens, found.reason) == (0, "disabled")
    kv.free("a")
    kv.free("b")
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 16


def test_the_hash_chains_the_parent():
    assert block_hash(b"", [1, 2]) != block_hash(block_hash(b"", [0, 0]), [1, 2])
    assert block_hash(b"", [1, 2]) == block_hash(b"", [1, 2])


# -- the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def shared_prefix_prompts(rng, vocab, num, prefix_len):
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 30))] for _ in range(num)]


def run(loaded, prompts, max_tokens, rng_seed=3, **config):
    """Requests arriving at random steps; the completions' tokens and the events."""
    events = []
    engine = Engine(EngineConfig(model="tiny", **config), sink=events.append, loaded=loaded)
    rng = random.Random(rng_seed)
    pending, ids = list(zip(prompts, max_tokens)), []
    while pending or engine.has_unfinished():
        for _ in range(rng.choice([0, 1, 2])):
            if pending:
                prompt, n = pending.pop(0)
                ids.append(engine.add_request(prompt, SamplingParams(max_tokens=n)))
        engine.step()
        assert engine.kv.audit() == []
    outputs = [engine.completion(request_id) for request_id in ids]
    assert engine.kv.num_used_blocks == 0
    return outputs, events


@pytest.mark.parametrize("config", [
    dict(max_num_seqs=6, num_kv_blocks=200),
    dict(max_num_seqs=6, max_num_batched_tokens=32, long_prefill_token_threshold=8, num_kv_blocks=14),
], ids=["batched", "chunked-preempting"])
def test_greedy_outputs_are_the_same_with_caching_on_and_off(tiny, config):
    rng = random.Random(11)
    vocab = tiny.model.config.vocab_size
    prompts = shared_prefix_prompts(rng, vocab, 16, 37) + shared_prefix_prompts(rng, vocab, 6, 9)
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    on, on_events = run(tiny, prompts, max_tokens, **config)
    off, off_events = run(tiny, prompts, max_tokens, enable_prefix_caching=False, **config)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    admitted_on = [e for e in on_events if isinstance(e, ev.RequestAdmitted)]
    admitted_off = [e for e in off_events if isinstance(e, ev.RequestAdmitted)]
    assert sum(e.num_cached_tokens for e in admitted_on) > 12 * 32
    assert {e.miss_reason for e in admitted_off} == {"disabled"}
    computed = [sum(e.num_tokens for e in events if isinstance(e, ev.PrefillChunk))
                for events in (on_events, off_events)]
    assert computed[0] < 0.6 * computed[1], "the shared prefix is computed once (and after evictions)"
    if "long_prefill_token_threshold" in config:
        assert sum(c.num_preemptions for c in on) > 0, "the small pool was meant to preempt"
        assert any(isinstance(e, ev.BlocksEvicted) for e in on_events)
        resumed = [e for e in admitted_on if e.resumed]
        assert any(e.num_cached_tokens > 0 for e in resumed), "a preempted request re-hits its blocks"
    for e in on_events:
        if isinstance(e, (ev.StepPlanned, ev.StepFinished)):
            assert e.kv_blocks_used + e.kv_blocks_cached <= e.kv_blocks_total


def test_cached_prefixes_match_transformers_generate(tiny):
    reference = load_model("tiny")
    rng = random.Random(5)
    prompts = shared_prefix_prompts(rng, tiny.model.config.vocab_size, 5, 33)
    prompts += [prompts[0], prompts[0][:32], prompts[0][:33]]     # whole prompt cached; block-aligned
    outputs, events = run(tiny, prompts, [6] * len(prompts), max_num_seqs=4, num_kv_blocks=100,
                          max_num_batched_tokens=48, long_prefill_token_threshold=16)
    for prompt, completion in zip(prompts, outputs):
        assert completion.token_ids == hf_greedy(reference.model, [prompt], 6)[0]
    assert any(isinstance(e, ev.BlocksCached) for e in events)


@pytest.mark.parametrize("caching", [True, False])
def test_each_arrival_names_its_prompt_s_full_blocks_by_their_hashes(tiny, caching):
    """Prompts that share their first two blocks name them alike and the third apart; a prompt shorter
    than a block names none; the first name is the prefix_id admission reports; an engine that does not
    cache prefixes names none."""
    events = []
    engine = Engine(EngineConfig(model="tiny", block_size=BS, enable_prefix_caching=caching),
                    sink=events.append, loaded=tiny)
    shared = list(range(10, 18))
    ids = []
    for prompt in (shared + [30, 31, 32, 33, 34], shared + [40, 41, 42, 43], [50, 51, 52]):
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=2)))
        engine.step()                           # the first prompt computed before the second arrives
    while engine.has_unfinished():
        engine.step()
    arrived = [e.prompt_blocks for e in events if isinstance(e, ev.RequestArrived)]
    if not caching:
        assert arrived == [(), (), ()]
        return
    first, second, short = arrived
    assert len(first) == len(second) == 3 and short == ()
    assert first[:2] == second[:2] and first[2] != second[2]
    assert all(len(name) == 12 for name in first)
    admitted = {e.request_id: e for e in events if isinstance(e, ev.RequestAdmitted)}
    assert admitted[ids[1]].prefix_id == first[0] and admitted[ids[1]].num_cached_tokens == 2 * BS
