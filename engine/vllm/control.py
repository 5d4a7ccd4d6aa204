"""Live knobs and pause for vLLM's scheduler: validated on the caller's thread, applied between steps.

Knobs (batchtop's names, and the scheduler attribute each one sets):
- `max_num_seqs` -> `Scheduler.max_num_active_reqs`, the admission cap. Never
  `max_num_running_reqs`: that is the worker's row count, and `schedule()` asserts that
  the running set fits it, so lowering it below the running count would kill the engine.
  Lowering the cap preempts nothing: it binds as rows finish.
- `max_num_batched_tokens` -> `Scheduler.max_num_scheduled_tokens`, the token budget.
- `long_prefill_token_threshold` -> `scheduler_config.long_prefill_token_threshold`
  (0: no cap), read by `schedule()` each step.
vLLM sized its buffers from the values it started with: a value above the start value,
or below the floor, is refused with a message and changes nothing.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

PAUSED_POLL_S = 0.05          # while paused, the engine thread checks for resume this often


@dataclass(frozen=True)
class KnobRule:
    name: str
    low: int
    high: int                 # the value vLLM started with (sizes its buffers from it)
    meaning: str


class Controls:
    """Commands from the side endpoint (any thread) to the scheduler (engine thread)."""

    def __init__(self, scheduler, announce: Callable[[str, object, object], None],
                 refuse: Callable[[str, str], None], note_paused: Callable[[bool], None]):
        self._scheduler = scheduler
        self._announce, self._refuse, self._note_paused = announce, refuse, note_paused
        self.rules = {rule.name: rule for rule in (
            KnobRule("max_num_seqs", 1, scheduler.max_num_active_reqs,
                     "vLLM's admission cap (max_num_active_reqs)"),
            KnobRule("max_num_batched_tokens", 1, scheduler.max_num_scheduled_tokens,
                     "vLLM's token budget (max_num_scheduled_tokens)"),
            KnobRule("long_prefill_token_threshold", 0, scheduler.max_num_scheduled_tokens,
                     "most prompt tokens a request takes in one step (0: no cap)"),
        )}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.paused = False
        self._steps_allowed = 0

    # -- any thread ----------------------------------------------------------------------

    def knobs(self) -> dict[str, int]:
        s = self._scheduler
        return {"max_num_seqs": s.max_num_active_reqs, "max_num_batched_tokens": s.max_num_scheduled_tokens,
                "long_prefill_token_threshold": s.scheduler_config.long_prefill_token_threshold}

    def validate(self, name: str, value) -> int:
        """The value to set, or ValueError naming the allowed range; changes nothing."""
        rule = self.rules.get(name)
        if rule is None:
            raise ValueError(f"unknown knob {name!r} on vLLM; knobs: {', '.join(self.rules)}")
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value > rule.high:
            raise ValueError(f"{name} must be at most {rule.high}, the value vLLM started with (it sized its "
                             f"buffers from it; restart vLLM to go higher), got {value}")
        if value < rule.low:
            raise ValueError(f"{name} must be at least {rule.low}, got {value}")
        return value

    def set_knob(self, name: str, value, source: str = "api") -> str | None:
        """Validate now, apply before the next step: the error message, or None when accepted."""
        try:
            value = self.validate(name, value)
        except ValueError as error:
            message = str(error)
            self._put(lambda: self._refuse(f"set {name}", message))
            return message
        self._put(lambda: self._apply_knob(name, value, source))
        return None

    def pause(self) -> None:
        self._put(lambda: self._set_paused(True))

    def resume(self) -> None:
        self._put(lambda: self._set_paused(False))

    def step_once(self) -> None:
        def grant():
            self._steps_allowed += 1
        self._put(grant)

    def call_between_steps(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread before the next step."""
        self._put(command)

    def _put(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------------

    def before_step(self) -> bool:
        """Apply queued commands; True when this step may schedule tokens. While paused it waits a
        little for a resume or a single step, so a paused engine does not spin."""
        self._apply_commands()
        if not self.paused:
            return True
        if self._steps_allowed == 0:
            self._wake.wait(PAUSED_POLL_S)
            self._apply_commands()
        if not self.paused:
            return True
        if self._steps_allowed > 0:
            self._steps_allowed -= 1
            return True
        return False

    def _apply_commands(self) -> None:
        self._wake.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _apply_knob(self, name: str, value: int, source: str) -> None:
        old = self.knobs()[name]
        s = self._scheduler
        if name == "max_num_seqs":
            s.max_num_active_reqs = value
        elif name == "max_num_batched_tokens":
            s.max_num_scheduled_tokens = value
        else:
            s.scheduler_config.long_prefill_token_threshold = value
        self._announce(name, old, value, source)

    def _set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            self._steps_allowed = 0
            self._note_paused(paused)
