"""The knob table (engine/core/knobs.py) drives its readers: the engine, EngineConfig, the HTTP API,
the dashboard's keys and docs/server.md all refuse, offer and state what the table says."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import httpx
import pytest

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.knobs import DASHBOARD_KNOBS, KNOBS, LABELS, LOAD_KNOB_ROWS, markdown_table
from batchtop.engine.core.scheduler import SchedulerKnobs
from batchtop.engine.workload.arrivals import LOAD_KNOBS
from batchtop.tui.dashboard import DashboardScreen

CAPACITY = EngineConfig().batch_capacity     # the served engine's (tests/server/conftest.py)
DOCS = Path(__file__).parents[2] / "docs" / "server.md"


def out_of_range(knob) -> list:
    if knob.choices:
        return ["turbo", 7]
    return [knob.low - 1, knob.upper(CAPACITY) + 1, "lots"]


def edges(knob) -> list:
    return list(knob.choices) if knob.choices else [knob.low, knob.upper(CAPACITY)]


REFUSED = [(name, value) for name, knob in KNOBS.items() for value in out_of_range(knob)]
ALLOWED = [(name, value) for name, knob in KNOBS.items() for value in edges(knob)]


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("name, value", REFUSED)
def test_engine_config_and_api_refuse_with_the_tables_message(served, http, name, value):
    engine = served[0].engine
    assert engine.batch.capacity == CAPACITY
    with pytest.raises(ValueError) as refused:
        engine.validate_knob(name, value)
    message = str(refused.value)
    assert message == f"{name} must be {KNOBS[name].describe(CAPACITY)}, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model="tiny", batch_capacity=CAPACITY, **{name: value})
    response = http.post("/v1/knobs", json={"name": name, "value": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"], error["code"]) == (message, "value", "invalid_knob")


@pytest.mark.parametrize("name, value", ALLOWED)
def test_the_range_edges_are_allowed_everywhere(served, name, value):
    assert served[0].engine.validate_knob(name, value) == value
    assert getattr(EngineConfig(model="tiny", **{name: value}), name) == value


def test_the_capacity_rule_lives_in_the_config():
    """max(256, max_num_seqs) rows: the config accepts what the command line accepts."""
    import argparse

    from batchtop.engine.flags import add_engine_flags, engine_config
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert EngineConfig(model="tiny", max_num_seqs=300).batch_capacity == 300
    assert engine_config(parser.parse_args(["--max-num-seqs", "300"])) == EngineConfig(max_num_seqs=300)
    assert EngineConfig(model="tiny", max_num_seqs=8).batch_capacity == 256
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer in \[1, 1024\], got 2000"):
        EngineConfig(model="tiny", max_num_seqs=2000)


def test_api_lists_every_knob_with_its_range(http):
    state = http.get("/v1/knobs").json()
    assert list(state["knobs"]) == list(KNOBS)
    assert state["ranges"] == {name: knob.describe(CAPACITY) for name, knob in KNOBS.items()}
    assert state["knob_table"] == [knob.row(CAPACITY) for knob in KNOBS.values()]
    assert state["knob_limits"]["max_num_seqs"] == [1, CAPACITY]


def test_dashboard_keys_set_the_tables_dashboard_knobs():
    assert DASHBOARD_KNOBS == (
        "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "batching_mode")
    actions = " ".join(binding.action for binding in DashboardScreen.BINDINGS)
    keyed = set(re.findall(r"(?:knob_step|cycle_knob)\('(\w+)'", actions))
    assert keyed & set(DASHBOARD_KNOBS) and keyed <= set(DASHBOARD_KNOBS) | set(LOAD_KNOB_ROWS)
    assert set(LOAD_KNOB_ROWS) == set(LOAD_KNOBS)
    assert LABELS["max_num_seqs"] == "seqs" and LABELS["long_prefill_token_threshold"] == "chunk"


def test_docs_state_the_tables_ranges():
    assert markdown_table() in DOCS.read_text()


def test_the_schedulers_knobs_are_the_tables():
    """SchedulerKnobs holds exactly the table's knobs, built from the config by name."""
    assert [f.name for f in dataclasses.fields(SchedulerKnobs)] == list(KNOBS)
    config = EngineConfig(model="tiny", max_num_seqs=3, batching_mode="static", dynamic_timeout_s=2.0)
    assert dataclasses.asdict(SchedulerKnobs.of(config)) == {name: getattr(config, name) for name in KNOBS}
