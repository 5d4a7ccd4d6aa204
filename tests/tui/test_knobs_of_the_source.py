"""The dashboard's knob prompt and keys offer the source's own knobs within the source's limits: over a
vLLM that started with max_num_seqs 8 it offers vLLM's three knobs and never suggests more than 8."""
from __future__ import annotations

import dataclasses

import pytest

from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS
from batchtop.tui.app import BatchtopApp
from batchtop.tui.screens import PromptScreen
from batchtop.tui.sources import FeedSource, SourceDescription

pytestmark = pytest.mark.asyncio
VLLM_TABLE = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 512}


class VllmLikeSource(FeedSource):
    """What RemoteSource makes of a vLLM endpoint's knob table."""
    kind = "remote"

    def __init__(self):
        super().__init__(knobs={"max_num_seqs": 8, "max_num_batched_tokens": 512,
                                "long_prefill_token_threshold": 0})
        self.sent: list[tuple[str, object]] = []

    def describe(self):
        knobs = {name: dataclasses.replace(row, high=VLLM_TABLE[name])
                 for name, row in SCHEDULER_KNOBS.items()}
        return SourceDescription(self.kind, can=frozenset({"pause", "step", "abort"}), knobs=knobs)

    def set_knob(self, name, value):
        self.sent.append((name, value))
        return None


async def test_prompt_and_keys_offer_only_the_sources_knobs_within_its_limits():
    source = VllmLikeSource()
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("k")
        await pilot.pause()
        prompt = app.screen
        assert isinstance(prompt, PromptScreen)
        assert "max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold;" in prompt.question
        assert "batching_mode" not in prompt.question and "load_rate" not in prompt.question
        name, _, value = prompt.placeholder.partition("=")
        assert name == "max_num_seqs" and int(value) <= 8
        await pilot.press("escape")
        assert app.dashboard.set_knob("batching_mode", "static") is not None   # not vLLM's: refused here
        assert app.dashboard.set_knob("load_rate", 2.0) is not None
        assert source.sent == []
        await pilot.press("M")                                             # at vLLM's limit: nothing sent
        assert source.sent == []
        await pilot.press("m")
        assert source.sent == [("max_num_seqs", 4)]
        await pilot.press("M")
        assert source.sent[-1] == ("max_num_seqs", 8)
        assert app.dashboard.set_knob("seqs", 6) is None                   # the label names the knob
        assert source.sent[-1] == ("max_num_seqs", 6)


async def test_a_source_without_knobs_offers_none():
    app = BatchtopApp(FeedSource(), tick_s=None)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("k")
        await pilot.pause()
        assert not isinstance(app.screen, PromptScreen)
