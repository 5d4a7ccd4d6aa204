import json

import pytest
from telemetry_samples import one_of_each, static_batch

from batchtop.telemetry.bus import EventBus
from batchtop.telemetry.events import SCHEMA_VERSION, EnginePaused, EventsDropped
from batchtop.telemetry.recorder import LogFormatError, LogReader, Recorder, iter_log, read_log


def record(path, events, **kw):
    with Recorder(path, model="tiny", knobs={"max_num_seqs": 8, "batching_mode": "continuous"},
                  **kw) as rec:
        for e in events:
            rec(e)
    return rec


def test_header_line(tmp_path):
    path = tmp_path / "run.jsonl"
    record(path, [])
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kind"] == "Header"
    assert first["schema_version"] == SCHEMA_VERSION
    assert first["model"] == "tiny"
    assert first["knobs"] == {"max_num_seqs": 8, "batching_mode": "continuous"}
    assert "T" in first["start_time"] and first["start_time"].endswith("+00:00")
    assert isinstance(first["start_monotonic"], float)


def test_replay_is_identical(tmp_path):
    path = tmp_path / "run.jsonl"
    events = one_of_each() + static_batch([5, 3])
    rec = record(path, events)
    assert rec.num_written == len(events)
    header, back = read_log(path)
    assert header["model"] == "tiny"
    assert back == events
    assert [type(e) for e in back] == [type(e) for e in events]
    assert list(iter_log(path)) == events


def test_recorder_on_a_bus_and_flush(tmp_path):
    path = tmp_path / "run.jsonl"
    bus = EventBus()
    rec = Recorder(path, model="m", bus=bus, flush_interval_s=60)
    bus.publish(EnginePaused(step=1, t=1.0))
    rec.flush()                       # written now, not after 60 s
    assert read_log(path)[1] == [EnginePaused(step=1, t=1.0)]
    bus.publish(EnginePaused(step=2, t=2.0))
    with pytest.raises(TypeError):
        rec(EnginePaused(step=3, t=3.0))
    rec.close()
    rec.close()                       # idempotent
    assert bus.num_subscribers == 0
    assert read_log(path)[1] == [EnginePaused(step=1, t=1.0), EnginePaused(step=2, t=2.0)]


def test_recorder_overflow_is_logged(tmp_path):
    path = tmp_path / "run.jsonl"
    rec = Recorder(path, maxlen=4, flush_interval_s=60)
    for i in range(10):
        rec(EnginePaused(step=i, t=float(i)))
    rec.close()
    assert read_log(path)[1] == ([EventsDropped(step=6, t=6.0, count=6)]
                                 + [EnginePaused(step=i, t=float(i)) for i in range(6, 10)])


def test_odd_knob_values_do_not_kill_the_writer(tmp_path):
    path = tmp_path / "run.jsonl"
    with Recorder(path, knobs={"dtype": object()}) as rec:
        rec(EnginePaused(step=0, t=0.0))
    header, events = read_log(path)
    assert header["knobs"]["dtype"].startswith("<object")
    assert events == [EnginePaused(step=0, t=0.0)]


