"""batchtop's scheduler classes for vLLM V1: vLLM decides, batchtop watches and turns the knobs.

    python -m vllm.entrypoints.openai.api_server --model M \\
        --scheduler-cls batchtop.engine.vllm.scheduler.BatchtopScheduler

`BatchtopScheduler` subclasses vLLM's `Scheduler` (synchronous scheduling: vLLM's CPU
build, or `--no-async-scheduling`); `BatchtopAsyncScheduler` subclasses `AsyncScheduler`
(pass it where vLLM schedules asynchronously, its default on GPUs: a custom class that
subclasses the plain `Scheduler` switches async scheduling off).

Both wrap `schedule()`, `update_from_output()`, `add_request()`, `finish_requests()` and
`_preempt_request()` and leave every decision to vLLM: they only observe, except that the
user's knob changes and pause apply between steps (control.py). The events go to the side
endpoint on $BATCHTOP_EVENTS_PORT (+ the data-parallel rank), which `batchtop top --url`
follows. A guest in vLLM's process: this module imports only batchtop's telemetry and vLLM;
a failure in batchtop's part is logged once and switches batchtop off, vLLM keeps serving.
"""
from __future__ import annotations

import os
import sys
import time

import vllm
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from batchtop.telemetry import events as ev
from batchtop.telemetry.bus import EventLog
from batchtop.telemetry.protocol.commands import CommandQueue

from .control import MAX_COMMANDS, before_step, vllm_knobs
from .observer import StepObserver
from .prefix_cache import PrefixCacheWatch

# The vLLM releases batchtop's tests passed on (tests/vllm: the harness on each, the server on 0.32's CPU
# build). The class reads scheduler internals that can change in any release, so another is refused
# unless $BATCHTOP_VLLM_ANY_VERSION=1 (at one's own risk: a wrong reading shows as wrong events, or
# switches batchtop's part off with the reason; vLLM's own scheduling is never changed by it).
TESTED_VLLM = ("0.32.0", "0.33.0")
ANY_VERSION_ENV = "BATCHTOP_VLLM_ANY_VERSION"
EVENT_BUFFER = 200_000          # events held for the endpoint between its drains
logger = init_logger(f"vllm.{__name__}")      # through vLLM's log handler


def version_problem(version: str = vllm.__version__) -> str | None:
    """None when `version` is one the tests passed on (or the override is set), else why not."""
    release = version.split("+")[0]
    if release in TESTED_VLLM or os.environ.get(ANY_VERSION_ENV) == "1":
        return None
    return (f"batchtop's scheduler class is tested on vLLM {', '.join(TESTED_VLLM)}; this is vLLM {version}. "
            "Install a tested vLLM, start vLLM without --scheduler-cls, or set "
            f"{ANY_VERSION_ENV}=1 to run it anyway at your own risk (it reads scheduler internals that "
            "change between versions).")


def check_vllm_version(version: str = vllm.__version__) -> None:
    problem = version_problem(version)
    if problem is not None:
        raise RuntimeError(problem)
    if version.split("+")[0] not in TESTED_VLLM:
        logger.warning("batchtop: vLLM %s is not one batchtop was tested on (%s); %s=1 runs it anyway",
                       version, ", ".join(TESTED_VLLM), ANY_VERSION_ENV)


