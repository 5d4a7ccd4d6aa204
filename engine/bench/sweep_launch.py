"""`batchtop sweep --launch 'COMMAND with {max_num_seqs}'`: the max_num_seqs sweep on a real server.

For each value: start the command (in a process group of its own, `vllm.launch.LaunchedServer`),
wait for `/health`, run the same trace through the OpenAI API, read the server's `/metrics`
before and after for its preemptions and steps, stop the whole group, go on. A server that
does not come up is a failed point carrying the tail of its log; the sweep goes on.
"""
from __future__ import annotations

import time
from urllib.parse import urlsplit

import httpx

from batchtop.engine.vllm.launch import LaunchedServer
from batchtop.telemetry.exposition import parse_exposition

from .serving import bench_server, served_model, summarize

LOG_TAIL_LINES = 20


def server_counters(base_url: str, api_key: str | None = None) -> dict[str, float | None]:
    """Preemptions and scheduler steps so far, summed over the server's engines (None: not exported)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
        response.raise_for_status()
        engines = parse_exposition(response.text, time.monotonic()).engines.values()
    except (httpx.HTTPError, ValueError):
        return {"preemptions": None, "steps": None}
    preemptions = [e.counters["preemptions"] for e in engines if "preemptions" in e.counters]
    steps = [e.histograms["step_tokens"].count for e in engines if "step_tokens" in e.histograms]
    return {"preemptions": sum(preemptions) if preemptions else None, "steps": sum(steps) if steps else None}


def launch_command(template: str, max_num_seqs: int, base_url: str) -> str:
    """The template with {max_num_seqs} (and {port}, from --base-url) filled in."""
    if "{max_num_seqs}" not in template:
        raise ValueError("the --launch command must contain {max_num_seqs}")
    port = urlsplit(base_url).port or 80
    return template.format(max_num_seqs=max_num_seqs, port=port)


def sweep_launched(template: str, values: list[int], requests, *, base_url: str, model: str | None = None,
                   api_key: str | None = None, startup_timeout_s: float = 600.0, ignore_eos: bool = True,
                   log=print, **run_kwargs) -> list[dict]:
    points = []
    for value in values:
        command = launch_command(template, value, base_url)
        log(f"max_num_seqs={value}: starting {command}")
        server = LaunchedServer(command, base_url)
        point: dict = {"max_num_seqs": value, "command": command, "server_pgid": server.pgid}
        try:
            point["startup_s"] = round(server.wait_healthy(startup_timeout_s), 1)
            before = server_counters(base_url, api_key)
            results, duration = bench_server(base_url, model or served_model(base_url, api_key), requests,
                                             api_key=api_key, ignore_eos=ignore_eos, **run_kwargs)
            after = server_counters(base_url, api_key)
            point.update(summarize(results, duration))
            point.update({name: None if before[name] is None or after[name] is None
                          else after[name] - before[name]
                          for name in ("preemptions", "steps")})
        except (RuntimeError, httpx.HTTPError, OSError) as error:
            point["error"] = str(error).splitlines()[0]
            point["log_tail"] = server.tail(LOG_TAIL_LINES)
            log(f"max_num_seqs={value}: failed: {point['error']}")
        finally:
            server.stop()
            point["left_running"] = server.group_alive()
        points.append(point)
    return points
