"""`tune`: the knob values that give the most output throughput within an SLO, chosen from what-if runs of
a recording; applied live through a server's knob API, then checked against the server's own events."""
from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from batchtop.engine.core.knobs import knob

from .grid import Run, predict
from .recording import Recording
from .replay import fit_steps, replay_identity
from .steptime import StepTimeModel

SLO_METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99")
MAX_RANGE_POINTS = 64
_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*")


def parse_slo(items: list[str]) -> dict[str, float]:
    """`ttft_p99=2s` (or 500ms) flags as {metric: seconds}."""
    slo = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if name not in SLO_METRICS:
            raise ValueError(f"--slo takes one of {', '.join(SLO_METRICS)}, got {name!r}")
        match = _DURATION.fullmatch(value) if sep else None
        if match is None:
            raise ValueError(f"--slo {name} needs a duration such as 2s or 500ms, got {value!r}")
        slo[name] = float(match[1]) / (1000 if match[2] == "ms" else 1)
    return slo


def parse_knob_range(items: list[str], capacity: int) -> dict[str, list]:
    """`max_num_seqs=1..64` (every integer, or a geometric grid past MAX_RANGE_POINTS) or `=V1,V2`."""
    grid = {}
    for item in items:
        name, sep, values = item.partition("=")
        spec = knob(name.strip())
        if not sep or not values:
            raise ValueError(f"--knob takes KNOB=LOW..HIGH or KNOB=V1,V2, got {item!r}")
        if ".." in values:
            if spec.type is not int:
                raise ValueError(f"a range LOW..HIGH needs an integer knob; give {spec.name}=V1,V2")
            low, high = (spec.parse(v.strip(), capacity) for v in values.split("..", 1))
            if low > high:
                raise ValueError(f"--knob {spec.name}: {low}..{high} is empty")
            grid[spec.name] = _range(low, high)
        else:
            grid[spec.name] = [spec.parse(v.strip(), capacity) for v in values.split(",")]
    if not grid:
        raise ValueError("give at least one --knob to tune")
    return grid


def _range(low: int, high: int) -> list[int]:
    if high - low + 1 <= MAX_RANGE_POINTS:
        return list(range(low, high + 1))
    ratio = (high / max(low, 1)) ** (1 / (MAX_RANGE_POINTS - 1))
    return sorted({low, high, *(round(max(low, 1) * ratio ** i) for i in range(MAX_RANGE_POINTS))})


def meets(run: Run, slo: dict[str, float]) -> bool:
    row = run.row()
    values = {metric: row[f"{metric}_s"] for metric in slo}
    return all(values[metric] is not None and values[metric] <= bound for metric, bound in slo.items())


@dataclass
class Tuning:
    runs: list[Run]              # every value at every step-time scale
    best: Run | None             # the most output tok/s within the SLO (None: no value meets it)
    heldout_mape: float


def tune(rec: Recording, grid: dict[str, list], slo: dict[str, float],
         step_scales: tuple[float, ...] = (1.0,), harness=None) -> Tuning:
    """The values with the most output tok/s (on the fitted step times) among those that meet the SLO
    at every one of `step_scales` (forward times at those multiples: a margin for a slower machine),
    each run through the recording's own engine's scheduler: batchtop's here, vLLM's in the harness of
    the vLLM that recorded it (`harness`, or one started for the grid)."""
    if rec.setup.vllm is None:
        model = fit_steps(rec, replay_identity(rec))
        return _chosen(grid, slo, step_scales, model,
                       lambda changed, scale: predict(rec, model, changed, step_scale=scale))
    from .vllm_replay import (
        HarnessProcess,
        check_grid,
        fit_through_harness,
        identity_through_harness,
        predict_through_harness,
    )
    check_grid(grid)
    if harness is None:
        with HarnessProcess(rec.setup.vllm["version"]) as own:
            return tune(rec, grid, slo, step_scales, own)
    model = fit_through_harness(rec, identity_through_harness(rec, harness)[1])
    return _chosen(grid, slo, step_scales, model, lambda changed, scale: predict_through_harness(
        rec, model, harness, changed, step_scale=scale))


def _chosen(grid: dict[str, list], slo: dict[str, float], step_scales: tuple[float, ...],
            model: StepTimeModel, run: Callable[[dict, float], Run]) -> Tuning:
    """Every point of the grid run (`run(changed, scale)`) at 1x and each scale, and the best of those
    that meet the SLO at every scale asked for."""
    names = list(grid)
    scales = sorted({1.0, *step_scales})
    runs, feasible = [], []
    for combo in itertools.product(*grid.values()):
        scaled = [run(dict(zip(names, combo)), scale) for scale in scales]
        runs += scaled
        if all(meets(r, slo) for r in scaled if r.step_scale in step_scales):
            feasible.append(scaled[scales.index(1.0)])
    best = max(feasible, key=lambda r: r.summary.throughput_out_tok_s or 0.0, default=None)
    return Tuning(runs, best, model.forward.heldout_mape)


# -- applied live -----------------------------------------------------------------------------------

def apply_knobs(url: str, knobs: dict, api_key: str | None = None) -> None:
    """POST each knob to the server's /v1/knobs; ValueError naming the server's refusal."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for name, value in knobs.items():
        try:
            response = httpx.post(url.rstrip("/") + "/v1/knobs", json={"name": name, "value": value},
                                  headers=headers, timeout=10)
        except httpx.HTTPError as error:
            raise ValueError(f"cannot reach {url}: {error}") from None
        if response.status_code != 200:
            raise ValueError(f"{url} refused {name}={value}: {_message(response)}")


def _message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


def live_events(url: str, seconds: float, api_key: str | None = None) -> list:
    """The server's events over the next `seconds`, read from its event stream."""
    import httpx
    from httpx_sse import connect_sse

    from batchtop.telemetry.events import SCHEMA_VERSION
    from batchtop.telemetry.protocol.stream import stream_schema
    from batchtop.telemetry.recorder import decode_event
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    events: list = []
    stop = threading.Event()
    failure: list[str] = []

    def read() -> None:
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(10, read=None)) as client:
                with connect_sse(client, "GET", "/v1/events") as source:
                    schema = SCHEMA_VERSION       # until the hello says
                    for message in source.iter_sse():
                        if stop.is_set():
                            return
                        if message.event == "hello":
                            schema = stream_schema(message.json(), url)
                        elif message.data and message.event == "message":
                            events.append(decode_event(message.data, schema))
        except (httpx.HTTPError, ValueError) as error:
            failure.append(str(error))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(seconds)
    stop.set()
    if failure:
        raise ValueError(f"cannot read {url}/v1/events: {failure[0]}")
    return list(events)