class BatchtopMixin:
    """The observing part, shared by both classes; `self` is a vLLM scheduler."""

    def __init__(self, *args, batchtop_endpoint: bool = True, **kwargs):
        """vLLM's arguments, passed through. `batchtop_endpoint=False` (the harness): observe and take
        knob commands without the side endpoint, whatever $BATCHTOP_EVENTS_PORT says."""
        check_vllm_version()
        super().__init__(*args, **kwargs)
        self.batchtop_events = EventLog(maxlen=EVENT_BUFFER)
        self.batchtop_observer: StepObserver | None = None
        self.batchtop_commands: CommandQueue | None = None
        self.batchtop_endpoint = None
        self.batchtop_failure: str | None = None      # why batchtop's part switched off, once it did
        try:
            if batchtop_endpoint:
                self._batchtop_start()
            else:
                self.batchtop_watch()
        except Exception as error:
            logger.exception("batchtop: could not start; vLLM goes on without it")
            self.batchtop_observer = None
            self.batchtop_failure = f"could not start: {type(error).__name__}: {error}"

    def _batchtop_start(self) -> None:
        port = os.environ.get("BATCHTOP_EVENTS_PORT")
        if not port:
            logger.warning("batchtop: BATCHTOP_EVENTS_PORT is not set, so nobody could read batchtop's "
                           "events: the scheduler runs as vLLM's own")
            return
        self.batchtop_watch()
        from .endpoint import start_endpoint
        self.batchtop_endpoint = start_endpoint(self, int(port) + self._batchtop_rank())

    def batchtop_watch(self) -> None:
        """Observe and take knob commands, without the side endpoint (the harness reads the events
        from `batchtop_events` and sets knobs through control.set_knob)."""
        emit = self.batchtop_events.append
        cache = PrefixCacheWatch(self.kv_cache_manager, self.block_size, lambda: time.monotonic(),
                                 lambda key: bytes(get_block_hash(key)))
        self.batchtop_observer = StepObserver(emit, blocks_of=self._batchtop_blocks_of,
                                              kv_usage=self._batchtop_kv_usage, cache=cache)

        def refuse(command, message):
            emit(ev.CommandRefused(step=self.batchtop_observer.step, t=time.monotonic(), command=command,
                                   message=message))

        def note_paused(paused):
            kind = ev.EnginePaused if paused else ev.EngineResumed
            emit(kind(step=self.batchtop_observer.step, t=time.monotonic()))

        self.batchtop_commands = CommandQueue(MAX_COMMANDS, on_paused=note_paused, on_error=refuse)
        self.batchtop_knobs = vllm_knobs(self)         # capped at the start values, taken once

    def _batchtop_rank(self) -> int:
        """This engine core's data-parallel rank. vLLM runs the ranks of a dense model as independent
        engines: each one's `data_parallel_rank` is reset to 0, `data_parallel_index` keeps the rank."""
        config = self.vllm_config.parallel_config
        return int(getattr(config, "data_parallel_index", config.data_parallel_rank))

    def _batchtop_lock_step(self) -> bool:
        """Whether this engine steps in lock step with other data-parallel ranks: vLLM keeps a
        mixture-of-experts model's ranks in one data-parallel group (its size stays > 1); a dense model's
        ranks are independent engines (each one's group is itself)."""
        return int(self.vllm_config.parallel_config.data_parallel_size) > 1

    def _batchtop_blocks_of(self, request_id: str) -> int:
        # the blocks themselves, counted: get_block_ids() would build a list of every block's id
        return sum(len(group) for group in self.kv_cache_manager.get_blocks(request_id).blocks)

    def _batchtop_kv_usage(self) -> tuple[int, int]:
        pool = self.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1                 # block 0 is vLLM's null block, never handed out
        return total - pool.get_num_free_blocks(), total

    def _batchtop_failed(self, where: str) -> None:
        """In an `except` block: batchtop's part is off from here on (vLLM's own scheduling goes on, as
        stock), and `batchtop_failure` says why."""
        error = sys.exc_info()[1]
        logger.exception("batchtop: %s failed; batchtop's events stop here, vLLM goes on", where)
        self.batchtop_observer = None
        self.batchtop_failure = f"{where} failed: {type(error).__name__}: {error}"

    # -- vLLM's hooks ----------------------------------------------------------------------

    def add_request(self, request, *args, **kwargs) -> None:
        super().add_request(request, *args, **kwargs)
        observer = self.batchtop_observer
        if observer is not None and request.request_id in self.requests:
            try:
                observer.arrived(request)
            except Exception:
                self._batchtop_failed("add_request")

    def finish_requests(self, request_ids, finished_status, *args, **kwargs):
        finished = super().finish_requests(request_ids, finished_status, *args, **kwargs)
        observer = self.batchtop_observer
        if observer is not None and finished:
            try:
                observer.finished_outside(finished)
            except Exception:
                self._batchtop_failed("finish_requests")
        return finished

    def _preempt_request(self, request, timestamp, *args, **kwargs):
        observer = self.batchtop_observer
        if observer is not None:
            try:
                observer.preempting(request)
            except Exception:
                self._batchtop_failed("preemption")
        return super()._preempt_request(request, timestamp, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        observer = self.batchtop_observer
        if observer is None:
            return super().schedule(*args, **kwargs)
        try:
            may_run = before_step(self.batchtop_commands)
            observer.before_schedule(self.running)
        except Exception:
            self._batchtop_failed("before schedule")
            return super().schedule(*args, **kwargs)
        started = time.perf_counter()
        if may_run:
            output = super().schedule(*args, **kwargs)
        else:
            output = self._batchtop_schedule_nothing(*args, **kwargs)
        schedule_s = time.perf_counter() - started
        try:
            observer.scheduled(output, self.requests, self.max_num_scheduled_tokens,
                               self.get_request_counts(), schedule_s, self._batchtop_blocked(output, may_run))
        except Exception:
            self._batchtop_failed("schedule")
        return output

    def _batchtop_blocked(self, output, may_run: bool) -> dict | None:
        """What stopped admission at the head of the waiting queue this step (AdmissionBlocked's fields),
        None when nobody waits or the head waits for something else (a grammar, remote KV)."""
        queue = self.kv_holding_waiting if self.kv_holding_waiting else self.waiting
        if not queue:
            return None
        head = queue.peek_request()
        if head.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return None
        num_running, num_waiting = self.get_request_counts()
        fields = dict(request_id=head.request_id, num_waiting=num_waiting, num_running=num_running)
        if not may_run:
            return dict(reason="paused", **fields)
        if output.preempted_req_ids:
            return dict(reason="preemption", **fields)
        if num_running >= self.max_num_active_reqs:
            return dict(reason="max_num_seqs", limit=self.max_num_active_reqs, **fields)
        tokens_left = self.max_num_scheduled_tokens - output.total_num_scheduled_tokens
        tokens_needed = head.num_tokens - head.num_computed_tokens
        if tokens_left <= 0:
            return dict(reason="budget", tokens_left=tokens_left, tokens_needed=tokens_needed, **fields)
        chunk = min(tokens_needed, tokens_left)
        blocks_needed = -(-(head.num_computed_tokens + chunk) // self.block_size) - self._batchtop_blocks_of(
            head.request_id)
        return dict(reason="kv", blocks_needed=blocks_needed,
                    blocks_free=self.kv_cache_manager.block_pool.get_num_free_blocks(), **fields)

    def batchtop_snapshot(self, cause: str) -> None:
        """Engine thread, between steps: publish every live request's state (EngineSnapshot)."""
        observer = self.batchtop_observer
        if observer is None:
            return
        try:
            observer.snapshot(self.running, list(self.kv_holding_waiting) + list(self.waiting), cause)
        except Exception:
            self._batchtop_failed("snapshot")

    def _batchtop_schedule_nothing(self, *args, **kwargs):
        """Paused: vLLM's own schedule() with a token budget of 0 (what its PAUSED_ALL state does), so
        requests keep their state and the engine's loop goes on (it sees requests, and serves aborts)."""
        budget, self.max_num_scheduled_tokens = self.max_num_scheduled_tokens, 0
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = budget

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        started = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)
        observer = self.batchtop_observer
        if observer is not None:
            try:
                observer.updated(scheduler_output, outputs, self.get_request_counts(),
                                 time.perf_counter() - started)
            except Exception:
                self._batchtop_failed("update_from_output")
        return outputs

    def shutdown(self) -> None:
        endpoint = self.batchtop_endpoint
        if endpoint is not None:
            endpoint.stop()
        super().shutdown()


class BatchtopScheduler(BatchtopMixin, Scheduler):
    """vLLM's synchronous `Scheduler`, observed by batchtop."""


class BatchtopAsyncScheduler(BatchtopMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` (async scheduling), observed by batchtop."""
