"""The dashboard's footer, help and keys come from the source's description: each kind of source shows
the keys of what it can do, a source without knobs shows no knob keys, and a key for something the
source cannot do answers why in one line."""
from __future__ import annotations

import dataclasses

import pytest
from tui_helpers import footer_drawn, screen_text

from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS, describe_knobs
from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources import FeedSource, ReplaySource
from batchtop.tui.sources.engine import EngineSource
from batchtop.tui.sources.remote import RemoteSource

pytestmark = pytest.mark.asyncio
VLLM_START = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 512}


def engine_description():
    """EngineSource's own description, without loading a model (it reads only the knob values)."""
    source = object.__new__(EngineSource)
    source.knobs = {"max_num_seqs": 8, "load_rate": 2.0, "length_dist": "exponential"}
    return source.describe()


def vllm_description():
    """RemoteSource's description after the hello of batchtop's scheduler inside a vLLM."""
    source = object.__new__(RemoteSource)
    source.url, source.meta = "http://127.0.0.1:9", {}
    knobs = {name: dataclasses.replace(row, high=VLLM_START[name]) for name, row in SCHEDULER_KNOBS.items()}
    source._apply_state({"knobs": dict(VLLM_START), **describe_knobs(knobs)})
    return source.describe()


DESCRIPTIONS = {"replay": lambda: ReplaySource.DESCRIPTION, "engine": engine_description,
                "vllm": vllm_description}
# kind: (keys in the footer, keys that must not be there)
FOOTERS = {
    "replay": (["space pause", "n . step", ", step back", "g seek"], ["k knob", "a abort", "r rec"]),
    "engine": (["space pause", "n . step", "k knob", "a abort", "r rec"], [", step back", "g seek"]),
    "vllm": (["space pause", "n . step", "k knob", "a abort"], ["r rec", ", step back"]),
}
# kind: (help lines of keys it serves, help text it must not have, what it cannot do)
HELP = {
    "replay": (["step back", "seek to step", "replay faster"], ["knob", "abort"],
               ["set knobs", "abort a request", "record events"]),
    "engine": (["max_num_seqs ×2", "cycle batching mode", "load rate ×1.5", "next scenario"],
               ["replay faster"], ["step back", "seek to a step"]),
    "vllm": (["max_num_seqs ×2", "chunk threshold ÷2"], ["cycle batching mode", "load rate", "next scenario"],
             ["record events", "start scenarios"]),
}


def footer(app) -> str:
    return screen_text(app).splitlines()[-1]


@pytest.mark.parametrize("kind", list(DESCRIPTIONS))
async def test_footer_and_help_list_what_the_source_can_do(kind):
    app = BatchtopApp(FeedSource(knobs={"max_num_seqs": 8}, description=DESCRIPTIONS[kind]()), tick_s=None)
    async with app.run_test(size=(160, 64)) as pilot:      # tall enough for the whole help
        await footer_drawn(pilot, app)
        shown, hidden = FOOTERS[kind]
        line = footer(app)
        assert all(key in line for key in shown) and not any(key in line for key in hidden), line
        await pilot.press("question_mark")
        await pilot.pause()
        keys, absent, cannot = HELP[kind]
        text = screen_text(app)
        served, _, refused = text.partition("not over this source")
        assert all(key in served for key in keys) and not any(key in served for key in absent), text
        assert all(what in refused for what in cannot), text


async def test_a_source_without_knobs_shows_no_knob_keys():
    app = BatchtopApp(FeedSource(), tick_s=None)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        assert "knob" not in footer(app)
        await pilot.press("question_mark")
        await pilot.pause()
        served, _, refused = screen_text(app).partition("not over this source")
        assert "knob" not in served and "threshold" not in served and "set knobs" in refused


@pytest.mark.parametrize("kind, key, why", [
    ("replay", "a", "replay: knobs are read-only"),
    ("replay", "r", "a replay is a recording already"),
    ("replay", "M", "replay: knobs are read-only"),
    ("engine", "comma", "only a replay steps back"),
    ("vllm", "b", "batching_mode is not a knob of this remote source; knobs: max_num_seqs"),
    ("vllm", "r", "the dashboard over a server does not record"),
])
async def test_a_key_the_source_cannot_serve_says_why_in_one_line(kind, key, why):
    source = FeedSource(knobs={"max_num_seqs": 8, "batching_mode": "continuous"},
                        description=DESCRIPTIONS[kind]())
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press(key)
        await pilot.pause()
        status = str(app.query_one("#status").render())
        assert why in status and "\n" not in status.strip()
        assert app.screen is app.dashboard         # no prompt opened for what cannot happen
