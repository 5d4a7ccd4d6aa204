"""The dashboard names a running first build of the C++ kernels, and says when they are off."""
from __future__ import annotations

import pytest
from tui_helpers import screen_text

from batchtop.kernels import cpu
from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources import FeedSource, LoadingSource


def test_loading_screen_names_the_first_build(monkeypatch):
    loading = LoadingSource("model smollm2")
    assert loading.status().startswith("loading model smollm2 ")
    monkeypatch.setattr(cpu, "_building",
                        "compiling the C++ CPU kernels (first start on this CPU, about a minute)")
    assert loading.status().startswith("compiling the C++ CPU kernels (first start on this CPU, about a "
                                       "minute) ")


@pytest.mark.asyncio
async def test_header_says_why_the_kernels_are_off():
    note = "C++ kernels off (OSError: no C++ compiler found): torch ops serve, slower"
    app = BatchtopApp(FeedSource(meta={"model": "tiny", "kernels": note}), tick_s=None)
    async with app.run_test(size=(160, 40)):
        app.tick()
        app.dashboard.refresh_views()
        assert note in screen_text(app).splitlines()[0]
