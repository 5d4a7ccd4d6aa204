"""The dispatcher in batchtop.kernels: backend names, the env override, and calls routed through it."""

import pytest
import torch
from kernel_cases import CHUNKED_SMALL, dense_reference, make_case

from batchtop import kernels

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    yield
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    kernels.select_backend("auto")


def test_auto_picks_torch_on_cpu_and_triton_on_cuda():
    assert kernels.select_backend("auto") == "auto"
    assert kernels.resolve_backend("cpu") == "torch"
    assert kernels.resolve_backend("cuda") == "triton"


def test_select_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        kernels.select_backend("cuda")
    assert kernels.backend == "auto"


def test_environment_variable_overrides_the_selection(monkeypatch):
    kernels.select_backend("torch")
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "triton")
    assert kernels.select_backend("torch") == "triton"
    assert kernels.resolve_backend("cpu") == "triton"
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=kernels.BACKEND_ENV_VAR):
        kernels.resolve_backend("cpu")


@pytest.mark.parametrize("name", ["auto", "torch", "triton"])
def test_calls_route_through_the_selected_backend(name):
    kernels.select_backend(name)
    case = make_case(*CHUNKED_SMALL, num_kv_heads=1, group=3, head_dim=32, block_size=16)
    kernels.write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    meta = kernels.build_attention_metadata(*case.step_tensors())
    assert meta.with_torch_index == (name != "triton")
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, meta, case.scale)
    torch.testing.assert_close(out, dense_reference(case).float(), atol=1e-5, rtol=1e-5)
