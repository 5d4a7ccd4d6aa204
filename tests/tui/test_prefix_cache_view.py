"""The prefix cache on the dashboard: the cached column with the miss reason, the timeline line, the
KV bar split into used / cached / free, the cache section (most shared prefixes, evictions) and the
hit-rate lines, over a run of the shared-system-prompt and eviction scenarios."""
from __future__ import annotations

import pytest
from tui_helpers import screen_text, screen_when

from batchtop.engine.model.loading import load_model
from batchtop.engine.workload.scenarios import SCENARIOS, run_scenario
from batchtop.telemetry import events as ev
from batchtop.tui.app import BatchtopApp
from batchtop.tui.cache import HIT_WINDOW_S
from batchtop.tui.model import HISTORY_BUCKET_S, DashboardModel
from batchtop.tui.sources import FeedSource
from batchtop.tui.widgets import split_bar


@pytest.fixture(scope="module")
def runs():
    tiny = load_model("tiny")
    return {name: run_scenario(SCENARIOS[name], steps, loaded=tiny)
            for name, steps in (("shared-system-prompt", 40), ("cache-eviction", 120))}


def test_the_model_folds_hits_misses_and_evictions(runs):
    model = DashboardModel()
    model.feed(runs["cache-eviction"])
    cache = model.cache
    admitted = [e for e in runs["cache-eviction"] if isinstance(e, ev.RequestAdmitted)]
    assert cache.num_cached_tokens == sum(e.num_cached_tokens for e in admitted) > 0
    assert cache.num_evicted_blocks == sum(len(e.block_ids) for e in runs["cache-eviction"]
                                           if isinstance(e, ev.BlocksEvicted)) > 0
    assert cache.misses.get("evicted", 0) > 0 and cache.evictions
    top = cache.top_prefixes(3)
    assert top[0].num_sharing >= top[-1].num_sharing and top[0].tokens_saved > 0
    last = max(runs["cache-eviction"], key=lambda e: e.step if isinstance(e, ev.StepFinished) else -1)
    assert (model.kv_used, model.kv_cached) == (last.kv_blocks_used, last.kv_blocks_cached)
    request = model.request(admitted[-1].request_id)
    assert request.num_cached_tokens == admitted[-1].num_cached_tokens
    assert any("prefix cache:" in text for _, _, text in request.timeline)


def test_the_split_bar_draws_used_cached_and_free():
    assert split_bar(5, 3, 10, 10).plain == "█████▒▒▒··"
    assert split_bar(0, 0, 0, 4).plain == "····"


@pytest.mark.asyncio
async def test_the_screen_shows_the_cached_column_the_cache_section_and_hit_rates(runs):
    events = runs["shared-system-prompt"]
    # Events carry wall time: where the plot's half-second buckets fall among the run's few admissions
    # depends on the machine (a slow first step puts every hit in the last bucket). A bucket past the
    # last event the dashboard has closed it: the last point holds the admissions of its window.
    clock = [max(e.t for e in events) + HISTORY_BUCKET_S]
    source = FeedSource(knobs={"max_num_seqs": 16, "block_size": 16}, meta={"model": "tiny"},
                        clock=lambda: clock[0])
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(160, 48)) as pilot:
        source.push(events)
        app.tick()
        app.dashboard.refresh_views()
        await pilot.pause()
        screen = await screen_when(pilot, app, lambda text: "prefix cache" in text and "KV pool" in text)
        assert "cached" in screen and "prefix cache" in screen and "cached" in screen.split("KV pool", 1)[1]
        last = app.model.history[-1]
        admitted = [e for e in events if isinstance(e, ev.RequestAdmitted) and e.t > last.t - HIT_WINDOW_S]
        expected = 100 * sum(e.num_cached_tokens for e in admitted) / sum(e.num_known_tokens
                                                                          for e in admitted)
        assert expected > 50 and last.hit_tok_pct == pytest.approx(expected)
        await pilot.press("2")
        app.tick()
        await pilot.pause()
        assert "hit" in screen_text(app)
