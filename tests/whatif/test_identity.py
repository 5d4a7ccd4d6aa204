"""Identity replay: a tiny-model recording re-scheduled by the same scheduler on the recorded step times
plans the recorded step at every step, under chunked prefill, both preemption modes, aborts, priority,
static batching and live knob changes."""
import pytest
from whatif_helpers import KNOB_PLAN, cached_at_admission, record_engine

from batchtop.engine.whatif.grid import format_table, whatif
from batchtop.engine.whatif.recording import recording_from
from batchtop.engine.whatif.replay import replay_identity, signatures
from batchtop.telemetry import events as ev


def test_identity_replay_plans_every_recorded_step(recording):
    kinds = {type(e) for e in recording.events}
    assert {ev.RequestPreempted, ev.RequestRetracted, ev.PaddingReleased, ev.KnobChanged} <= kinds
    assert any(isinstance(e, ev.PrefillChunk) and e.num_computed_tokens < e.num_known_tokens
               for e in recording.events)
    assert {r.reason for r in recording.requests} >= {"abort", "length"}
    assert len({r.priority for r in recording.requests}) > 1
    identity = replay_identity(recording)
    assert identity.num_steps >= 120
    assert identity.first_mismatch is None
    assert identity.match_share == 1.0
    assert signatures(identity.events) == signatures(recording.events)


def test_a_different_knob_changes_the_schedule_and_the_comparison_sees_it(recording):
    changed = [e for e in recording.events if not isinstance(e, ev.KnobChanged)]
    rec = type(recording)(recording.path, recording.header, changed, recording.t0, recording.requests,
                          recording.setup, [])
    identity = replay_identity(rec)
    assert identity.first_mismatch is not None and identity.match_share < 1.0


@pytest.mark.parametrize("join_at, layout", [(37, "condense"), (62, "condense"), (100, "condense"),
                                             (62, "indexmap")])
def test_a_recording_joined_mid_run_replays_from_its_snapshot_step_for_step(tiny, join_at, layout):
    """A recorder that joins a busy engine starts with the engine's snapshot and holds no arrival for the
    requests then in flight. The replay starts from them as the snapshot had them (running ones in their
    rows with their KV blocks, static padding rows, the queue in its order, priorities, preemptions,
    retraction's estimate, a batching mode set but not yet in force): every step as recorded, under
    retraction (37), in a static batch (62), just after it (100), and with the index-map layout."""
    rec = record_engine(tiny, steps=120, seed=3, policy="priority", knob_plan=KNOB_PLAN, layout=layout,
                        join_at=join_at)
    snapshot = rec.events[0]
    assert snapshot.cause == "subscribe" and len(rec.in_flight) >= 8 and rec.unseen == ()
    assert {item.request.request_id for item in rec.in_flight} == set(snapshot.request_ids)
    assert {item.status for item in rec.in_flight} >= {"running", "waiting"}
    identity = replay_identity(rec)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert signatures(identity.events) == signatures(rec.events)
    result = whatif(rec, {"max_num_seqs": [2]})
    assert "requests were in flight when the recording began" in format_table(result)
    assert result.to_dict()["in_flight_at_start"] == len(rec.in_flight)

    def tokens(events) -> int:
        return sum(len(e.sampled_request_ids) for e in events if isinstance(e, ev.StepFinished))
    assert {tokens(run.events) for run in result.runs} == {tokens(rec.events)}     # the whole recorded load


def test_a_request_named_without_arrival_or_snapshot_is_left_out_and_said_so(recording):
    """Events from the middle of a run with no snapshot (a log cut at its start): the requests they name
    that arrived before are left out, and the what-if says so."""
    join = 40
    arrived_before = {e.request_id for e in recording.events
                      if isinstance(e, ev.RequestArrived) and e.step < join}
    joined = [e for e in recording.events if e.step >= join and not isinstance(e, ev.EngineSnapshot)]
    named_after = {e.request_id for e in joined if hasattr(e, "request_id")}
    rec = recording_from(recording.header, joined)
    assert set(rec.unseen) == arrived_before & named_after and len(rec.unseen) >= 3
    assert rec.in_flight == () and recording.in_flight == recording.unseen == ()
    assert f"{len(rec.unseen)} requests were in flight when the recording began and are left out" in \
        format_table(whatif(rec, {}))


