"""whatif, tune and diff over a fleet recording (many engines in one log): one engine chosen with
--engine reads as that engine's own log would; none chosen, or a wrong name, is one line and exit 2."""
import json

import pytest
from command_helpers import error_lines
from whatif_helpers import record_engine, write_recording

from batchtop.telemetry.fleet_log import FleetRecorder
from batchtop.tui.cli import main


@pytest.fixture(scope="module")
def logs(tiny, tmp_path_factory):
    """Two seeded tiny runs, each as a log of its own and both in one fleet recording (engines a, b)."""
    folder = tmp_path_factory.mktemp("fleet")
    runs = {"a": record_engine(tiny, steps=25, seed=1), "b": record_engine(tiny, steps=25, seed=2)}
    own = {name: {k: v for k, v in rec.header.items() if k not in ("kind", "schema_version")}
           for name, rec in runs.items()}
    recorder = FleetRecorder(folder / "fleet.jsonl", {name: {"url": f"http://{name}:1", **fields}
                                                      for name, fields in own.items()})
    for name, rec in runs.items():
        recorder.write(name, rec.events)
    recorder.close()
    singles = {name: write_recording(folder / f"{name}.jsonl", rec) for name, rec in runs.items()}
    return str(folder / "fleet.jsonl"), singles


def timeless(rows: list[dict]) -> list[dict]:
    """What-if rows without `compute_s`, the wall time the what-if itself took."""
    return [{k: v for k, v in row.items() if k != "compute_s"} for row in rows]


def out_of(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def fails(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_whatif_of_one_engine_is_the_whatif_of_its_own_log(logs, capsys):
    fleet, singles = logs
    for name in ("a", "b"):
        picked = json.loads(out_of(capsys, "whatif", fleet, "--engine", name, "--set", "max_num_seqs=2,8",
                                   "--json"))
        alone = json.loads(out_of(capsys, "whatif", singles[name], "--set", "max_num_seqs=2,8", "--json"))
        assert timeless(picked["runs"]) == timeless(alone["runs"]) and picked["fit"] == alone["fit"]


def test_tune_of_one_engine_is_the_tune_of_its_own_log(logs, capsys):
    fleet, singles = logs
    argv = ("--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..6", "--json")
    picked = json.loads(out_of(capsys, "tune", fleet, "--engine", "b", *argv))
    alone = json.loads(out_of(capsys, "tune", singles["b"], *argv))
    assert timeless([picked["best"]]) == timeless([alone["best"]])
    assert timeless(picked["runs"]) == timeless(alone["runs"])


def test_diff_of_one_engine_of_each(logs, capsys):
    fleet, singles = logs
    assert "residual 0 ns" in out_of(capsys, "diff", fleet, fleet, "--engine", "a")
    # A and B each their own engine: a's log of its own against engine a of the fleet recording
    text = out_of(capsys, "diff", singles["a"], fleet, "--engine-b", "a")
    assert "residual 0 ns" in text and f"{fleet} (engine a)" in text
    assert "different traces" in fails(capsys, "diff", fleet, fleet, "--engine-a", "a", "--engine-b", "b")


@pytest.mark.parametrize("argv", [
    ("whatif", "{fleet}", "--set", "max_num_seqs=2"),
    ("tune", "{fleet}", "--slo", "ttft_p99=10s", "--knob", "max_num_seqs=1..4"),
    ("diff", "{fleet}", "{fleet}"),
])
def test_the_engine_missing_or_wrong_is_one_line(logs, capsys, argv):
    fleet, singles = logs
    argv = [a.format(fleet=fleet) for a in argv]
    assert "records 2 engines (a, b): choose one with --engine NAME" in fails(capsys, *argv)
    assert "has no engine 'c'; its engines: a, b" in fails(capsys, *argv, "--engine", "c")
    assert "is the log of one engine" in fails(capsys, argv[0], singles["a"], *argv[2:], "--engine", "a")
