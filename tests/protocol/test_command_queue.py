"""The protocol's command queue: bounded without losing what it holds, pause/step in order with other
commands, coalesced snapshots; and a host answers a full queue with 503 and Retry-After."""
from __future__ import annotations

import pytest

from batchtop.telemetry.protocol.commands import CommandQueue, QueueFull
from batchtop.telemetry.protocol.errors import ApiError
from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS
from batchtop.telemetry.protocol.routes import ControlHost
from batchtop.telemetry.protocol.stream import EventRing


def test_a_full_queue_refuses_and_keeps_what_it_holds():
    ran = []
    q = CommandQueue(maxsize=3)
    for i in range(3):
        q.submit(lambda i=i: ran.append(i))
    with pytest.raises(QueueFull, match="3 commands it has not applied yet"):
        q.submit(lambda: ran.append("lost"))
    q.apply()
    assert ran == [0, 1, 2]
    q.submit(lambda: ran.append(3))          # room again
    q.apply()
    assert ran == [0, 1, 2, 3]


def test_pause_and_single_steps_apply_in_order():
    paused = []
    q = CommandQueue(on_paused=paused.append)
    q.pause()
    q.step_once()
    q.step_once()
    q.apply()
    assert paused == [True] and q.paused
    assert [q.take_step() for _ in range(3)] == [True, True, False]
    q.resume()
    q.apply()
    assert paused == [True, False] and q.take_step() and q.take_step()


def test_keyed_commands_coalesce_while_one_waits():
    snapshots = []
    q = CommandQueue()
    for _ in range(50):
        q.submit(lambda: snapshots.append("snap"), key="snapshot")
    assert len(q) == 1
    q.apply()
    q.submit(lambda: snapshots.append("snap"), key="snapshot")     # after it ran, a new one queues
    q.apply()
    assert snapshots == ["snap", "snap"]


def test_a_failing_command_is_reported_and_the_rest_run():
    errors, ran = [], []
    q = CommandQueue(on_error=lambda what, message: errors.append(message))
    q.submit(lambda: 1 / 0)
    q.submit(lambda: ran.append("after"))
    q.apply()
    assert errors == ["division by zero"] and ran == ["after"]


class FakeHost(ControlHost):
    knob_table = SCHEDULER_KNOBS

    def __init__(self, maxsize: int, failure: str | None = None):
        super().__init__()
        self.commands = CommandQueue(maxsize)
        self.ring = EventRing(10)
        self._failure = failure

    @property
    def failure(self):
        return self._failure

    def knob_values(self): return {name: 1 for name in self.knob_table}
    def describe(self): return {}
    def apply_knob(self, name, value, source): pass
    def refuse(self, command, message): pass
    def emit_snapshot(self, cause): pass
    def pump(self): pass


def test_a_host_answers_a_full_queue_with_503_and_retry_after():
    host = FakeHost(maxsize=2)
    host.set_knob("max_num_seqs", 2)
    host.set_paused(True)
    for command in (lambda: host.set_knob("max_num_seqs", 3), lambda: host.set_paused(False), host.step):
        with pytest.raises(ApiError) as full:
            command()
        assert full.value.status == 503 and full.value.headers == {"Retry-After": "1"}
        assert full.value.code == "command_queue_full"
    assert host.paused is True and len(host.commands) == 2          # the refused resume changed nothing
    for _ in range(10):
        host.request_snapshot("subscribe")                          # a full queue: no error, no snapshot
    assert len(host.commands) == 2


def test_a_host_whose_part_is_off_refuses_commands_with_the_reason():
    host = FakeHost(maxsize=8, failure="schedule failed: RuntimeError('boom')")
    for command in (lambda: host.set_knob("max_num_seqs", 3), lambda: host.set_paused(True), host.step):
        with pytest.raises(ApiError, match=r"batchtop's part is off \(schedule failed"):
            command()
    assert len(host.commands) == 0
    assert host.health() == (503, {"status": "batchtop off",
                                   "batchtop_failure": "schedule failed: RuntimeError('boom')"})
    assert host.knobs()["batchtop_failure"] == host.hello()["batchtop_failure"] == host.failure
