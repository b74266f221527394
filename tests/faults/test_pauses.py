"""A holder paused (SIGSTOP) or cut off from Redis (a TCP proxy) for longer than ``lock_ttl``
learns of the loss and leaves the next holder alone, while a second worker takes the lock.

The guarantees under test, from docs/design.md, "When things go wrong":

* the lease expires and another worker may take the lock, with a greater fence;
* the stale holder learns of the loss within one renewal interval (``lock_ttl/3``)
  of running again (paused), or of its lease running out (cut off): an ERROR
  log, the ``lock_lost`` signal (recorded as a ``lost`` event by ``tests.taskapp``);
* with ``lock_on_lost="raise"`` its body is stopped by ``LockLost`` at its next ``self.check_lock()``;
* its exit (a release sent late, or held up by the cut) leaves the new
  holder's lock alone.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from celery_redislock import task_lock_key
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.faults.proxy import TCPProxy
from tests.workers import WorkerProcess, wait_for

TTL = 2.4
INTERVAL = TTL / 3


class Takeover:
    """The stale holder's run of ``taskapp.fenced`` on queue ``stale``, then the new holder's on ``fresh``."""

    def __init__(self, stage: Stage, stale: WorkerProcess) -> None:
        self.stage, self.stale_worker = stage, stale
        self.x, self.task = fresh(), stage.task("fenced")
        self.key = task_lock_key(self.task, (self.x,))
        self.stale = self.task.apply_async((self.x,), queue="stale")
        self.stale_start = stage.wait_events("start", self.x)[0]
        self.fresh: Any = None
        self.fresh_start: list[str] = []

    def lease_left(self) -> float:
        """Monotonic time at which the stale holder's lease runs out in Redis."""
        left = self.stage.client.pttl(self.key) / 1000
        assert left > 0
        return time.monotonic() + left

    def take_over(self) -> None:
        """Once the stale lease has run out, run the duplicate on the other worker."""
        wait_for(lambda: not self.stage.client.exists(self.key), timeout=TTL + 5, what="the lease to run out")
        self.fresh = self.task.apply_async((self.x,), queue="fresh")
        self.fresh_start = self.stage.wait_events("start", self.x, 2)[1]
        assert self.fresh_start[3] == self.fresh.id

    def lost_event(self) -> list[str]:
        lost = self.stage.wait_events("lost", self.x)
        assert len(lost) == 1 and lost[0][3] == self.stale.id, lost
        return lost[0]

    def check_outcome(self, reason: str) -> None:
        with pytest.raises(Exception, match="was lost while held") as raised:
            self.stale.get(timeout=RESULT_TIMEOUT)
        assert type(raised.value).__name__ == "LockLost"
        assert self.stage.events("end", self.x) == []  # the stale body was stopped
        assert int(self.stale_start[5]) < int(self.fresh_start[5])
        value = self.stage.client.get(self.key)  # the stale exit left the new holder's lock alone
        assert isinstance(value, bytes) and int(value.split(b":")[1]) == int(self.fresh_start[5])
        log = self.stale_worker.output()
        assert f"lock '{self.key}' lost ({reason})" in log
        assert f"lock {self.key} was no longer held" in log or f"could not release lock {self.key}" in log
        self.stage.recorder.open_gate(self.x)
        assert self.fresh.get(timeout=RESULT_TIMEOUT) == self.x
        assert not self.stage.client.exists(self.key)


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_paused_worker_learns_of_its_lost_lock_within_one_renewal_interval(stage: Stage, pool: str) -> None:
    stale = stage.worker("stale", pool, 2 if pool == "prefork" else 1, queue="stale", redislock_ttl=TTL)
    stage.worker("fresh", queue="fresh", redislock_ttl=TTL)
    run = Takeover(stage, stale)
    os.killpg(stale.pid, signal.SIGSTOP)  # the main process and its pool children
    try:
        run.take_over()
    finally:
        resumed_at = time.monotonic()
        os.killpg(stale.pid, signal.SIGCONT)
    lost = run.lost_event()
    assert lost[8] == "not_owned"
    assert float(lost[7]) - resumed_at <= INTERVAL, f"noticed {float(lost[7]) - resumed_at:.3f}s after"
    run.check_outcome("not owned")


@contextmanager
def cut(proxy: TCPProxy, how: Callable[[], None]) -> Iterator[None]:
    how()
    try:
        yield
    finally:
        proxy.heal()


@pytest.mark.parametrize("how", ["stall", "drop"])
def test_a_network_cut_longer_than_lock_ttl_is_noticed_when_the_lease_runs_out(
    stage: Stage, how: str
) -> None:
    with TCPProxy(stage.server.port) as proxy:
        stale = stage.worker("stale", queue="stale", redislock_url=proxy.url(), redislock_ttl=TTL)
        stage.worker("fresh", queue="fresh", redislock_ttl=TTL)
        run = Takeover(stage, stale)
        assert proxy.accepted > 0  # the stale worker's locks go through the proxy
        with cut(proxy, getattr(proxy, how)):
            runs_out = run.lease_left()
            lost = run.lost_event()  # noticed while still cut off
            assert lost[8] == "expired"
            late = float(lost[7]) - runs_out
            assert late <= INTERVAL, f"noticed {late:.3f}s after the lease ran out"
            run.take_over()
        run.check_outcome("expired")
