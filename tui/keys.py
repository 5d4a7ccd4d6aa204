"""The dashboard's keys: one table (`KEYS`), what each source-dependent key needs of the source, and
the hidden twins that answer why when the source cannot (`refusals`).

DashboardScreen.check_action turns a key on or off from the source's description: an action in
`ACTION_ABILITIES` runs only when the source can do it; otherwise its twin `refuse(ability)` runs and
says why. Textual tries a key's bindings in order, and the footer and help show only the keys that are
on, so the keys follow the source.
"""
from __future__ import annotations

from textual.actions import parse
from textual.binding import Binding

KEYS = [
    Binding("question_mark", "help", "help", key_display="?"),
    Binding("space", "toggle_pause", "pause"),
    Binding("n,full_stop", "step", "step", key_display="n ."),
    Binding("comma", "step_back", "step back", key_display=","),
    Binding("g", "seek", "seek to step"),
    Binding("plus,equals_sign", "speed(True)", "replay faster", show=False, key_display="+"),
    Binding("minus", "speed(False)", "replay slower", show=False, key_display="-"),
    Binding("k", "type_knob", "knob"),
    Binding("m", "knob_step('max_num_seqs', False)", "max_num_seqs ÷2", show=False),
    Binding("M", "knob_step('max_num_seqs', True)", "max_num_seqs ×2", show=False),
    Binding("t", "knob_step('max_num_batched_tokens', False)", "token budget ÷2", show=False),
    Binding("T", "knob_step('max_num_batched_tokens', True)", "token budget ×2", show=False),
    Binding("c", "knob_step('long_prefill_token_threshold', False)", "chunk threshold ÷2 (→0: off)",
            show=False),
    Binding("C", "knob_step('long_prefill_token_threshold', True)", "chunk threshold ×2", show=False),
    Binding("b", "cycle_knob('batching_mode')", "cycle batching mode", show=False),
    Binding("left_square_bracket", "knob_step('load_rate', False)", "load rate ÷1.5", show=False,
            key_display="["),
    Binding("right_square_bracket", "knob_step('load_rate', True)", "load rate ×1.5", show=False,
            key_display="]"),
    Binding("d", "cycle_knob('length_dist')", "cycle length distribution", show=False),
    Binding("z", "next_scenario", "next scenario of the reference text (docs/scenarios.md)", show=False),
    Binding("a", "abort", "abort"),
    Binding("r", "record", "rec"),
    Binding("1", "view('requests')", "requests view", show=False),
    Binding("2", "view('plots')", "plots view", show=False),
    Binding("3", "view('events')", "events view", show=False),
    Binding("4,enter", "view('timeline')", "timeline of the selected request", show=False,
            key_display="4 ⏎"),
    Binding("up", "move(-1)", "select up / scroll", show=False),
    Binding("down", "move(1)", "select down / scroll", show=False),
    Binding("pageup", "move(-10)", "page up", show=False),
    Binding("pagedown", "move(10)", "page down", show=False),
    Binding("s", "sort(False)", "sort by next column", show=False),
    Binding("S", "sort(True)", "reverse sort", show=False),
    Binding("x", "toggle_finished", "show/hide finished requests", show=False),
    Binding("f", "filter_kinds", "event log: filter kinds", show=False),
    Binding("slash", "filter_request", "event log: filter request id", show=False, key_display="/"),
    Binding("e", "toggle_step_events", "event log: show/hide step events", show=False),
    Binding("v", "freeze", "event log: freeze/unfreeze view", show=False),
    Binding("w", "plot_window", "plots: next time window", show=False),
    Binding("1", "view('engines')", "engines view", show=False),
    Binding("3", "view('intervals')", "interval log", show=False),
    Binding("e", "next_engine", "next engine"),
    Binding("escape", "back", "back to the screen below", show=False, key_display="esc"),
    Binding("q", "app.quit", "quit"),
]

# What each source-dependent action needs of the source; "knob" stands for "knob:<its first argument>".
ACTION_ABILITIES = {"toggle_pause": "pause", "step": "step", "step_back": "step_back", "seek": "seek",
                    "speed": "speed", "type_knob": "knobs", "knob_step": "knob", "cycle_knob": "knob",
                    "next_scenario": "scenarios", "abort": "abort", "record": "record"}


# Keys of the event panels only, and of the scrape panels only (a source without per-step events).
EVENT_ACTIONS = {"move", "sort", "toggle_finished", "filter_kinds", "filter_request", "toggle_step_events",
                 "freeze"}
SCRAPE_ACTIONS = {"next_engine"}


def action_ability(action: str, parameters: tuple) -> str | None:
    ability = ACTION_ABILITIES.get(action)
    return f"knob:{parameters[0]}" if ability == "knob" else ability


def refusals(keys: list[Binding]) -> list[Binding]:
    """A hidden twin per source-dependent key: it runs when the key's own action is off for this source
    (Textual tries a key's bindings in order), and says why."""
    twins = []
    for binding in keys:
        _, name, parameters = parse(binding.action)
        ability = action_ability(name, parameters)
        if ability is not None:
            twins.append(Binding(binding.key, f"refuse({ability!r})", binding.description, show=False))
    return twins
