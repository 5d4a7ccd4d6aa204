"""`batchtop replay A --beside B`: a what-if output replayed beside its original on one clock, the plots
drawing both runs (labelled, each with its marker); pause, speed, step and seek on both; bad input."""
from __future__ import annotations

import re

import pytest
from command_helpers import error_lines
from tui_helpers import FIXTURE_LOG, footer_drawn, screen_text

from batchtop.telemetry.events import RequestArrived
from batchtop.tui.app import BatchtopApp
from batchtop.tui.cli import main
from batchtop.tui.plots import PLOTS, Beside, PlotPanel, build_plot
from batchtop.tui.sources.pair import ReplayPair

BRAILLE = {chr(c) for c in range(0x2801, 0x2900)} - {"⢕"}     # ⢕: the legend's sample of a line


@pytest.fixture(scope="module")
def whatif_out(tmp_path_factory):
    """The fixture log re-scheduled at max_num_seqs=2 (it ran at 6, then 4), written as a recording."""
    out = tmp_path_factory.mktemp("beside") / "what.jsonl"
    assert main(["whatif", str(FIXTURE_LOG), "--set", "max_num_seqs=2", "--record", str(out)]) == 0
    return out


@pytest.fixture
def opened(monkeypatch):
    """The app `batchtop replay ...` would run, built by the command itself and handed to the test."""
    apps = []
    monkeypatch.setattr(BatchtopApp, "run", lambda app: apps.append(app))

    def replay(*argv) -> BatchtopApp:
        assert main(["replay", *map(str, argv)]) == 0
        return apps.pop()
    return replay


def handed_out(pair: ReplayPair, model) -> tuple[float, float]:
    """The second run's last event shown and its next one, in seconds since its first event."""
    events, n, origin = pair.beside.events, len(model.log), pair.beside.origin_t
    return events[n - 1].t - origin, events[n].t - origin if n < len(events) else 1e9


def assert_beside_follows(app) -> None:
    """The second run shows every event up to the main run's moment, none after it."""
    pair = app.source
    elapsed = pair.elapsed_s
    shown, following = handed_out(pair, app.dashboard.beside.model)
    assert shown <= elapsed + 1e-9 < following
    assert app.model.last_t - pair.main.origin_t <= elapsed + 1e-9


def top_row(lines: list[str], glyphs: set[str]) -> int:
    return next(i for i, line in enumerate(lines) if set(line) & glyphs)