def test_the_end_of_a_step_under_way_before_the_joining_snapshot_is_left_out(tiny):
    """A recorder that joins while a step runs gets that step's last events before the snapshot it asked
    for (the snapshot has the state after them): the replay starts at the snapshot, every step as
    recorded."""
    whole = record_engine(tiny, steps=120, seed=3, policy="priority", knob_plan=KNOB_PLAN)
    joined = record_engine(tiny, steps=120, seed=3, policy="priority", knob_plan=KNOB_PLAN, join_at=62)
    snapshot = joined.events[0]
    finished = next(k for k, e in enumerate(whole.events)
                    if isinstance(e, ev.StepFinished) and e.step == snapshot.step)
    tail = [e for e in whole.events[finished:] if e.step == snapshot.step]
    assert isinstance(tail[0], ev.StepFinished) and tail[0].sampled_request_ids  # requests with no arrival
    rec = recording_from(joined.header, tail + joined.events)
    assert rec.events[0] is snapshot and rec.unseen == () and rec.num_before_snapshot == len(tail)
    assert f"its first {len(tail)} events, before the snapshot it starts from, are left out" in \
        rec.replay_words()[0]
    identity = replay_identity(rec)
    assert identity.first_mismatch is None and identity.match_share == 1.0


@pytest.fixture(scope="module")
def shared_prefixes(tiny):
    """A run whose prompts share 5 prefixes through the engine's prefix cache, in a pool small enough
    that cached blocks are evicted, with preemptions and aborts."""
    return record_engine(tiny, steps=150, seed=11, num_prefixes=5, num_kv_blocks=36)


def test_prompts_that_shared_prefixes_share_them_in_the_replay(shared_prefixes):
    """The arrivals name each prompt's full blocks by hash; the replay's made-up prompts share what
    those share, so its prefix cache hits, caches and evicts as the recorded one: every step as
    recorded, and each admission takes the recorded cached tokens."""
    rec = shared_prefixes
    cached = cached_at_admission(rec.events)
    assert rec.setup.enable_prefix_caching and sum(n for _, n in cached) > 500
    assert any(isinstance(e, ev.BlocksEvicted) for e in rec.events)
    assert any(isinstance(e, ev.RequestPreempted) for e in rec.events)
    assert rec.replay_words() == []         # every hit is on a block some earlier prompt names
    identity = replay_identity(rec)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert cached_at_admission(identity.events) == cached
    planned = [(e.step, e.kv_blocks_cached) for e in identity.events if isinstance(e, ev.StepPlanned)]
    assert planned == [(e.step, e.kv_blocks_cached) for e in rec.events if isinstance(e, ev.StepPlanned)]
    result = whatif(rec, {"max_num_seqs": [2, 8]})
    admitted = [e for e in rec.events if isinstance(e, ev.RequestAdmitted)]
    recorded, _, narrow, wider = result.runs
    assert recorded.row()["prefix_hit"] == pytest.approx(
        sum(e.num_cached_tokens for e in admitted) / sum(e.num_known_tokens for e in admitted))
    assert sum(n for _, n in cached_at_admission(wider.events)) > 0
    assert 0 < narrow.row()["prefix_hit"] != recorded.row()["prefix_hit"]
    assert "cached" in format_table(result).splitlines()[5]


def chat(tiny, num_turns: int = 3, seed: int = 3) -> tuple[dict, list]:
    """A chat on the tiny model: each turn sends the conversation so far (the last answer with it) and
    a new message, one turn after the other; (header, events)."""
    import random

    from batchtop.engine.core.config import EngineConfig
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.sampling import SamplingParams
    from batchtop.engine.whatif.recording import engine_header
    from batchtop.telemetry.recorder import make_header

    events: list = []
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=64, block_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=64, batch_capacity=8, max_model_len=128,
                                 enable_prefix_caching=True, flight_recorder_steps=0),
                    sink=events.append, loaded=tiny)
    header = make_header("tiny", engine.knobs(), engine=engine_header(engine))
    rng = random.Random(seed)
    conversation = [rng.randrange(100, 5000) for _ in range(10)]
    for _ in range(num_turns):
        engine.add_request(list(conversation), SamplingParams(max_tokens=12, ignore_eos=True))
        answer = []
        while engine.has_unfinished():
            for out in engine.step():
                answer += out.new_token_ids
        conversation += answer + [rng.randrange(100, 5000) for _ in range(5)]
    return header, events


