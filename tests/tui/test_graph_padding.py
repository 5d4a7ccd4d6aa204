"""The CUDA graphs' padding on the dashboard: a tiny engine recorded with `cuda_graphs="eager"` (the graphs'
buffers and padding, run eagerly on the CPU), replayed: the slot grid draws the padding rows after the
batch's rows and the header the share of padded tokens. Without padding neither appears."""
from __future__ import annotations

import pytest
from tui_helpers import screen_text

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry.bus import EventBus
from batchtop.telemetry.events import RequestAdmitted, RequestArrived, StepFinished
from batchtop.telemetry.recorder import Recorder, read_log
from batchtop.tui.app import BatchtopApp
from batchtop.tui.model import DashboardModel
from batchtop.tui.sources import ReplaySource

QUIET = dict(num_running=3, num_waiting=0, kv_blocks_used=3, kv_blocks_total=10, schedule_s=0, prepare_s=0,
             forward_s=0, sample_s=0, update_s=0)


def test_graph_padding_cells_follow_the_batch_rows():
    model = DashboardModel(knobs={"max_num_seqs": 4})
    events = [RequestArrived(step=1, t=0.0, request_id=rid, num_prompt_tokens=10, max_tokens=5, priority=0)
              for rid in "abc"]
    events += [RequestAdmitted(step=1, t=0.1, request_id=rid, slot=slot, num_computed_tokens=0, resumed=False)
               for slot, rid in enumerate("abc")]
    model.feed(events
               + [StepFinished(step=1, t=0.2, num_rows=3, num_tokens=3, sampled_request_ids=("a", "b", "c"),
                               num_padded_tokens=1, **QUIET)])
    assert [model.slot_kind(i)[0] for i in range(5)] == ["admitted"] * 3 + ["graph", "free"]
    assert model.num_grid_slots() == 4 and model.rates.rates().padded_token_share == 0.25
    # a graph of 8 for 3 rows: the grid grows past max_num_seqs to show all five padding rows
    model.feed([StepFinished(step=2, t=0.3, num_rows=3, num_tokens=3, sampled_request_ids=("a", "b", "c"),
                             num_padded_tokens=5, **QUIET)])
    assert model.num_grid_slots() == 8 and [model.slot_kind(i)[0] for i in range(3, 8)] == ["graph"] * 5
    assert model.rates.rates().padded_token_share == pytest.approx(6 / 12)
    model.feed([StepFinished(step=3, t=0.4, num_rows=3, num_tokens=40, sampled_request_ids=("a", "b", "c"),
                             num_padded_tokens=0, **QUIET)])
    assert model.slot_kind(3)[0] == "free", "an eager step pads nothing"


def record(path, cuda_graphs: str) -> None:
    config = EngineConfig(model="tiny", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=64,
                          cuda_graphs=cuda_graphs)
    bus = EventBus()
    engine = Engine(config, sink=bus.publish)
    knobs = {**engine.knobs(), "block_size": config.block_size}
    with Recorder(path, model="tiny", knobs=knobs, bus=bus,
                  header_extra={"layout": config.layout, "device": "cpu"}):
        for i in range(3):        # three rows decoding: a graph of 4, one padding row a step
            engine.add_request([100 + i] * 5, SamplingParams(max_tokens=12, ignore_eos=True))
        for _ in range(6):
            engine.step()


@pytest.mark.asyncio
@pytest.mark.parametrize("cuda_graphs", ["eager", "off"])
async def test_a_recorded_run_shows_its_graph_padding(tmp_path, cuda_graphs):
    path = tmp_path / "run.jsonl"
    record(path, cuda_graphs)
    _, events = read_log(path)
    padded = [e.num_padded_tokens for e in events if isinstance(e, StepFinished)]
    assert padded == ([0] + [1] * 5 if cuda_graphs == "eager" else [0] * 6)
    app = BatchtopApp(ReplaySource.from_file(path, clock=lambda: 0.0, paused=True), tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        app.source.seek(6)
        app.tick()
        await pilot.pause()
        text = screen_text(app)
    if cuda_graphs == "eager":
        # 5 tokens padded of 3 * 5 prompt + 3 * 5 decode + 5 padded
        assert "graph +1" in text and f"graph pad {100 * 5 / 35:3.0f}%" in text and "▫graph" in text
        assert "▫" in text.replace("▫graph", "")
    else:
        assert "graph" not in text and "▫" not in text