def plain(ansi: str) -> str:
    return "\n".join(line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", ansi).splitlines())


def panel_and_alternatives(app, name: str) -> tuple[str, str, str]:
    """The plot panel's text as shown, and as it would be without the second run or with the main run's
    copy in its place."""
    panel = app.screen.query_one(f"#plot-{name}", PlotPanel)
    shown = "\n".join(line.rstrip() for line in panel.content.plain.splitlines())
    width, height = panel.size
    alone, copy = (plain(build_plot(name, app.model, app.dashboard.plot_window, width, height, beside=beside))
                   for beside in (None, Beside(app.model, 0.0)))
    return shown, alone, copy


def canvas(text: str) -> list[str]:
    """The plot's rows between its frame, without the y axis labels."""
    return [line.split("┤", 1)[-1] for line in text.splitlines()[2:-4]]


async def open_plots(pilot, app) -> str:
    await pilot.press("2")
    app.tick()
    await footer_drawn(pilot, app)
    return screen_text(app)


@pytest.mark.asyncio
async def test_a_whatif_output_beside_its_original_draws_both_runs_labelled(opened, whatif_out):
    app = opened(whatif_out, "--beside", FIXTURE_LOG, "--paused")
    async with app.run_test(size=(120, 40)) as pilot:
        app.source.seek(100)
        app.tick()
        text = await open_plots(pilot, app)
        assert "beside: small.jsonl" in text.splitlines()[0]                     # the header says so
        assert ("A ⠤⠤ what.jsonl (what-if of small.jsonl): max_num_seqs=2   B •• small.jsonl: max_num_seqs=6"
                in text), text
        # the runs differ: the what-if never runs more than 2 rows, the original up to 6 ...
        assert max(p.running for p in app.model.history) == 2
        assert max(p.running for p in app.dashboard.beside.model.history) > 2
        # ... and the panels show it: each differs from the plot without the second run or with a copy
        for name in PLOTS:
            shown, alone, copy = panel_and_alternatives(app, name)
            assert shown != alone and shown != copy, name
        # the original's KV use (• lines) climbs above the what-if's (braille)
        shown, _, _ = panel_and_alternatives(app, "kv")
        assert top_row(canvas(shown), {"•"}) < top_row(canvas(shown), BRAILLE), shown
        # one clock: the first request arrives at time 0 of both runs, and each request of the what-if when
        # the original received it or at most a step later (it is taken in at the next step boundary)
        pair = app.source
        what, original = ({e.request_id: e.t - source.origin_t for e in source.events
                           if type(e) is RequestArrived} for source in (pair.main, pair.beside))
        assert what.keys() == original.keys() and len(what) > 10 and what["r0"] == original["r0"] == 0.0
        assert all(0 <= what[rid] - original[rid] < 0.25 for rid in what)
        assert "A seqs=" not in text         # a what-if keeps its knobs: no change marked on A ...
        assert "B seqs=4" in text, text      # ... the original's own change is, on B


@pytest.mark.asyncio
async def test_the_original_beside_its_whatif(whatif_out):
    """Main and second swapped: now the main run's KV lines (braille) climb above the second's."""
    pair = ReplayPair.from_files(str(FIXTURE_LOG), str(whatif_out), clock=lambda: 0.0, paused=True)
    app = BatchtopApp(pair, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        pair.seek(80)
        app.tick()
        text = await open_plots(pilot, app)
        assert "B •• what.jsonl (what-if of small.jsonl): max_num_seqs=2" in text
        shown, alone, copy = panel_and_alternatives(app, "kv")
        assert shown != alone and shown != copy
        assert top_row(canvas(shown), BRAILLE) < top_row(canvas(shown), {"•"}), shown


@pytest.mark.asyncio
async def test_pause_speed_step_and_seek_act_on_both(whatif_out):
    now = [0.0]
    pair = ReplayPair.from_files(str(FIXTURE_LOG), str(whatif_out), clock=lambda: now[0])
    app = BatchtopApp(pair, tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        now[0] += 1.0
        app.tick()
        assert pair.elapsed_s == pytest.approx(1.0) and app.model.step > 0
        assert_beside_follows(app)
        await pilot.press("space")                       # paused: the clock moves, neither run does
        shown = (app.model.step, len(app.dashboard.beside.model.log))
        now[0] += 5.0
        app.tick()
        assert (app.model.step, len(app.dashboard.beside.model.log)) == shown and "paused" in pair.status()
        await pilot.press("g", *"60", "enter")            # seek: the main run's step, the other's moment
        app.tick()
        assert app.model.finished_step == 60
        assert_beside_follows(app)
        await pilot.press("comma")                        # back: both start over and stop at step 59's time
        app.tick()
        assert app.model.finished_step == 59
        assert_beside_follows(app)
        await pilot.press("n")
        app.tick()
        assert app.model.finished_step == 60
        assert_beside_follows(app)
        await pilot.press("g", *"99", "enter")            # the main run's end: the what-if runs on ...
        app.tick()
        main_end = pair.elapsed_s
        await pilot.press("n")                            # ... so a step is the second run's next one
        app.tick()
        assert app.model.finished_step == 99 and pair.elapsed_s > main_end
        assert_beside_follows(app)
        before = pair.elapsed_s
        await pilot.press("plus", "space")                # 2x, playing
        now[0] += 0.5
        app.tick()
        assert pair.elapsed_s == pytest.approx(before + 1.0)
        assert_beside_follows(app)
        now[0] += 100.0                                   # past both ends: the longer run sets the end
        app.tick()
        assert pair.at_end and pair.elapsed_s == pytest.approx(pair.duration_s)
        assert len(app.dashboard.beside.model.log) == len(pair.beside.events)
        assert "end" in pair.status() and "step 99/99" in pair.status()
        await pilot.press("space")                        # at the end: both start over
        now[0] += 0.25
        app.tick()
        assert pair.elapsed_s == pytest.approx(0.5) and app.model.step < 20
        assert_beside_follows(app)


def fails(capsys, *argv) -> str:
    assert main(["replay", *map(str, argv)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_bad_second_files_are_one_line_and_exit_2(tmp_path, capsys):
    text = FIXTURE_LOG.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text[:-40])
    csv = tmp_path / "requests.csv"
    csv.write_text("request_id,ttft_s\nr0,0.5\n")
    header_only = tmp_path / "empty.jsonl"
    header_only.write_text(text.splitlines()[0] + "\n")
    assert "cannot read" in fails(capsys, FIXTURE_LOG, "--beside", tmp_path / "missing.jsonl")
    assert "missing.jsonl" in fails(capsys, FIXTURE_LOG, "--beside", tmp_path / "missing.jsonl")
    assert "Is a directory" in fails(capsys, FIXTURE_LOG, "--beside", tmp_path)
    assert "truncated" in fails(capsys, FIXTURE_LOG, "--beside", cut)
    assert "not a batchtop event log" in fails(capsys, FIXTURE_LOG, "--beside", csv)
    assert "no events" in fails(capsys, FIXTURE_LOG, "--beside", header_only)
    assert "truncated" in fails(capsys, cut, "--beside", FIXTURE_LOG)      # both must be whole
    assert "cannot read" in fails(capsys, tmp_path / "missing.jsonl", "--beside", FIXTURE_LOG)


def test_replay_alone_keeps_its_ways(tmp_path, capsys, opened):
    """A cut last line is still skipped when a log is replayed alone; --speed and --paused still apply."""
    cut = tmp_path / "cut.jsonl"
    cut.write_text(FIXTURE_LOG.read_text()[:-40])
    app = opened(cut, "--speed", "4", "--paused")
    assert app.source.kind == "replay" and app.source.beside is None
    assert app.source.speed == 4 and app.source.paused


def test_engines_of_fleet_recordings_beside_each_other(tmp_path, capsys, opened):
    """--engine picks the main run's engine and, of a second fleet recording, its engine too;
    --beside-engine another one; a fleet recording without an engine named is refused in one line."""
    from batchtop.telemetry.fleet_log import FleetRecorder

    def arrived(t, request_id):
        return RequestArrived(step=0, t=t, request_id=request_id, num_prompt_tokens=4, max_tokens=2,
                              priority=0)
    fleet = tmp_path / "fleet.jsonl"
    recorder = FleetRecorder(fleet, {"a": {"model": "tiny", "knobs": {"max_num_seqs": 4}},
                                     "b": {"model": "tiny", "knobs": {"max_num_seqs": 8}}})
    recorder.write("a", [arrived(10.5, "x")])
    recorder.write("b", [arrived(11.0, "y"), arrived(11.5, "z")])
    recorder.close()
    pair = opened(fleet, "--engine", "a", "--beside", fleet).source
    assert [e.request_id for e in pair.beside.events] == ["x"]
    assert pair.beside_name == "fleet.jsonl (engine a)"
    pair = opened(fleet, "--engine", "a", "--beside", fleet, "--beside-engine", "b").source
    assert [e.request_id for e in pair.beside.events] == ["y", "z"]
    assert pair.beside.knobs == {"max_num_seqs": 8}
    pair = opened(fleet, "--engine", "a", "--beside", FIXTURE_LOG).source    # a log of one engine beside
    assert pair.beside_name == "small.jsonl"
    assert "choose one with --engine NAME" in fails(capsys, FIXTURE_LOG, "--beside", fleet)
    assert "has no engine 'c'" in fails(capsys, FIXTURE_LOG, "--beside", fleet, "--beside-engine", "c")
    assert "give --beside" in fails(capsys, FIXTURE_LOG, "--beside-engine", "b")
