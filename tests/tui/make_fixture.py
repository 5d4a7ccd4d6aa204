"""Regenerate tests/tui/fixtures/small.jsonl from the tiny engine (run by hand, not by pytest).

    .venv/bin/python tests/tui/make_fixture.py

The log is checked in: snapshot tests replay it, so they do not move when the engine does.
"""
from __future__ import annotations

import random
from pathlib import Path

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.core.engine import Engine
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry.bus import EventBus
from batchtop.telemetry.recorder import Recorder

OUT = Path(__file__).parent / "fixtures" / "small.jsonl"


def main() -> None:
    config = EngineConfig(model="tiny", max_num_seqs=6, max_num_batched_tokens=64,
                          long_prefill_token_threshold=32, num_kv_blocks=24, block_size=16)
    rng = random.Random(4)
    bus = EventBus()
    engine = Engine(config, sink=bus.publish)
    knobs = {**engine.knobs(), "block_size": config.block_size}
    with Recorder(OUT, model="tiny", knobs=knobs, bus=bus,
                  header_extra={"layout": config.layout, "device": "cpu"}):
        for i in range(14):
            prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(8, 90))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True))
            for _ in range(rng.randint(0, 4)):
                engine.step()
            if i == 7:
                engine.set_knob("max_num_seqs", 4, source="test")
        engine.abort("r3")
        while engine.has_unfinished():
            engine.step()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
