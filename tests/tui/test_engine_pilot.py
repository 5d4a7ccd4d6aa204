"""Keys pressed on the dashboard change the real engine (tiny model, EngineLoop thread).

No sleeps: `loop.call(fn)` runs `fn` on the engine thread between steps and waits for
it, so it is a barrier behind every command queued before it.
"""
from __future__ import annotations

import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry.bus import EventBus
from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources.engine import EngineSource

pytestmark = pytest.mark.asyncio


@pytest.fixture
def source():
    bus = EventBus()
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64),
                    sink=bus.publish)
    src = EngineSource(EngineLoop(engine), bus)
    yield src
    src.close()


def barrier(source: EngineSource):
    """Wait until the engine thread has applied every command queued so far; its step count then."""
    return source.loop.call(lambda: source.engine.step_count)


def add_requests(source: EngineSource, n: int, max_tokens: int = 200) -> list[str]:
    return [source.loop.add_request(list(range(100, 120 + i)), SamplingParams(max_tokens=max_tokens,
                                                                              ignore_eos=True))
            for i in range(n)]


def status(app) -> str:
    return str(app.query_one("#status").render())


async def test_knob_set_by_typing_and_by_key_and_refused_when_invalid(source):
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("k", *"max_num_seqs=3", "enter")
        barrier(source)
        assert source.engine.knobs()["max_num_seqs"] == 3
        await pilot.press("M")                       # double it
        barrier(source)
        assert source.engine.knobs()["max_num_seqs"] == 6
        await pilot.press("k", *"max_num_seqs=100000", "enter")
        barrier(source)
        assert source.engine.knobs()["max_num_seqs"] == 6
        assert "refused" in status(app) and "max_num_seqs" in status(app)
        await pilot.press("k", *"batching_mode=sideways", "enter")
        barrier(source)
        assert source.engine.knobs()["batching_mode"] == "continuous"
        app.tick()
        kinds = [type(e).__name__ for e in app.model.log]
        assert kinds.count("KnobChanged") == 2 and kinds.count("CommandRefused") == 2
        assert app.model.knobs["max_num_seqs"] == 6


async def test_pause_then_single_step_advances_exactly_one_step(source):
    add_requests(source, 3)
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("space")
        paused_at = barrier(source)
        assert barrier(source) == paused_at            # paused: nothing moves
        await pilot.press("n")
        barrier(source)                                # applied with the grant, before the step
        assert barrier(source) == paused_at + 1
        assert barrier(source) == paused_at + 1        # and no further
        app.tick()
        assert app.model.paused and app.model.finished_step == paused_at + 1
        await pilot.press("space")
        barrier(source)
        app.tick()
        assert not app.model.paused


async def test_abort_selected_request_after_confirmation(source):
    ids = add_requests(source, 3)
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        source.toggle_pause()
        barrier(source)
        app.tick()
        await pilot.pause()
        app.dashboard.table.selected = ids[1]
        await pilot.press("a", "n")                    # declined: nothing happens
        barrier(source)
        assert not source.engine.requests[ids[1]].finished
        await pilot.press("a", "y")
        barrier(source)
        assert ids[1] not in source.engine.requests or source.engine.requests[ids[1]].finish_reason == "abort"
        app.tick()
        assert app.model.request(ids[1]).state == "abort"
        assert app.model.request(ids[0]).state in ("waiting", "running")


async def test_record_from_the_dashboard_then_replay_it(source, tmp_path):
    from batchtop.telemetry.recorder import read_log
    from batchtop.tui.sources import ReplaySource
    path = tmp_path / "run.jsonl"
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("r", *(["backspace"] * 40), *str(path), "enter")
        assert source.recording == str(path)
        add_requests(source, 2, max_tokens=4)
        barrier(source)
        while any(not source.engine.requests[r].finished for r in list(source.engine.requests)):
            barrier(source)
        await pilot.press("r")
        assert source.recording is None and "saved" in status(app)
    header, events = read_log(path)
    assert header["model"] == "tiny" and header["knobs"]["max_num_seqs"] == 8
    assert sum(type(e).__name__ == "RequestRetired" for e in events) == 2
    replay = BatchtopApp(ReplaySource(header, events, clock=lambda: 0.0, paused=True), tick_s=None)
    async with replay.run_test(size=(80, 24)):
        replay.source.seek(10**9)
        replay.tick()
        assert len(replay.model.retired) == 2 and not replay.model.live



async def test_a_recording_begun_on_a_busy_engine_replays_from_its_snapshot(source, tmp_path):
    """Recording starts while requests run and wait, their prompts sharing two blocks: the log begins
    with the engine's snapshot, and a what-if of it starts from them (the 8 running ones computed the
    prefix side by side, a copy each; the 4 waiting ones hit it later), every step as recorded."""
    from batchtop.engine.whatif.recording import read_recording
    from batchtop.engine.whatif.replay import replay_identity
    path = tmp_path / "joined.jsonl"
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        source.toggle_pause()
        block_size = source.engine.config.block_size
        shared = list(range(100, 100 + 2 * block_size))
        busy = [source.loop.add_request(shared + [1000 * i + j for j in range(4 + i)],
                                        SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(12)]
        for _ in range(5):
            source.step_once()
        barrier(source)
        await pilot.press("r", *(["backspace"] * 40), *str(path), "enter")
        assert source.recording == str(path)
        source.toggle_pause()
        add_requests(source, 3, max_tokens=6)
        while any(not source.engine.requests[r].finished for r in list(source.engine.requests)):
            barrier(source)
        await pilot.press("r")
    rec = read_recording(str(path))
    assert type(rec.events[0]).__name__ == "EngineSnapshot" and rec.setup.assumed == ()
    assert {item.request.request_id for item in rec.in_flight} == set(busy) and rec.unseen == ()
    assert {item.status for item in rec.in_flight} == {"running", "waiting"}
    hits = {e.request_id: e.num_cached_tokens for e in rec.events if type(e).__name__ == "RequestAdmitted"}
    assert sum(hits[r] == 2 * block_size for r in busy[8:]) == 4
    identity = replay_identity(rec)
    assert identity.num_steps > 20 and identity.match_share == 1.0
    assert {e.request_id: e.num_cached_tokens for e in identity.events
            if type(e).__name__ == "RequestAdmitted"} == hits


async def test_z_cycles_the_scenarios_on_the_live_engine(source):
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        source.start()
        # Paused: a scenario's own knob phases count steps (static-vs-continuous turns continuous at
        # its step 100, about a second of tiny steps), so a read behind a loaded machine's delay
        # would see the phase, not the scenario's start. Commands still apply while paused.
        await pilot.press("space")
        await pilot.press("z")                               # the first: static-vs-continuous
        assert "static-vs-continuous" in status(app)
        knobs = source.loop.call(source.engine.knobs)
        assert (knobs["batching_mode"], knobs["max_num_seqs"]) == ("static", 8)
        app.tick()                                           # the model learns the scenario from its event
        # kv-exhaustion: its 40-block pool needs a restart
        await pilot.press("z")
        assert "needs `batchtop --scenario kv-exhaustion` for num_kv_blocks=40" in status(app)
        barrier(source)
        app.tick()
        await pilot.press("z")                               # long-prefill: eight scripted requests at once
        barrier(source)
        app.tick()
        scripted = [r for r in app.model.requests() if (r.num_prompt_tokens, r.max_tokens) == (16, 400)]
        assert len(scripted) >= 8                           # its eight decode rows arrived
        assert source.loop.call(lambda: source.engine.knobs()["max_num_batched_tokens"]) == 2048
        app.tick()
        assert app.model.knobs["scenario"] == "long-prefill"
