import pytest
from whatif_helpers import KNOB_PLAN, record_engine

from batchtop.engine.model.loading import load_model


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="session")
def recording(tiny):
    """One seeded tiny-model run with chunked prefill, preemptions, retractions, aborts, priorities,
    a static stretch and live knob changes."""
    return record_engine(tiny, steps=120, seed=3, policy="priority", knob_plan=KNOB_PLAN)
