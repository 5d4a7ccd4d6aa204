import pytest
from whatif_helpers import record_engine

from batchtop.engine.model.loading import load_model

# (step, knob, value): chunked prefill tightened, both preemption modes, a static stretch, the budget.
KNOB_PLAN = [(20, "long_prefill_token_threshold", 8), (35, "preemption_mode", "retract"),
             (50, "max_num_batched_tokens", 24), (60, "batching_mode", "static"),
             (80, "batching_mode", "continuous"), (90, "preemption_mode", "recompute"),
             (95, "max_num_batched_tokens", 64)]


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="session")
def recording(tiny):
    """One seeded tiny-model run with chunked prefill, preemptions, retractions, aborts, priorities,
    a static stretch and live knob changes."""
    return record_engine(tiny, steps=120, seed=3, policy="priority", knob_plan=KNOB_PLAN)
