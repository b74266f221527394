"""A lost lock and ``lock_on_lost``: the loss always reaches the task, and
nothing in the process breaks.

* ``"raise"``: ``LockLost`` comes only where the package controls the moment
  (``self.check_lock()``, a locked call inside the run, the body's normal
  return), never at an arbitrary instruction: a loss while the body is inside
  ``logging`` or redis-py can neither be swallowed there nor leave one of their
  locks held, so the watchdog thread (which logs) keeps renewing every other
  lock of the process;
* ``"terminate"``: a prefork pool child whose lock is lost is stopped at once,
  as by a hard time limit; the main process records the failure and its
  owner-checked release leaves the new holder alone. In a pool that runs
  tasks in the worker's own process (threads, solo) it is ``"raise"``.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import redis
from billiard.exceptions import WorkerLostError

from celery_redislock import LockLost, RedisLock, task_lock_key
from celery_redislock.config import app_settings
from celery_redislock.run_lock import ExecutionLock
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import get_watchdog
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.taskapp import Recorder, make_app, running
from tests.workers import threads_worker, wait_for

#: Losses per kind of work (logging, Redis calls).
LOSSES = 60
#: Longest the stress test waits for all its runs' outcomes.
STRESS_TIMEOUT = 120
#: Lease of the process's other locks, renewed by the same watchdog all along (every 1 s): a
#: frozen watchdog loses them within the stress (~10 s), a loaded machine stalling it under 2 s does not.
OTHERS_TTL = 3.0


@pytest.fixture
def shared_handler() -> Iterator[io.StringIO]:
    """A handler on the package's logger: both the task bodies' logs and the watchdog's go through
    it (and its lock), as with a worker's usual root handler."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    package = logging.getLogger("celery_redislock")
    level = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        package.removeHandler(handler)
        package.setLevel(level)


def renewed(client: redis.Redis, lock: RedisLock, deadline: float) -> bool:
    """Whether ``lock``'s TTL goes up again (a renewal) before monotonic ``deadline``."""
    lowest = client.pttl(lock.name)
    while time.monotonic() < deadline:
        now = client.pttl(lock.name)
        if now > lowest:
            return True
        lowest = min(lowest, now)
        time.sleep(0.01)  # a polling step with a deadline, not a synchronisation
    return False


def test_losses_while_logging_or_in_redis_calls_reach_the_task_and_never_stop_the_watchdog(
    redis_server: RedisServer, prefix: str, shared_handler: io.StringIO
) -> None:
    """Many runs with ``lock_on_lost="raise"`` lose their lock while their body logs in a tight
    loop (through the handler the watchdog logs to) or calls Redis. Every run fails with
    ``LockLost`` (no loss is swallowed, no run reports success), and meanwhile the watchdog
    keeps renewing the process's other locks: they stay owned, their TTLs go up again, and the
    watchdog still renews a lock taken afterwards (no handler or connection lock was left held)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    task = app.tasks["taskapp.lose_own_lock"]
    client = redis_server.client()
    others = [RedisLock(client, f"{prefix}:other:{i}", ttl=OTHERS_TTL) for i in range(20)]
    for lock in others:
        assert lock.acquire(blocking=False)
    try:
        with threads_worker(app, concurrency=4):
            results = [task.delay(i, work) for i in range(LOSSES) for work in ("log", "redis")]
            outcomes = []
            deadline = time.monotonic() + STRESS_TIMEOUT
            for result in results:
                try:
                    outcomes.append(repr(result.get(timeout=max(deadline - time.monotonic(), 0.1))))
                except LockLost:
                    outcomes.append("LockLost")
                assert all(lock.owned() and not lock.lost.is_set() for lock in others)
            assert outcomes == ["LockLost"] * len(results)
            deadline = time.monotonic() + 4 * OTHERS_TTL
            assert all(renewed(client, lock, deadline) for lock in others[:3])
            late = RedisLock(client, f"{prefix}:late", ttl=0.6)
            assert late.acquire(blocking=False)
            assert renewed(client, late, time.monotonic() + 3.0), "the watchdog thread no longer renews"
            late.release()
        assert (thread := get_watchdog()._thread) is not None and thread.is_alive()
        assert "lost (not owned)" in shared_handler.getvalue()
    finally:
        for lock in others:
            lock.release()
        client.close()
        app.close()


def test_a_locked_call_inside_a_run_whose_lock_was_lost_raises_lock_lost(
    redis_server: RedisServer, prefix: str
) -> None:
    """``"raise"``: a run whose lock was lost calls another ``LockedTask``; that call is one of
    the points where the loss is raised, before it takes a lock or runs anything."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]
    x = fresh()
    try:
        with pytest.raises(LockLost):
            app.tasks["taskapp.calls_after_loss"](x)
        assert [event for event in recorder.events() if event[0] == "depth0"] == []
    finally:
        app.close()