def test_truncated_last_line_replays_up_to_the_cut(tmp_path):
    path = tmp_path / "run.jsonl"
    events = one_of_each()
    record(path, events)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    last_len = len(data) - last_start
    # every cut inside the last line, including right after its first byte and before its newline
    for cut in sorted({1, 2, 5, last_len // 3, last_len // 2, last_len - 2, last_len - 1}):
        path.write_bytes(data[:last_start + cut])
        with LogReader(path) as log:
            got = list(log)
        if cut == last_len - 1:       # only the newline is missing: the line is whole
            assert got == events and not log.truncated
        else:
            assert got == events[:-1] and log.truncated, cut
    # cut right at a line boundary: nothing lost, nothing flagged
    path.write_bytes(data[:last_start])
    with LogReader(path) as log:
        assert list(log) == events[:-1] and not log.truncated


def test_log_is_ascii_and_a_cut_inside_an_escape_is_tolerated(tmp_path):
    path = tmp_path / "run.jsonl"
    events = one_of_each()[:3]        # the third line holds "req-ü-0"
    record(path, events)
    data = path.read_bytes()
    assert data.isascii()             # non-ASCII text is escaped: a byte cut never splits a character
    cut = data.rindex(b"\\u00fc") + 3     # inside the escape of the last line
    path.write_bytes(data[:cut])
    assert read_log(path)[1] == events[:2]


def test_corrupt_middle_line_raises(tmp_path):
    path = tmp_path / "run.jsonl"
    record(path, one_of_each())
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4][: len(lines[4]) // 2]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LogFormatError, match=r"run.jsonl:5: corrupt event line"):
        read_log(path)
    lines[4] = b'{"kind": "Bogus", "step": 1, "t": 0.0}'
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LogFormatError, match="unknown event kind 'Bogus'"):
        read_log(path)


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b'{"kind": "Header", "schema_ver', "header line is not JSON"),
    (b'{"kind": "EnginePaused", "step": 0, "t": 0.0}\n', "not a Header"),
    (b'[1, 2]\n', "not a Header"),
    (b'{"kind": "Header", "schema_version": 999}\n', "schema_version 999 is not supported"),
    (b'{"kind": "Header"}\n', "schema_version None is not supported"),
])
def test_bad_header_raises(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(LogFormatError, match=message):
        read_log(path)


def test_blank_lines_are_ignored(tmp_path):
    path = tmp_path / "run.jsonl"
    record(path, [EnginePaused(step=0, t=0.0), EnginePaused(step=1, t=1.0)])
    text = path.read_text().replace("\n", "\n\n")
    path.write_text(text)
    assert read_log(path)[1] == [EnginePaused(step=0, t=0.0), EnginePaused(step=1, t=1.0)]


def test_zero_filled_tail_after_a_crash_is_tolerated(tmp_path):
    # some filesystems leave the unwritten end of a file as NUL bytes after a power loss
    path = tmp_path / "run.jsonl"
    record(path, [EnginePaused(step=0, t=0.0), EnginePaused(step=1, t=1.0)])
    data = path.read_bytes()
    path.write_bytes(data[:-10] + b"\0" * 300)
    header, events = read_log(path)
    assert events == [EnginePaused(step=0, t=0.0)]


def test_concurrent_engine_thread_and_writer_keep_order(tmp_path):
    import threading
    path = tmp_path / "run.jsonl"
    events = [EnginePaused(step=i, t=i * 1e-3) for i in range(20_000)]
    bus = EventBus()
    rec = Recorder(path, bus=bus, flush_interval_s=0.001)

    def engine():
        for e in events:
            bus.publish(e)

    thread = threading.Thread(target=engine)
    thread.start()
    for _ in range(5):
        rec.flush()                 # a third party flushing meanwhile must not reorder lines
    thread.join()
    rec.close()
    assert read_log(path)[1] == events


def test_writer_failure_is_reported_on_close_and_never_reaches_the_engine(tmp_path):
    bus = EventBus()
    rec = Recorder(tmp_path / "run.jsonl", bus=bus, flush_interval_s=0.001)

    def disk_full(text):
        raise OSError(28, "No space left on device")
    rec._file.write = disk_full
    bus.publish(EnginePaused(step=0, t=0.0))           # the engine side never sees the error
    rec._thread.join(timeout=10)                # the writer stops at its first failure
    assert not rec._thread.is_alive()
    assert bus.num_subscribers == 0             # and stops buffering for nobody
    bus.publish(EnginePaused(step=1, t=1.0))
    with pytest.raises(RuntimeError, match="No space left"):
        rec.close()


STEP_V1 = ('{"kind": "StepFinished", "step": 1, "t": 2.0, "num_rows": 2, "num_tokens": 2, '
           '"sampled_request_ids": ["a"], "num_running": 2, "num_waiting": 0, "kv_blocks_used": 1, '
           '"kv_blocks_total": 8, "schedule_s": 0.0, "prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, '
           '"update_s": 0.0}\n')


def test_a_version_1_log_reads_with_nothing_padded(tmp_path):
    """Version 2 added StepFinished.num_padded_tokens; a version 1 log is upgraded on reading."""
    path = tmp_path / "v1.jsonl"
    path.write_text('{"kind": "Header", "schema_version": 1}\n' + STEP_V1 + STEP_V1)
    _, events = read_log(path)
    assert [e.num_padded_tokens for e in events] == [0, 0] and events[0].num_rows == 2
    path.write_text(f'{{"kind": "Header", "schema_version": {SCHEMA_VERSION}}}\n' + STEP_V1 + STEP_V1)
    with pytest.raises(LogFormatError, match="lacks field 'num_padded_tokens'"):
        read_log(path)


def test_a_version_1_log_is_upgraded_on_read(tmp_path):
    path = tmp_path / "v1.jsonl"
    path.write_text("\n".join([
        '{"kind":"Header","schema_version":1,"model":"tiny","knobs":{}}',
        '{"kind":"StepPlanned","step":1,"t":0.5,"prefill_tokens":9,"decode_tokens":2,"num_prefill_rows":1,'
        '"num_decode_rows":2,"num_padding_rows":0,"token_budget":64,"num_running":3,"num_waiting":0,'
        '"kv_blocks_used":3,"kv_blocks_total":8}',
        '{"kind":"PrefillChunk","step":1,"t":0.6,"request_id":"a","num_tokens":9,"num_computed_tokens":9,'
        '"num_known_tokens":9}',
        '{"kind":"RequestAdmitted","step":1,"t":0.4,"request_id":"a","slot":0,"num_computed_tokens":0,'
        '"resumed":false}',
        '{"kind":"RequestRetired","step":2,"t":0.7,"request_id":"a","reason":"stop","slot":0,'
        '"num_prompt_tokens":9,"num_output_tokens":1}',
    ]) + "\n")
    header, (planned, chunk, admitted, retired) = read_log(path)
    assert header["schema_version"] == 1
    assert (planned.prefill_tokens, planned.recompute_tokens, planned.num_recompute_rows) == (9, 0, 0)
    assert chunk.recompute is False and admitted.wait_s == () and retired.num_blocks == 0


def test_a_version_2_log_reads_with_nothing_cached(tmp_path):
    """Version 3 added prefix caching; a version 2 log (and a version 1 one) reads with nothing cached."""
    lines = ['{"kind":"RequestAdmitted","step":1,"t":0.4,"request_id":"a","slot":0,"num_computed_tokens":0,'
             '"resumed":false,"wait_reasons":[],"wait_s":[]}',
             '{"kind":"StepPlanned","step":1,"t":0.5,"prefill_tokens":9,"recompute_tokens":0,"decode_tokens":2,'
             '"num_prefill_rows":1,"num_recompute_rows":0,"num_decode_rows":2,"num_padding_rows":0,'
             '"token_budget":64,"num_running":3,"num_waiting":0,"kv_blocks_used":3,"kv_blocks_total":8}']
    for version in (1, 2):
        path = tmp_path / f"v{version}.jsonl"
        path.write_text("\n".join([f'{{"kind":"Header","schema_version":{version}}}', *lines]) + "\n")
        _, (admitted, planned) = read_log(path)
        assert (admitted.num_cached_tokens, admitted.miss_reason, admitted.prefix_id) == (0, "", "")
        assert planned.kv_blocks_cached == 0 and planned.kv_blocks_used == 3


def test_a_version_5_snapshot_reads_with_its_priorities_and_preemptions_unknown(tmp_path):
    """Version 6 added what a replay that starts from a snapshot needs; a version 5 one reads without it."""
    path = tmp_path / "v5.jsonl"
    path.write_text('{"kind":"Header","schema_version":5}\n'
                    '{"kind":"EngineSnapshot","step":3,"t":1.0,"cause":"subscribe","request_ids":["a"],'
                    '"statuses":["running"],"slots":[0],"num_prompt_tokens":[9],"num_output_tokens":[2],'
                    '"num_computed_tokens":[10],"num_blocks":[1],"max_tokens":[8],"kv_blocks_used":1,'
                    '"kv_blocks_total":8,"kv_blocks_cached":0}\n')
    _, (snapshot,) = read_log(path)
    assert snapshot.priorities == () and snapshot.num_preemptions == () and snapshot.new_token_ratio is None
    assert snapshot.num_computed_tokens == (10,)


def test_a_version_6_arrival_reads_with_no_prompt_blocks(tmp_path):
    """Version 7 named a prompt's full blocks on its arrival; a version 6 one (and a version 3 one, its
    wait and input path upgraded in turn) reads with none."""
    arrival = ('{"kind":"RequestArrived","step":0,"t":1.0,"request_id":"a","num_prompt_tokens":40,'
               '"max_tokens":8,"priority":0')
    for version, extra in ((6, ',"since_arrival_s":0.2,"input_s":0.1}'), (3, "}")):
        path = tmp_path / f"v{version}.jsonl"
        path.write_text(f'{{"kind":"Header","schema_version":{version}}}\n{arrival}{extra}\n')
        _, (arrived,) = read_log(path)
        assert arrived.prompt_blocks == () and arrived.num_prompt_tokens == 40

