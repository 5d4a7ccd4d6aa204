"""The command queue between a server (any thread) and the engine thread: applied before a step.

Callers validate on their own thread and `submit` a command; the engine thread calls `apply`
between steps and asks `take_step` whether a step may run. Pause, resume and single steps are
commands too, so they land in order with knob changes. The queue is bounded: a full queue
refuses (`QueueFull`, its message fit for an HTTP answer) and drops nothing already queued.
Commands submitted with a `key` coalesce: while one with that key waits, another is not queued
(snapshots asked for by many joining clients become one).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from .limits import MAX_COMMANDS

Command = Callable[[], None]


class QueueFull(RuntimeError):
    """The engine has not taken its queued commands yet; nothing was queued."""


class CommandQueue:
    def __init__(self, maxsize: int = MAX_COMMANDS, *, on_paused: Callable[[bool], None] | None = None,
                 on_error: Callable[[str, str], None] | None = None):
        self.maxsize = maxsize
        self._queue: queue.Queue[Command] = queue.Queue(maxsize)
        self._on_paused = on_paused
        self._on_error = on_error
        self._keys: set[str] = set()          # keys of coalescing commands that wait
        self._keys_lock = threading.Lock()
        self.paused = False                   # the engine thread's view: changed only by applied commands
        self.steps_allowed = 0                # single steps granted while paused

    def __len__(self) -> int:
        return self._queue.qsize()

    # -- any thread ------------------------------------------------------------------------

    def submit(self, command: Command, key: str | None = None) -> None:
        """Queue `command` for the engine thread; QueueFull when the queue is full."""
        if key is not None:
            with self._keys_lock:
                if key in self._keys:
                    return
                self._keys.add(key)
            command = self._keyed(command, key)
        try:
            self._queue.put_nowait(command)
        except queue.Full:
            if key is not None:
                with self._keys_lock:
                    self._keys.discard(key)
            raise QueueFull(f"the engine has {self.maxsize} commands it has not applied yet; "
                            "try again when it has caught up") from None

    def wake(self) -> None:
        """Make a waiting `apply` return (shutdown); never refused."""
        try:
            self._queue.put_nowait(_nothing)
        except queue.Full:
            pass                              # a full queue wakes the engine thread anyway

    def pause(self) -> None:
        self.submit(lambda: self._set_paused(True))

    def resume(self) -> None:
        self.submit(lambda: self._set_paused(False))

    def step_once(self) -> None:
        """While paused: run exactly one more step."""
        self.submit(self._grant_step)

    # -- engine thread ---------------------------------------------------------------------

    def apply(self, wait_s: float = 0.0) -> None:
        """Run every queued command; with `wait_s` > 0 wait that long for the first one."""
        try:
            command = self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception as error:        # a bad command must not stop the engine
                if self._on_error is None:
                    raise
                self._on_error(getattr(command, "__qualname__", "command"), str(error))
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return

    def may_step(self) -> bool:
        return not self.paused or self.steps_allowed > 0

    def take_step(self) -> bool:
        """True when this step may run (it uses up a single step granted while paused)."""
        if not self.paused:
            return True
        if self.steps_allowed > 0:
            self.steps_allowed -= 1
            return True
        return False

    def _keyed(self, command: Command, key: str) -> Command:
        def run():
            with self._keys_lock:
                self._keys.discard(key)      # from here on a new request of this key queues again
            command()
        run.__qualname__ = getattr(command, "__qualname__", key)
        return run

    def _grant_step(self) -> None:
        self.steps_allowed += 1

    def _set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self.paused = paused
            self.steps_allowed = 0
            if self._on_paused is not None:
                self._on_paused(paused)


def _nothing() -> None:
    pass