def test_terminate_stops_the_prefork_child_whose_lock_was_lost(stage: Stage) -> None:
    """``lock_on_lost="terminate"``: the lock of a run blocked in one long call is taken over
    by a new holder; the old run's pool child is stopped, its task fails, the main process's
    release leaves the new holder's lock alone, and the worker goes on."""
    worker = stage.worker("prefork", "prefork", 2, redislock_ttl=3)
    x, task = fresh(), stage.task("terminated")
    key = task_lock_key(task, (x,))
    first = task.delay(x)
    start = stage.wait_events("start", x)[0]
    child = int(start[4])
    stage.client.delete(key)  # the lease is gone: the next call takes the lock
    second = task.delay(x)
    starts = stage.wait_events("start", x, 2)
    assert starts[1][3] == second.id and int(starts[1][5]) > int(start[5])
    wait_for(lambda: not running(child), timeout=10, what="the old run's pool child to be stopped")
    with pytest.raises(WorkerLostError):
        first.get(timeout=RESULT_TIMEOUT)
    value = stage.client.get(key)  # the new holder's lock, untouched
    assert isinstance(value, bytes) and int(value.split(b":")[1]) == int(starts[1][5])
    assert stage.events("end", x) == []  # the old body never went on
    log = worker.output()
    assert f"stopping pool child {child}" in log
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    assert not stage.client.exists(key)
    assert worker.alive()


def test_terminate_in_a_threads_worker_raises_instead_and_warns_once(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """In a pool that runs tasks in the worker's own process, ``"terminate"`` would stop the whole
    worker: it is ``"raise"`` there, with one WARNING saying so."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    task = app.tasks["taskapp.terminated_checks"]
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]
    client = redis_server.client()
    try:
        with threads_worker(app), caplog.at_level(logging.WARNING, "celery_redislock"):
            for _ in range(2):
                x = fresh()
                result = task.delay(x)
                wait_for(
                    lambda: [e for e in recorder.events() if e[0] == "start" and e[2] == x],  # noqa: B023
                    what="the body to start",
                )
                client.delete(task_lock_key(task, (x,)))
                with pytest.raises(LockLost):  # and this process, the worker's, is still here
                    result.get(timeout=RESULT_TIMEOUT)
                assert [e for e in recorder.events() if e[0] == "end" and e[2] == x] == []
        warnings = [r for r in caplog.records if "lock_on_lost='terminate'" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, warnings
    finally:
        client.close()
        app.close()


def test_terminate_stops_only_a_child_whose_body_still_runs(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss found once the body has ended (the run is releasing, or the child has moved on)
    stops nothing; a loss while the body runs stops the child (``os.kill``, recorded here)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: kills.append((pid, signum)))
    client = redis_server.client()
    try:
        for in_body in (False, True):
            lock = ExecutionLock(
                client,
                f"{prefix}:run:{in_body}",
                0.6,
                "task=- try=0 state=running node=test pid=0",
                app_settings(app),
                task_name="test",
                raise_on_lost=True,
                stop_child=True,
            )
            assert lock.acquire(blocking=False)
            with lock.body() if in_body else nullcontext():
                client.delete(lock.name)
                assert lock.lost.wait(5), "the watchdog did not find the loss"
            assert kills == ([(os.getpid(), signal.SIGKILL)] if in_body else [])
    finally:
        client.close()
        app.close()
