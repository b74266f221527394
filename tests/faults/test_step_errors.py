"""A Redis error at any step of a run never leaves a lock held.

A run takes its execution lock (or adopts its enqueue lock), may free the
message's enqueue lock, runs the body, then releases or keeps the lock as the
mode says. Each step's Redis call fails once here (``redis.ConnectionError``,
injected into the package's call), in a real worker: afterwards no lock of the
run is left (a failed release's key runs out within ``lock_ttl``, unrenewed)
and the watchdog renews nothing for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis

import celery_redislock._scripts
import celery_redislock.busy
import celery_redislock.execution
import celery_redislock.lock
import celery_redislock.run_lock
from celery_redislock import LockNotAcquired, RedisLock, RedisLockError, task_lock_key
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import get_watchdog
from tests import invariants
from tests.faults.conftest import RESULT_TIMEOUT, fresh
from tests.interrupts import define
from tests.taskapp import make_app
from tests.workers import threads_worker, wait_for

#: The runs' lease: how long a lock whose release failed lasts, unrenewed.
TTL = 1.5

#: step -> (object, attribute) of the call that fails once
STEPS: dict[str, tuple[Any, str]] = {
    "free_queued": (celery_redislock.execution, "release_token"),
    # a worker's run sends its release, and reads the reply at task_postrun (run_lock.release_later)
    "release": (redis.connection.AbstractConnection, "send_packed_command"),
    "release_reply": (celery_redislock._scripts.Script, "read_reply"),
    # a run that waits for the reply (lock_on_lost="raise": a loss at release fails it)
    "release_waited": (celery_redislock.lock.RedisLock, "_free"),
    "settle": (celery_redislock.execution, "SETTLE"),
    # a busy run republished (lock_busy="retry") renews its enqueue lock for the queued copy
    "renew_queued": (celery_redislock.busy, "RENEW"),
}
#: step -> whether the call fails (any, if not here): ``send_later``'s (a release's, not waited for)
FAILS: dict[str, Callable[[], bool]] = {
    "release": lambda: sys._getframe(2).f_code.co_name == "send_later",
    "release_reply": lambda: sys._getframe(2).f_code.co_name == "read",  # the deferred read's (free_later)
}
#: task -> the keyword arguments of its call (``fenced``: not gated)
KWARGS: dict[str, dict[str, Any]] = {"fenced": {"gate": False}}


def fail_once(monkeypatch: pytest.MonkeyPatch, step: str) -> list[tuple[Any, ...]]:
    """Make ``step``'s call raise ``redis.ConnectionError`` the first time; the calls that failed."""
    owner, name = STEPS[step]
    original: Callable[..., Any] = getattr(owner, name)
    failed: list[tuple[Any, ...]] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if not failed and FAILS.get(step, lambda: True)():
            failed.append(args)
            raise redis.ConnectionError(f"injected: {step} failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return failed


@pytest.mark.parametrize(
    ("task_name", "step", "on_error"),
    [
        ("until_executing", "free_queued", "fail"),
        ("until_executing", "free_queued", "run"),
        ("until_and_while_executing", "free_queued", "fail"),
        ("until_and_while_executing", "free_queued", "run"),
        ("hold_skip", "release", "fail"),
        ("until_executed", "release", "fail"),
        ("until_and_while_executing", "release", "fail"),
        ("hold_skip", "release_reply", "fail"),
        ("fenced", "release_waited", "fail"),
        ("until_expired", "settle", "fail"),
    ],
)
def test_a_redis_error_at_any_step_leaves_no_lock_held(
    redis_server: RedisServer,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    task_name: str,
    step: str,
    on_error: str,
) -> None:
    """The step fails once; the run then fails (``redislock_on_error="fail"``, before the body) or
    goes on (a failed release is only logged; ``"run"`` runs the body unlocked). Either way the
    run's locks are released or run out, and the watchdog holds no lease for them."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=TTL, redislock_on_error=on_error)
    task = app.tasks[f"taskapp.{task_name}"]
    x = fresh()
    kwargs = KWARGS.get(task_name, {})
    key = task_lock_key(task, (x,), kwargs)
    client = redis_server.client()
    failed = fail_once(monkeypatch, step)
    try:
        with threads_worker(app):
            result = task.delay(x, **kwargs)
            if step == "free_queued" and on_error == "fail":
                with pytest.raises(RedisLockError, match="injected"):
                    result.get(timeout=RESULT_TIMEOUT)
            else:
                assert result.get(timeout=RESULT_TIMEOUT) == x
            # a worker's release reply is read after the result is stored (``after_return``): the
            # result may be in before the step is called
            wait_for(lambda: len(failed) == 1, what=f"{step} to be called, once")
            leases = [lease.key for lease in list(get_watchdog().leases) if lease.key.startswith(key)]
            assert leases == [], "the watchdog still renews the run's lock"
            wait_for(
                lambda: not invariants.leftover_locks(client, prefix),
                timeout=TTL + 5,
                what=lambda: f"no lock left: {invariants.leftover_locks(client, prefix)}",
            )
    finally:
        client.close()
        app.close()


def test_a_redis_error_adopting_its_hold_keeps_it_while_the_run_goes_on_unlocked(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_executed`` with ``redislock_on_error="run"``: ``ADOPT`` fails once (a Redis error),
    so the body runs unlocked. The hold queued for the message is not given up for that failure:
    it still refuses duplicates while the run goes on (until its ``lock_queue_ttl``)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=TTL, redislock_on_error="run")
    client = redis_server.client()
    seen: list[bool] = []  # whether the hold queued for the message is there as the body runs
    keys: list[str] = []

    def body(self: Any, x: int) -> None:
        seen.append(bool(client.exists(keys[0])))

    task = define(app, "adopt_fails", body, lock_mode="until_executed")
    key = task_lock_key(task, (1,))
    keys.append(key)
    adopt = celery_redislock.run_lock.adopt

    def failing(lock: Any, token: str) -> Any:
        if lock.name == key and not seen:
            raise redis.ConnectionError("injected: ADOPT failed")
        return adopt(lock, token)

    monkeypatch.setattr(celery_redislock.execution, "adopt", failing)
    try:
        with threads_worker(app):
            assert task.delay(1).get(timeout=RESULT_TIMEOUT) == 1
        assert seen == [True]
    finally:
        client.delete(key)
        client.close()
        app.close()


def test_a_redis_error_freeing_the_enqueue_lock_of_a_refused_run_never_runs_it_unlocked(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_and_while_executing`` with ``lock_busy="raise"`` and ``redislock_on_error="run"``:
    another run holds the execution lock, so this one gives up (``LockNotAcquired``), and freeing
    its enqueue lock fails once. That error does not make it an unlocked run beside the holder:
    it fails with ``LockNotAcquired``, and its enqueue lock is freed all the same."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=TTL, redislock_on_error="run")
    task = app.tasks["taskapp.uawe_raise"]
    x = fresh()
    client = redis_server.client()
    holder = RedisLock(client, task_lock_key(task, (x,)), TTL)
    assert holder.acquire(blocking=False)
    failed = fail_once(monkeypatch, "free_queued")
    try:
        with threads_worker(app):
            result = task.delay(x)
            with pytest.raises(LockNotAcquired):
                result.get(timeout=RESULT_TIMEOUT)
        assert len(failed) == 1
        assert [event for event in app.recorder.events() if event[0] == "start"] == []  # type: ignore[attr-defined]
        holder.release()
        assert invariants.leftover_locks(client, prefix) == []
    finally:
        if holder.owned():  # the test failed before releasing it
            holder.release()
        client.close()
        app.close()


def test_a_redis_error_renewing_the_enqueue_lock_of_a_busy_retry_never_runs_it_unlocked(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_and_while_executing`` (``lock_busy="retry"``) with ``redislock_on_error="run"``:
    another run holds the execution lock, so this one is republished, and the renewal of its
    enqueue lock for the queued copy fails once. That error does not make it an unlocked run
    beside the holder (before: the body ran): the message is republished all the same (its
    enqueue lock lives as set at enqueue), and runs once the holder let go."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=TTL, redislock_on_error="run")
    task = app.tasks["taskapp.until_and_while_executing"]
    x = fresh()
    client = redis_server.client()
    holder = RedisLock(client, task_lock_key(task, (x,)), TTL)
    assert holder.acquire(blocking=False)
    failed = fail_once(monkeypatch, "renew_queued")

    def events(kind: str) -> list[Any]:
        return [event for event in app.recorder.events() if event[:1] == [kind] and event[2] == str(x)]  # type: ignore[attr-defined]

    try:
        with threads_worker(app):
            result = task.delay(x)
            wait_for(
                lambda: len(events("busy")) >= 2 or events("start"), what="the message to come back busy"
            )
            assert len(failed) == 1
            assert events("start") == [], "the body ran unlocked beside the holder"
            holder.release()
            assert result.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: not invariants.leftover_locks(client, prefix), what="no lock left")
    finally:
        if holder.owned():  # the test failed before releasing it
            holder.release()
        client.close()
        app.close()


@pytest.mark.locks_may_remain("none: the hold whose SETTLE failed runs out within its lease")
def test_a_redis_error_keeping_a_period_is_reported_as_an_error_not_settled(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_expired``: SETTLE fails once after the run. What the run's let-go reports (its
    release step's outcome, in spans and events) is ``"error"``, not ``"settled"``: the period
    was not kept; the hold, forgotten, runs out within its lease."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=TTL)
    task = app.tasks["taskapp.until_expired"]
    x = fresh()
    failed = fail_once(monkeypatch, "settle")
    keep = celery_redislock.execution.Execution.keep
    outcomes: list[str | None] = []

    def kept(self: Any) -> str | None:
        outcome = keep(self)
        outcomes.append(outcome)
        return outcome

    monkeypatch.setattr(celery_redislock.execution.Execution, "keep", kept)
    try:
        with threads_worker(app):
            assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
            wait_for(lambda: outcomes, what="the run to let go")
        assert len(failed) == 1 and outcomes == ["error"]
    finally:
        app.close()