def test_a_chats_next_turn_takes_the_last_answer_from_the_cache_in_the_replay_too(tiny):
    """A chat's next turn sends the conversation back with a new message: the cache gives it the last
    answer's blocks too, which no earlier prompt names. Its prompt names them, and the blocks before
    them are the last turn's whole prompt: the replay makes up that turn's prompt tail and answer as
    those names (Recording.continued_blocks), so each turn takes the recorded tokens from the cache.
    Made up as outputs no prompt shares, each turn after the first took 12 tokens fewer."""
    header, events = chat(tiny)
    rec = recording_from(header, events)
    cached = cached_at_admission(rec.events)
    assert [n for _, n in cached] == [0, 20, 36] and rec.replay_words() == []
    assert [len(names) for names in rec.continued_blocks.values()] == [3, 3]
    identity = replay_identity(rec)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert cached_at_admission(identity.events) == cached
    # a recording that begins after the first turn, with no snapshot: the second turn's hit on the first
    # answer continues no prompt it holds, and the output says how many tokens every run computes again
    second = next(k for k, e in enumerate(events) if isinstance(e, ev.RequestArrived) and k > 0)
    later = recording_from(header, events[second:])
    (words,) = later.replay_words()
    assert words.startswith("1 admissions took 20 tokens from cached blocks that no earlier prompt names")
    assert [n for _, n in cached_at_admission(replay_identity(later).events)] == [0, 36]


@pytest.mark.parametrize("join_at", [40, 62, 100])
def test_a_recording_joined_mid_run_shares_prefixes_as_the_engine_did(tiny, join_at):
    """Joined while requests share prefixes: the snapshot names each request's prompt blocks, how many
    of its blocks the cache gave it at admission, and the pool's free queue (cached blocks by name, in
    eviction order). The replay shares those blocks among the requests in flight as the engine did
    (two that computed one prefix side by side hold a copy each) and starts its pool's free queue
    with the same cached blocks: every step as recorded, with each admission's cached tokens."""
    rec = record_engine(tiny, steps=150, seed=11, num_prefixes=5, num_kv_blocks=36, join_at=join_at)
    snapshot = rec.events[0]
    assert sum(snapshot.num_blocks) >= snapshot.kv_blocks_used        # blocks shared, or copies held
    assert rec.start_free_blocks == snapshot.free_blocks and len(snapshot.free_blocks) == \
        snapshot.kv_blocks_total - snapshot.kv_blocks_used
    assert not any("admissions took" in words for words in rec.replay_words())
    identity = replay_identity(rec)
    assert identity.first_mismatch is None and identity.match_share == 1.0
    assert cached_at_admission(identity.events) == cached_at_admission(rec.events)


def test_a_recording_that_names_no_prompt_blocks_replays_without_hits_and_says_so(shared_prefixes):
    """A recording before prompt blocks were named (schema 6) cannot share the prefixes: the replay
    computes every prompt token, the schedule differs, and the table says why."""
    import dataclasses

    bare = [dataclasses.replace(e, prompt_blocks=()) if isinstance(e, ev.RequestArrived) else e
            for e in shared_prefixes.events]
    header = {**shared_prefixes.header, "engine": {k: v for k, v in shared_prefixes.header["engine"].items()
                                                   if k != "enable_prefix_caching"}}
    rec = recording_from(header, bare)
    assert not rec.setup.enable_prefix_caching and "enable_prefix_caching" in rec.setup.assumed
    identity = replay_identity(rec)
    assert identity.match_share < 1.0
    assert sum(n for _, n in cached_at_admission(identity.events)) == 0
    assert "tokens from the prefix cache at admission, but its arrivals name no prompt blocks" in \
        format_table(whatif(rec, {}))
