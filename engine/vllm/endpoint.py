"""batchtop's side endpoint inside vLLM's engine process: the protocol's routes
(telemetry/protocol) over vLLM's scheduler, so `batchtop top --url`, `record` and `replay` work
as over `batchtop serve`.

Aborting a request is vLLM's API's job (a client that closes its connection);
/v1/requests/{id}/abort says so. Listens on $BATCHTOP_EVENTS_HOST (default 127.0.0.1) at the
port the scheduler gives (the base port + the data-parallel rank). Without
$BATCHTOP_EVENTS_API_KEY only loopback may be bound; with it every request needs
`Authorization: Bearer KEY`. $BATCHTOP_EVENTS_ALLOWED_HOSTS and $BATCHTOP_EVENTS_ALLOWED_ORIGINS
(comma-separated) extend the Host and Origin rules; $BATCHTOP_EVENTS_MAX_BODY_BYTES the body limit.
uvicorn runs on a daemon thread with its own asyncio loop; events cross from the engine thread
through the scheduler's EventLog, drained here as soon as they are published (at most every 10 ms).
"""
from __future__ import annotations

import os
import time

import vllm
from fastapi import FastAPI
from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from batchtop.telemetry import events as ev
from batchtop.telemetry.protocol.errors import ApiError
from batchtop.telemetry.protocol.guard import AccessRules, split_list
from batchtop.telemetry.protocol.limits import MAX_BODY_BYTES
from batchtop.telemetry.protocol.routes import ControlHost, lifespan, mount
from batchtop.telemetry.protocol.runner import ServerThread
from batchtop.telemetry.protocol.stream import EventRing
from batchtop.telemetry.weights import weight_macs

from .control import apply_knob, knob_values

EVENT_HISTORY = 100_000
logger = init_logger(f"vllm.{__name__}")      # through vLLM's log handler


def engine_setup(scheduler) -> dict:
    """What a what-if of a recording of this engine needs beyond its knobs: the harness's `Limits` of
    the engine (engine/vllm/harness.py; the pool with vLLM's null block). A recording's header carries
    it as `engine`, with the model's weight products (the step-time law "products"; none where its config
    is not a Llama's)."""
    setup = {"num_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
             "block_size": scheduler.block_size, "max_model_len": scheduler.max_model_len,
             "enable_prefix_caching": bool(scheduler.cache_config.enable_prefix_caching),
             "policy": str(scheduler.scheduler_config.policy),
             "async_scheduling": isinstance(scheduler, AsyncScheduler)}
    try:
        setup["weight_macs"] = list(weight_macs(scheduler.vllm_config.model_config.hf_text_config))
    except AttributeError:
        pass
    return setup


class SideEndpoint(ControlHost):
    where = " on vLLM"

    def __init__(self, scheduler, rules: AccessRules):
        super().__init__()
        self.scheduler = scheduler
        self.commands = scheduler.batchtop_commands
        self.knob_table = scheduler.batchtop_knobs
        self.rules = rules
        self.ring = EventRing(EVENT_HISTORY)
        scheduler.batchtop_events.notify = self.wake_pump
        self.app = FastAPI(title="batchtop inside vLLM", lifespan=lifespan(self),
                           description="batchtop's telemetry events and live knobs from vLLM's scheduler")
        mount(self.app, self, rules)
        self._thread: ServerThread | None = None

    # -- the host interface ---------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        return self.scheduler.batchtop_failure

    def pump(self) -> None:
        self.ring.extend(self.scheduler.batchtop_events.drain())

    def knob_values(self) -> dict:
        return knob_values(self.scheduler)

    def describe(self) -> dict:
        s = self.scheduler
        model = s.vllm_config.model_config.served_model_name
        return {"block_size": s.block_size,
                "num_kv_blocks": s.kv_cache_manager.block_pool.num_gpu_blocks - 1,
                "max_model_len": s.max_model_len,
                "model": model[0] if isinstance(model, (list, tuple)) else model,
                "engine": f"vllm {vllm.__version__}", "scheduler": type(s).__name__,
                "data_parallel_rank": s._batchtop_rank(), "data_parallel_lock_step": s._batchtop_lock_step(),
                "slots": "mirrored", "layout": "condense",
                "batching_mode": "continuous", "preemption_mode": "recompute",
                "engine_setup": engine_setup(s)}

    def health(self) -> tuple[int, dict]:
        status, body = super().health()
        return status, {**body, "engine": f"vllm {vllm.__version__}",
                        "data_parallel_rank": self.scheduler._batchtop_rank()}

    def apply_knob(self, name: str, value, source: str) -> None:
        s = self.scheduler
        old = knob_values(s)[name]
        apply_knob(s, name, value)
        s.batchtop_events.append(ev.KnobChanged(step=s.batchtop_observer.step, t=time.monotonic(), name=name,
                                                old=old, new=value, source=source))

    def refuse(self, command: str, message: str) -> None:
        s = self.scheduler
        s.batchtop_events.append(ev.CommandRefused(step=s.batchtop_observer.step, t=time.monotonic(),
                                                   command=command, message=message))

    def emit_snapshot(self, cause: str) -> None:
        self.scheduler.batchtop_snapshot(cause)

    def abort(self, request_id: str) -> dict:
        raise ApiError(501, "batchtop cannot abort a request inside vLLM: vLLM's API server owns it (a "
                            "client that closes its connection aborts it)", code="not_supported")

    # -- life ---------------------------------------------------------------------------------

    def start(self, port: int, timeout: float = 30.0) -> SideEndpoint:
        self._thread = ServerThread(self.app, self.rules.bound_host, port, api_key=self.rules.api_key,
                                    on_exit=self._closing, name="batchtop-endpoint")
        self._thread.start(timeout)
        return self

    def _closing(self, sig) -> None:
        self.closing = True

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop(5)


def rules_from_env(environ=os.environ) -> AccessRules:
    return AccessRules(api_key=environ.get("BATCHTOP_EVENTS_API_KEY") or None,
                       bound_host=environ.get("BATCHTOP_EVENTS_HOST", "127.0.0.1"),
                       allowed_hosts=split_list(environ.get("BATCHTOP_EVENTS_ALLOWED_HOSTS")),
                       allowed_origins=split_list(environ.get("BATCHTOP_EVENTS_ALLOWED_ORIGINS")),
                       max_body_bytes=int(environ.get("BATCHTOP_EVENTS_MAX_BODY_BYTES", MAX_BODY_BYTES)))


def start_endpoint(scheduler, port: int) -> SideEndpoint:
    rules = rules_from_env()
    endpoint = SideEndpoint(scheduler, rules).start(port)
    logger.info("batchtop: events and knobs of data-parallel rank %d on http://%s:%d (batchtop top --url)",
                scheduler._batchtop_rank(), rules.bound_host, port)
    return endpoint
