"""Live knobs and pause for vLLM's scheduler: validated by the endpoint, applied between steps.

Knobs (batchtop's names, and the scheduler attribute each one sets):
- `max_num_seqs` -> `Scheduler.max_num_active_reqs`, the admission cap. Never
  `max_num_running_reqs`: that is the worker's row count, and `schedule()` asserts that
  the running set fits it, so lowering it below the running count would kill the engine.
  Lowering the cap preempts nothing: it binds as rows finish.
- `max_num_batched_tokens` -> `Scheduler.max_num_scheduled_tokens`, the token budget.
- `long_prefill_token_threshold` -> `scheduler_config.long_prefill_token_threshold`
  (0: no cap), read by `schedule()` each step.
vLLM sized its buffers from the values it started with: each knob is the protocol's row with
that start value as its upper limit, so a value above it is refused and changes nothing.
"""
from __future__ import annotations

import dataclasses
import time

from batchtop.telemetry import events as ev
from batchtop.telemetry.protocol.commands import CommandQueue
from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS, Knob
from batchtop.telemetry.protocol.knob import lookup as lookup_knob

PAUSED_POLL_S = 0.05          # while paused, the engine thread checks for resume this often
MAX_COMMANDS = 1024           # commands queued for vLLM's engine thread; more are refused (503)
START_NOTE = "is the value vLLM started with (it sized its buffers from it; restart vLLM to go higher)"
MEANINGS = {"max_num_seqs": "vLLM's admission cap (max_num_active_reqs); at most its start value",
            "max_num_batched_tokens": "vLLM's token budget (max_num_scheduled_tokens); at most its start "
                                      "value",
            "long_prefill_token_threshold": "most prompt tokens a request takes in one step (0: no cap); at "
                                            "most the start token budget"}


def vllm_knobs(scheduler) -> dict[str, Knob]:
    """vLLM's knobs, each capped at the value vLLM started with: call once, before any change (the
    scheduler keeps them as `batchtop_knobs`)."""
    start = {"max_num_seqs": scheduler.max_num_active_reqs,
             "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
             "long_prefill_token_threshold": scheduler.max_num_scheduled_tokens}
    return {name: dataclasses.replace(row, high=start[name], help=MEANINGS[name], high_note=START_NOTE)
            for name, row in SCHEDULER_KNOBS.items()}


def knob_values(scheduler) -> dict[str, int]:
    return {"max_num_seqs": scheduler.max_num_active_reqs,
            "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
            "long_prefill_token_threshold": scheduler.scheduler_config.long_prefill_token_threshold}


def apply_knob(scheduler, name: str, value: int) -> None:
    """Engine thread, between steps: a value already checked against `vllm_knobs`."""
    if name == "max_num_seqs":
        scheduler.max_num_active_reqs = value
    elif name == "max_num_batched_tokens":
        scheduler.max_num_scheduled_tokens = value
    else:
        scheduler.scheduler_config.long_prefill_token_threshold = value


def set_knob(scheduler, name: str, value, source: str = "api") -> str | None:
    """Without the endpoint (the harness): check against `vllm_knobs`, queue for the next step; the
    refusal's message, or None when queued. The endpoint answers through the protocol's routes."""
    try:
        value = lookup_knob(scheduler.batchtop_knobs, name).parse(value)
    except ValueError as error:
        return str(error)
    commands = scheduler.batchtop_commands

    def apply():
        old = knob_values(scheduler)[name]
        apply_knob(scheduler, name, value)
        scheduler.batchtop_events.append(ev.KnobChanged(step=scheduler.batchtop_observer.step,
                                                        t=time.monotonic(), name=name, old=old, new=value,
                                                        source=source))
    commands.submit(apply)
    return None


def before_step(commands: CommandQueue) -> bool:
    """Apply queued commands; True when this step may schedule tokens. While paused it waits a
    little for a resume or a single step, so a paused engine does not spin."""
    commands.apply()
    if not commands.may_step():
        commands.apply(PAUSED_POLL_S)
    return commands.take_step()
