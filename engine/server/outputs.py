"""Outputs from the engine thread to the asyncio side: per-request token lists, one wakeup per burst."""
from __future__ import annotations

import asyncio
from collections import deque


class _Pending:
    """One engine request as the asyncio side sees it."""
    __slots__ = ("request_id", "tokens", "finished", "reason", "wake")

    def __init__(self, request_id: str, wake: asyncio.Event):
        self.request_id = request_id
        self.tokens: list[int] = []
        self.finished = False
        self.reason: str | None = None
        self.wake = wake


class OutputRouter:
    """Engine-thread callbacks in, per-request token lists on the asyncio side.

    `push` (engine thread) appends to a deque and schedules one `_dispatch` per burst, so a
    step with 32 outputs costs one wakeup of the asyncio loop, not 32.
    """

    def __init__(self):
        self.aloop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque = deque()
        self._scheduled = False
        self._pending: dict[str, _Pending] = {}

    def open(self, request_id: str, wake: asyncio.Event) -> _Pending:
        pending = self._pending[request_id] = _Pending(request_id, wake)
        return pending

    def close(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def push(self, output) -> None:
        """Engine thread: must never raise (it would end the engine) nor block."""
        self._inbox.append(output)
        if not self._scheduled:
            self._scheduled = True
            try:
                self.aloop.call_soon_threadsafe(self._dispatch)
            except (RuntimeError, AttributeError):   # the HTTP side is gone or not started: nobody waits
                self._scheduled = False
                self._inbox.clear()

    def _dispatch(self) -> None:
        self._scheduled = False
        inbox, pending = self._inbox, self._pending
        while inbox:
            output = inbox.popleft()
            p = pending.get(output.request_id)
            if p is None or p.finished:
                continue
            p.tokens.extend(output.new_token_ids)
            if output.finished:
                p.finished, p.reason = True, output.finish_reason
            p.wake.set()
