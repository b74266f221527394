"""A run's exit paths under an asynchronous exception: a Celery soft time limit, raised by a signal
handler at any bytecode of the pool child, lands inside the package's own code. It is simulated
here by raising at the entry of a function the package calls (where CPython checks for pending
signals), or right after one returns.

What must hold whatever lands where: a lock the mode keeps after the run (parked for a retry,
kept for ``lock_period``) is never deleted; a hold nothing knows the token of is given back at
once, not left for its lease; a message dealt with (failed, or its pool child dead) frees its
enqueue lock; a release whose outcome is unknown is never reported as a loss.

Each test runs a real worker on the suite's Redis: in-process (threads pool), or a prefork
subprocess where a pool child is killed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.task import Task
from celery.canvas import Signature
from celery.exceptions import Reject, Retry, SoftTimeLimitExceeded
from celery.signals import task_failure, task_postrun, task_revoked
from celery.utils.dispatch import Signal
from kombu.exceptions import OperationalError

import celery_redislock._task_scripts
import celery_redislock.busy
import celery_redislock.execution
import celery_redislock.lock
import celery_redislock.primitive
import celery_redislock.run_lock
import celery_redislock.task
from celery_redislock import LockedTask, task_lock_key
from celery_redislock.attempt import Attempt
from celery_redislock.exceptions import LockLost, LockNotAcquired
from celery_redislock.lock import RedisLock, companion_key
from celery_redislock.protocol import parse_holder, parse_value
from celery_redislock.signals import lock_acquired, lock_released
from celery_redislock.state import app_state, running
from celery_redislock.testing import RedisServer
from tests.interrupts import define
from tests.invariants import Sampler
from tests.taskapp import recorder as recorder_for
from tests.workers import WorkerProcess, runs_over, threads_worker, wait_for

RESULT_TIMEOUT = 30


@contextmanager
def signalled(signal: Signal, task: Any, argument: str) -> Iterator[list[Any]]:
    """The ``argument`` of each ``signal`` sent for ``task`` (a task of its name) meanwhile."""
    seen: list[Any] = []

    def record(sender: Any = None, **arguments: Any) -> None:
        if sender is not None and sender.name == task.name and arguments.get(argument) is not None:
            seen.append(arguments[argument])

    signal.connect(record, weak=False)
    try:
        yield seen
    finally:
        signal.disconnect(record)


def postruns(task: Any) -> AbstractContextManager[list[str]]:
    """The ids of ``task``'s runs whose ``task_postrun`` is sent (the package finishes a run
    after it: wait for ``runs_over`` too)."""
    return signalled(task_postrun, task, "task_id")


def interrupt_first_call(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, key: str) -> list[int]:
    """Make the first call of the method ``owner.name`` on the lock ``key`` (a lock's ``name``, a
    run's ``key``) in a worker's thread (not the test's: it sends the messages) raise
    ``SoftTimeLimitExceeded`` at its entry; the returned list gets an item when it did."""
    method = getattr(owner, name)
    fired: list[int] = []

    def interrupted(self: Any, *args: Any) -> Any:
        on = getattr(self, "name", None) or getattr(self, "key", None)
        if not fired and on == key and threading.current_thread() is not threading.main_thread():
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return method(self, *args)

    monkeypatch.setattr(owner, name, interrupted)
    return fired


def interrupt_first_adopt(
    monkeypatch: pytest.MonkeyPatch, module: Any, key: str, holder_part: str = ""
) -> list[int]:
    """Make the first ``run_lock.adopt`` that ``module`` calls on the lock ``key``, for a hold
    whose holder names ``holder_part``, raise ``SoftTimeLimitExceeded`` at its entry (before
    ``ADOPT`` is sent); the returned list gets an item when it did."""
    adopt = celery_redislock.run_lock.adopt
    fired: list[int] = []

    def interrupted(lock: Any, token: str) -> Any:
        if fired or lock.name != key or holder_part not in (lock.holder or ""):
            return adopt(lock, token)
        fired.append(1)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(module, "adopt", interrupted)
    return fired


def run_interrupted(app: Celery, task: Any, x: int) -> None:
    """Run ``task(x)`` on an in-process worker: it fails with the soft time limit; returns once
    its ``task_postrun`` is over."""
    with postruns(task) as done, threads_worker(app, concurrency=1):
        result = task.delay(x)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=RESULT_TIMEOUT)
        wait_for(lambda: result.id in done and runs_over(task.name, result.id), what="the run's end")


def events(app: Celery, kind: str, x: object) -> list[list[str]]:
    """The events ``kind`` the bodies of ``tests.taskapp`` recorded for ``x`` (``[kind, task, x,
    task id, pid, ...]``)."""
    return [event for event in recorder_for(app).events() if event[0] == kind and event[2] == str(x)]


def run_retry_handed_its_parked_hold(app: Celery, task: Any, x: str) -> None:
    """Run ``taskapp.retry_once(x, how="no_throw")`` on an in-process worker: attempt 1 is
    published while attempt 0 runs, finds it running (``busy.AdoptParked``) and waits for the
    hold attempt 0 parks for it as it ends; returns once both attempts' ``task_postrun`` is over."""
    with postruns(task) as done, threads_worker(app):
        result = task.delay(x, how="no_throw")
        wait_for(lambda: events(app, "busy", x), what="attempt 1 to find attempt 0 running")
        recorder_for(app).open_gate(x)
        wait_for(
            lambda: done.count(result.id) == 2 and runs_over(task.name, result.id),
            what="both attempts' end",
        )


@contextmanager
def recorder_of(app: Celery) -> Iterator[redis.Redis]:
    """A client of the locks' Redis, closed at the end."""
    client = redis.Redis.from_url(app.conf.redislock_url)
    try:
        yield client
    finally:
        client.close()


# -- a lock the mode keeps after the run ---------------------------------------------------------


@pytest.mark.locks_may_remain("an until_expired period")
def test_a_soft_time_limit_right_after_settle_keeps_the_until_expired_period(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_expired: the soft time limit lands in ``Execution._settle`` just after SETTLE kept
    the key for ``lock_period``. The hold is forgotten once SETTLE is sent, so ``task_postrun``
    does not release it: the key stays for the period that keeps the next run out."""
    task = define(app, "settled", lock_mode="until_expired", lock_period=60)
    settle = celery_redislock._task_scripts.SETTLE

    def settled_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        settle(*args, **kwargs)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(celery_redislock.execution, "SETTLE", settled_then_interrupted)
    key = task_lock_key(task, (1,))
    with recorder_of(app) as recorder:
        try:
            run_interrupted(app, task, 1)
            assert recorder.pttl(key) > 50_000, "the until_expired lock was released before its period"
        finally:
            recorder.delete(key)


@pytest.mark.locks_may_remain("an until_expired period")
def test_a_soft_time_limit_before_settle_is_sent_keeps_the_until_expired_period(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_expired: the soft time limit lands as ``let_go`` stops renewing the hold, before
    SETTLE is sent. ``task_postrun``'s safety net lets go as the mode does (settles), never
    with a release: the key stays for ``lock_period``."""
    task = define(app, "unsettled", lock_mode="until_expired", lock_period=60)
    key = task_lock_key(task, (2,))
    fired = interrupt_first_call(monkeypatch, celery_redislock.primitive.LeaseLock, "stop_renewing", key)
    with recorder_of(app) as recorder:
        try:
            run_interrupted(app, task, 2)
            assert fired == [1]
            assert recorder.pttl(key) > 50_000, "the until_expired lock was released before its period"
        finally:
            recorder.delete(key)


def test_a_soft_time_limit_before_park_is_sent_keeps_the_lock_for_the_retry(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed: an attempt sent its retry (due in 60 s), and the soft time limit lands as
    ``let_go`` stops renewing the hold, before PARK is sent. ``task_postrun``'s safety net parks
    the hold for the retry (``state=queued try=1``, for ``lock_queue_ttl`` plus the countdown)
    instead of releasing it, which would let a duplicate in until the retry runs."""

    def retry_later(self: Any, x: int) -> None:
        raise self.retry(countdown=60)

    task = define(app, "parked", retry_later, lock_mode="until_executed")
    key = task_lock_key(task, (3,))
    fired = interrupt_first_call(monkeypatch, celery_redislock.primitive.LeaseLock, "stop_renewing", key)
    with recorder_of(app) as recorder:
        try:
            run_interrupted(app, task, 3)
            assert fired == [1]
            value = parse_value(recorder.get(key))
            held = parse_holder(None if value is None else value.holder)
            assert (held.get("state"), held.get("try")) == ("queued", "1"), value
            assert recorder.pttl(key) > 60_000
        finally:
            recorder.delete(key)


def interrupted_after_its_send(monkeypatch: pytest.MonkeyPatch, task: Any) -> list[int]:
    """From now on, the first ``apply_async`` of ``task`` on a worker thread (its retry's send)
    publishes the message, then raises ``SoftTimeLimitExceeded``, as a soft time limit landing
    right after the send would. Returns a list that gets a 1 when it did."""
    publish, fired = Task.apply_async, list[int]()

    def sent_then_interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = publish(self, *args, **kwargs)
        if not fired and self.name == task.name and threading.current_thread() is not threading.main_thread():
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return result

    monkeypatch.setattr(Task, "apply_async", sent_then_interrupted)
    return fired


def the_retry_ran(
    recorder: Any,
    key: str,
    task: Any,
    result: Any,
    done: list[str],
    started: list[tuple[int, int]],
    fired: list[int],
    x: int,
) -> None:
    """Both attempts of ``result`` ended (``done``: their postruns); the interrupt fired once, the
    retry ran after attempt 0 (``started``: (retries, fence) of each start), and its result is
    the task's."""
    wait_for(
        lambda: done.count(result.id) == 2 and runs_over(task.name),
        what=lambda: f"both attempts' end; started {started}, lock {recorder.get(key)!r}",
    )
    assert fired == [1]
    assert [attempt for attempt, _ in started] == [0, 1], "the retry did not run"
    assert result.get(timeout=RESULT_TIMEOUT) == x


def the_retry_holds_as_its_mode_says(
    recorder: Any, key: str, started: list[tuple[int, int]], mode: str
) -> None:
    """The retry took the lock with a fence above attempt 0's; once it ran, ``until_expired`` keeps
    its hold for the 60 s period, ``until_executed`` leaves nothing."""
    assert started[1][1] > started[0][1]
    if mode == "until_expired":
        kept = parse_value(recorder.get(key))
        assert kept is not None and kept.kept, f"not kept: {recorder.get(key)!r}"
        assert parse_holder(kept.holder)["try"] == "1" and kept.fence == started[1][1]
        assert 0 < recorder.pttl(key) <= 60_000
    else:
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, {recorder.pttl(key)} ms"


@pytest.mark.parametrize("mode", ["until_expired", "until_executed"])
def test_a_soft_time_limit_right_after_a_retry_is_sent_does_not_swallow_the_retry(
    app: Celery, prefix: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """An attempt retries with the same arguments, and the soft time limit lands right after the
    retry's message was published, before the run recorded it (``send_continuation``; or the
    send raised after the broker took the message): the run lets go of its hold as after any
    run, unparked. until_expired keeps it for ``lock_period`` (owned by no token, its holder
    attempt 0's); until_executed releases it. The retry's message, its ticket's hold gone or
    kept by the attempt it continues, takes the lock over (until_expired: a fence above the kept
    one, the period then counted from its own run) or afresh, and runs: a task's own retry is
    never swallowed by its own lock. Every key has a TTL throughout; after the retry's run the
    lock is kept for its period (until_expired) or gone. Before, until_expired's retry waited
    ``lock_wait_timeout`` for a park that never comes (``busy.AdoptParked``), then failed with
    ``LockNotAcquired``."""
    started: list[tuple[int, int]] = []

    def retry_once(self: Any, x: int) -> None:
        started.append((self.request.retries, self.request.lock_fence))
        if self.request.retries == 0:
            raise self.retry(countdown=0)

    period = {"lock_period": 60} if mode == "until_expired" else {}
    task = define(app, f"retried_{mode}", retry_once, lock_mode=mode, lock_wait_timeout=2, **period)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    fired = interrupted_after_its_send(monkeypatch, task)

    with recorder_of(app) as recorder:
        try:
            # one pool thread: the retry runs once attempt 0's run is over and let go
            with Sampler(recorder, prefix), postruns(task) as done, threads_worker(app, concurrency=1):
                result = task.delay(x)
                the_retry_ran(recorder, key, task, result, done, started, fired, x)
            the_retry_holds_as_its_mode_says(recorder, key, started, mode)
        finally:
            recorder.delete(key)


@pytest.mark.parametrize("mode", ["until_expired", "until_executed"])
def test_a_retry_that_met_its_interrupted_attempt_still_running_runs_once_it_let_go(
    app: Celery, prefix: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """As above, the soft time limit lands right after the retry was sent, and the attempt goes
    on a while (its body catches what Celery's ``retry`` raises for it, ``Reject``, and waits).
    The retry arrives meanwhile, finds it running and waits for it to park the hold for it
    (``busy.AdoptParked``); the attempt then lets go unparked: until_expired keeps the hold for
    its period, which wakes no waiter. The test lets the wait end only once the attempt is over
    (as ``lock_wait_timeout`` would end it). The retry then takes the kept hold over (or the
    lock, free, afresh) and runs. Before, until_expired's failed with ``LockNotAcquired``."""
    started: list[tuple[int, int]] = []
    threads: list[int] = []  # attempt 0's
    gates = recorder_for(app)

    def retry_once(self: Any, x: int) -> None:
        started.append((self.request.retries, self.request.lock_fence))
        if self.request.retries == 0:
            threads.append(threading.get_ident())
            try:
                self.retry(countdown=0)
            except Reject:  # the interrupt, as Celery's retry raises it after a send that raised
                gates.wait_gate(x)
                raise

    period = {"lock_period": 60} if mode == "until_expired" else {}
    task = define(app, f"met_{mode}", retry_once, lock_mode=mode, lock_wait_timeout=60, **period)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    fired = interrupted_after_its_send(monkeypatch, task)

    wait_as, attempt_over = celery_redislock.primitive.LeaseLock.wait_as, threading.Event()
    waiting: list[str] = []

    def waits_for_the_attempt(self: Any, token: str, deadline: float, **kwargs: Any) -> Any:
        if waiting or self.name != key or threading.current_thread() is threading.main_thread():
            return wait_as(self, token, deadline, **kwargs)
        waiting.append(token)
        assert attempt_over.wait(RESULT_TIMEOUT), "attempt 0 did not end"
        return wait_as(self, token, 0.0, **kwargs)  # its deadline passed: one look, then given up

    monkeypatch.setattr(celery_redislock.primitive.LeaseLock, "wait_as", waits_for_the_attempt)
    with recorder_of(app) as recorder:
        try:
            with Sampler(recorder, prefix), postruns(task) as done, threads_worker(app, concurrency=2):
                result = task.delay(x)
                wait_for(lambda: waiting, what="the retry to wait for attempt 0")
                gates.open_gate(x)
                wait_for(  # over once its let-go ran: out of ``running``
                    lambda: done.count(result.id) == 1 and (threads[0], result.id) not in running,
                    what="attempt 0's end",
                )
                # The worker stores attempt 0's ``Reject`` as its result after the run, on the pool
                # thread: before the retry runs, so that the retry's result is the one left.
                meta = f"celery-task-meta-{result.id}"
                wait_for(
                    lambda: b'"FAILURE"' in (recorder.get(meta) or b""), what="attempt 0's result stored"
                )
                attempt_over.set()
                the_retry_ran(recorder, key, task, result, done, started, fired, x)
            the_retry_holds_as_its_mode_says(recorder, key, started, mode)
        finally:
            attempt_over.set()
            recorder.delete(key)


# -- a hold granted, not yet recorded ----------------------------------------------------------


def test_a_soft_time_limit_as_the_hold_is_recorded_leaves_no_lock_until_its_ttl(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soft time limit lands as ``acquire`` records the hold ACQUIRE just granted (the entry
    of ``take_hold``), when nothing else knows its token: ``acquire`` gives it back at once,
    rather than leaving the key held for its whole lease."""
    task = define(app, "taken", lock_ttl=20)
    key = task_lock_key(task, (4,))
    fired = interrupt_first_call(monkeypatch, celery_redislock.primitive.LeaseLock, "take_hold", key)
    with recorder_of(app) as recorder:
        run_interrupted(app, task, 4)
        assert fired == [1]
        assert not recorder.exists(key), f"left held for its lease: ttl {recorder.pttl(key)} ms"


def test_a_soft_time_limit_as_an_adopted_hold_is_recorded_leaves_no_lock_until_its_ttl(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed: ADOPT re-tokened the message's enqueue lock to a token of the run's own,
    and the soft time limit lands as ``adopt`` records it (the entry of ``take_hold``): that
    token is known to nothing else, so ``adopt`` gives the hold back at once, rather than
    leaving the key, and every ``delay()`` refused, for its whole lease."""
    task = define(app, "adopted", lock_mode="until_executed", lock_ttl=20)
    key = task_lock_key(task, (5,))
    fired = interrupt_first_call(monkeypatch, celery_redislock.primitive.LeaseLock, "take_hold", key)
    with recorder_of(app) as recorder:
        run_interrupted(app, task, 5)
        assert fired == [1]
        assert not recorder.exists(key), f"left held for its lease: ttl {recorder.pttl(key)} ms"


# -- a message dealt with frees its enqueue lock -----------------------------------------------


def test_a_soft_time_limit_while_waiting_for_the_lock_frees_the_messages_enqueue_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_and_while_executing with ``lock_busy="wait"`` (as every group or chord member): the
    run waits for the execution lock another run holds, and its soft time limit lands in that
    wait. The message is dealt with (FAILURE), so its enqueue lock (``...:queued``) goes: a
    later ``delay()`` is not refused as a duplicate of a task that is over."""
    task = define(
        app, "waiting", lock_mode="until_and_while_executing", lock_busy="wait", lock_wait_timeout=20
    )
    key = task_lock_key(task, (6,))
    queued = key + ":queued"
    fired = interrupt_first_call(monkeypatch, celery_redislock.lock.OneServer, "sleep", key)
    with recorder_of(app) as recorder:
        holder = RedisLock(recorder, key, ttl=30)  # another run holds the execution lock
        assert holder.acquire(blocking=False)
        try:
            run_interrupted(app, task, 6)
            assert fired == [1]
            assert not recorder.exists(queued), f"left: {recorder.get(queued)!r}, {recorder.pttl(queued)} ms"
        finally:
            holder.release()
            recorder.delete(queued)


def test_a_soft_time_limit_before_adopt_is_sent_frees_the_hold_queued_for_the_message(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed: the soft time limit lands before ``ADOPT`` is sent (the entry of
    ``adopt``). The message is dealt with (FAILURE) and nothing will adopt its hold any more: the
    hold still queued for it goes, owner-checked, rather than refusing every ``delay()`` as a
    duplicate for ``lock_queue_ttl``. (Once ``ADOPT`` is sent, ``adopt`` gives back what it
    re-tokened: ``test_a_soft_time_limit_as_an_adopted_hold_is_recorded_...``.)"""
    task = define(app, "adopt_interrupted", lock_mode="until_executed")
    key = task_lock_key(task, (8,))
    fired = interrupt_first_adopt(monkeypatch, celery_redislock.execution, key)
    with recorder_of(app) as recorder:
        try:
            run_interrupted(app, task, 8)
            assert fired == [1]
            assert not recorder.exists(key), f"left: {recorder.get(key)!r}, {recorder.pttl(key)} ms"
        finally:
            recorder.delete(key)


def test_a_soft_time_limit_before_a_retry_adopts_the_lock_of_its_other_arguments_frees_it(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_expired: attempt 0 retries with other arguments (another key), whose enqueue lock the
    retry's message takes afresh, and the soft time limit lands before the retry's ``ADOPT`` is
    sent (the entry of ``adopt``). No run ever held that key: it is freed, as a new call's
    message's is. Before, it was given up as a hold parked by a run (``DECLINE``) and kept for
    ``lock_period`` from the send. Attempt 0's key is kept for its period, as after any run."""
    retried_away = app.tasks["taskapp.moves_on"]
    x = uuid.uuid4().int % 10**9
    first_key, next_key = task_lock_key(retried_away, (x, 0)), task_lock_key(retried_away, (x, 1))
    fired = interrupt_first_adopt(monkeypatch, celery_redislock.execution, next_key)
    with recorder_of(app) as recorder:
        try:
            with postruns(retried_away) as done, threads_worker(app):
                result = retried_away.delay(x)
                with pytest.raises(SoftTimeLimitExceeded):
                    result.get(timeout=RESULT_TIMEOUT)
                wait_for(
                    lambda: done.count(result.id) == 2 and runs_over(retried_away.name), what="both runs' end"
                )
            assert fired == [1]
            assert 0 < recorder.pttl(first_key) <= 60_000, "attempt 0's key is not kept for its period"
            assert not recorder.exists(next_key), (
                f"left: {recorder.get(next_key)!r}, {recorder.pttl(next_key)} ms"
            )
        finally:
            recorder.delete(first_key, next_key)


def test_a_soft_time_limit_as_a_retry_adopts_the_hold_parked_for_it_frees_that_hold(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed: attempt 1 is published while attempt 0 still runs (``throw=False``), waits
    for attempt 0 to park the hold for it (``busy.AdoptParked``), is handed it, and the soft time
    limit lands as it adopts it (the entry of ``adopt``). Attempt 1 fails, and nothing will adopt
    that hold any more: it goes, rather than refusing every ``delay()`` for ``lock_queue_ttl``."""
    x, task = uuid.uuid4().hex[:10], app.tasks["taskapp.retry_once"]
    key = task_lock_key(task, (x,), {"how": "no_throw"})
    fired = interrupt_first_adopt(monkeypatch, celery_redislock.busy, key, "try=1")
    with recorder_of(app) as recorder:
        run_retry_handed_its_parked_hold(app, task, x)
        assert fired == [1]
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, {recorder.pttl(key)} ms"


def retrying_once_and_going_on(app: Celery, mode: str, **options: Any) -> Any:
    """A task of ``x`` whose first run retries (``retry(throw=False)``) and goes on until the
    gate of ``x`` opens; its retry, and any later run, return ``x`` at once."""
    gates = recorder_for(app)
    retried: list[str] = []

    def run(self: Any, x: int) -> None:
        if not retried:
            retried.append(self.request.id)
            self.retry(countdown=0, throw=False)
            gates.wait_gate(x)

    return define(app, f"retrying_{mode}", run, lock_mode=mode, **options)


@pytest.mark.parametrize(
    "mode",
    ["until_executed", pytest.param("until_expired", marks=pytest.mark.locks_may_remain("its lock_period"))],
)
def test_a_retry_that_gave_up_waiting_for_its_park_leaves_no_hold_behind(app: Celery, mode: str) -> None:
    """Attempt 1 is published while attempt 0 still runs (``throw=False``) and gives up waiting
    for attempt 0 to park the hold for it (``lock_wait_timeout``: ``LockNotAcquired``, attempt 1
    fails). When attempt 0 then ends, nothing will ever adopt a hold parked for attempt 1:
    until_executed's lock goes, rather than refusing every ``delay()`` of the signature for
    ``lock_queue_ttl``; until_expired's stays for what is left of ``lock_period`` after attempt
    0's acquisition (its body ran), and no longer. A hold freed so is announced
    (``lock_released``, for attempt 0, whose hold it was), as a release is; one kept is not."""
    period = {"lock_period": 600} if mode == "until_expired" else {}
    task = retrying_once_and_going_on(app, mode, lock_wait_timeout=0.2, **period)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    with (
        recorder_of(app) as recorder,
        signalled(task_failure, task, "exception") as failures,
        signalled(lock_released, task, "task_id") as released,
        postruns(task) as done,
        threads_worker(app),
    ):
        result = task.delay(x)
        wait_for(lambda: done.count(result.id) == 1, what="attempt 1 to give up waiting and fail")
        assert [type(failure) for failure in failures] == [LockNotAcquired]
        assert recorder.exists(key), "attempt 0 let go before attempt 1 gave up"
        recorder_for(app).open_gate(x)
        wait_for(lambda: done.count(result.id) == 2 and runs_over(task.name), what="attempt 0 to end")
        if mode == "until_executed":
            assert not recorder.exists(key), f"left: {recorder.get(key)!r}, {recorder.pttl(key)} ms"
            assert released == [result.id]  # before task_postrun, as a release's
            assert task.delay(x).get(timeout=30) == x  # free to run again
            assert not list(recorder.scan_iter(match=companion_key(key, "declined:*")))
        else:  # the mark lives as long as the hold, so that a resent PARK keeps it again
            assert 500_000 < recorder.pttl(key) <= 600_000, "not kept for the period's rest"
            assert released == []
            recorder.delete(key, *recorder.scan_iter(match=companion_key(key, "declined:*")))


@pytest.mark.locks_may_remain("its lock_period")
def test_a_soft_time_limit_as_a_retry_is_woken_by_its_park_keeps_the_until_expired_period(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_expired: attempt 1 is published while attempt 0 still runs (``throw=False``) and waits
    for attempt 0 to park the hold for it (``busy.AdoptParked``); attempt 0 parks it, and the
    soft time limit lands as attempt 1's wait reads the fence it was handed (right after
    ``Attempt.handed``, or ``Attempt.granted`` for an attempt sent after the park, returns it).
    Attempt 1 fails and will never adopt the hold: it is let go of as the mode says, kept for
    what is left of ``lock_period`` after attempt 0's acquisition (before: the interrupted wait
    released it as a hold granted to its token, and the lock was free within the period)."""
    task = retrying_once_and_going_on(app, "until_expired", lock_period=600)
    x = uuid.uuid4().int % 10**9
    key, attempt_1, fired = task_lock_key(task, (x,)), list[str](), list[int]()

    def interrupted_once_handed(read: Callable[[Any, Any], int | None]) -> Callable[[Any, Any], int | None]:
        def reading(attempt: Any, reply: Any) -> int | None:
            fence = read(attempt, reply)
            if fence is not None and not fired and attempt_1 and attempt_1[0] in attempt.member:
                fired.append(1)
                raise SoftTimeLimitExceeded()
            return fence

        return reading

    for name in ("granted", "handed"):
        monkeypatch.setattr(Attempt, name, interrupted_once_handed(getattr(Attempt, name)))
    with recorder_of(app) as recorder, postruns(task) as done, threads_worker(app):
        try:
            result = task.delay(x)
            attempt_1.append(f"task={result.id} try=1 ")
            wait_for(lambda: recorder.zcard(companion_key(key, "queue")) == 1, what="attempt 1 to wait")
            recorder_for(app).open_gate(x)
            wait_for(lambda: done.count(result.id) == 2 and runs_over(task.name), what="both attempts' end")
            assert fired == [1]
            kept = parse_value(recorder.get(key))
            assert kept is not None and kept.kept, f"left: {recorder.get(key)!r}"
            assert 500_000 < recorder.pttl(key) <= 600_000, "not kept for the period's rest"
            assert not list(recorder.scan_iter(match=companion_key(key, "*")))
        finally:
            recorder.delete(key, *recorder.scan_iter(match=companion_key(key, "*")))


def test_a_revoked_retry_leaves_no_hold_behind(app: Celery) -> None:
    """until_executed: the task is revoked while attempt 0 runs, before attempt 0 sends its retry
    (``throw=False``) and goes on; the worker drops attempt 1 as it arrives (``task_revoked``).
    When attempt 0 then ends, nothing will adopt a hold parked for attempt 1: the lock goes."""
    gates = recorder_for(app)
    started: list[str] = []

    def run(self: Any, x: int) -> None:
        if not started:
            started.append(self.request.id)
            gates.wait_gate(f"{x}-retry")
            self.retry(countdown=0, throw=False)
            gates.wait_gate(x)

    task = define(app, "revoked_retry", run, lock_mode="until_executed")
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    with (
        recorder_of(app) as recorder,
        signalled(task_revoked, task, "request") as revoked,
        postruns(task) as done,
        threads_worker(app),
    ):
        result = task.delay(x)
        wait_for(lambda: started, what="attempt 0 to start")
        assert app.control.revoke(result.id, reply=True, limit=1, timeout=10), "the worker did not answer"
        gates.open_gate(f"{x}-retry")
        wait_for(lambda: [dropped.id for dropped in revoked] == [result.id], what="attempt 1 dropped")
        gates.open_gate(x)
        wait_for(lambda: done.count(result.id) == 1 and runs_over(task.name), what="attempt 0 to end")
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, {recorder.pttl(key)} ms"


def test_a_refused_first_attempt_leaves_no_declined_mark(app: Celery) -> None:
    """until_executed, ``lock_busy="raise"``: the run finds its message's hold taken by another
    (here a hold written over it) and fails with ``LockNotAcquired``. Only a retry's token can
    still be parked for, so a first attempt marks nothing (no ``declined:`` key for an hour per
    refusal), and the other's hold is left alone."""
    task = define(app, "refused_first", lock_mode="until_executed", lock_busy="raise")
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    with recorder_of(app) as recorder:
        result = task.delay(x)
        other = "c" * 32 + ":1:task=other try=0 state=running"
        recorder.set(key, other, px=60_000)
        try:
            with threads_worker(app), pytest.raises(LockNotAcquired):
                result.get(timeout=30)
            assert recorder.get(key) == other.encode()
            assert list(recorder.scan_iter(match=companion_key(key, "declined:*"))) == []
        finally:
            recorder.delete(key)


def test_a_retry_handed_a_hold_that_is_gone_by_its_adopt_takes_the_lock_afresh(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executed: attempt 1 waited for attempt 0 to park the hold for it and was handed it,
    and by the time its ``ADOPT`` runs the hold is gone (a copy of its message that gave it up
    freed it, as the test above frees it). Attempt 1 takes the lock afresh and runs, rather
    than failing with ``LockNotAcquired`` over a free lock."""
    x, task = uuid.uuid4().hex[:10], app.tasks["taskapp.retry_once"]
    key = task_lock_key(task, (x,), {"how": "no_throw"})
    adopt = celery_redislock.run_lock.adopt
    gone: list[int] = []

    def freed_first(lock: Any, token: str) -> Any:
        if not gone and lock.name == key and "try=1" in (lock.holder or ""):
            gone.append(int(lock.client.delete(key)))
        return adopt(lock, token)

    monkeypatch.setattr(celery_redislock.busy, "adopt", freed_first)
    with recorder_of(app) as recorder:
        run_retry_handed_its_parked_hold(app, task, x)
        assert gone == [1]
        assert [event[6] for event in events(app, "end", x)] == ["0", "1"], "attempt 1 did not run"
        assert not recorder.exists(key)


def test_a_failed_republish_of_a_busy_retry_frees_the_messages_enqueue_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_and_while_executing with ``lock_busy="retry"``: the run finds the execution lock held
    and republishes its message, and the broker refuses it. Nothing will run the message any
    more (FAILURE), so its enqueue lock, renewed for the republish, goes."""
    task = define(app, "republished", lock_mode="until_and_while_executing", lock_busy="retry")
    key = task_lock_key(task, (7,))
    queued = key + ":queued"
    apply_async = Signature.apply_async

    def refused(self: Signature, *args: Any, **kwargs: Any) -> Any:
        if self.task == task.name:
            raise OperationalError("the broker refused the republish")
        return apply_async(self, *args, **kwargs)

    monkeypatch.setattr(Signature, "apply_async", refused)
    with recorder_of(app) as recorder:
        holder = RedisLock(recorder, key, ttl=30)
        assert holder.acquire(blocking=False)
        try:
            with postruns(task) as done, threads_worker(app, concurrency=1):
                result = task.delay(7)
                wait_for(lambda: result.id in done and runs_over(task.name, result.id), what="its end")
            assert result.state == "FAILURE"
            assert not recorder.exists(queued), f"left: {recorder.get(queued)!r}, {recorder.pttl(queued)} ms"
        finally:
            holder.release()
            recorder.delete(queued)


@dataclass
class Waiting:
    """A group member of ``taskapp.until_and_while_executing`` (``x``), sent with
    ``lock_in_canvas=True`` (so it has an enqueue lock, ``queued``), waiting in a prefork
    subprocess ``worker`` for the execution lock another hold (``holder``) has."""

    worker: WorkerProcess
    task: Any
    x: str
    queued: str
    recorder: redis.Redis
    holder: RedisLock
    member: Any

    def waits_again(self, app: Celery, what: str) -> None:
        """Delivered again (requeued, or retried), the member waits in another child, with its
        enqueue lock: a ``delay()`` meanwhile is its duplicate."""
        wait_for(
            lambda: len(events(app, "busy", self.x)) >= 2, what=lambda: f"{what}:\n{self.worker.output()}"
        )
        assert self.recorder.exists(self.queued), (
            f"its enqueue lock was freed; the worker:\n{self.worker.output()}"
        )
        assert self.task.delay(self.x, gate=True).id == self.member.id, "a duplicate was sent beside it"

    def next_call_runs(self, app: Celery) -> None:
        """Once the member is over and the other hold gone, the next ``delay()`` is sent and runs."""
        self.holder.release()
        recorder_for(app).open_gate(self.x)
        again = self.task.delay(self.x, gate=True)
        assert again.id != self.member.id
        assert again.get(timeout=RESULT_TIMEOUT) == self.x


@contextmanager
def member_waiting(
    app: Celery, redis_server: RedisServer, prefix: str, conf: dict[str, Any], **options: Any
) -> Iterator[Waiting]:
    """``Waiting``, on a worker with settings ``conf``, the member sent with ``options`` too; once
    its first wait began (its enqueue lock held). Everything stopped and freed at the end."""
    worker = WorkerProcess(redis_server.url, prefix, f"q-{prefix}", "prefork", 2, "prefork", json.dumps(conf))
    worker.start()
    task: Any = app.tasks["taskapp.until_and_while_executing"]
    x = uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    with recorder_of(app) as recorder:
        holder = RedisLock(recorder, key, ttl=120)  # another run's hold: the member waits for it
        try:
            wait_for(lambda: recorder.llen(f"{prefix}:ready"), what=lambda: f"the worker:\n{worker.output()}")
            assert holder.acquire(blocking=False)
            member = task.apply_async(
                (x,), {"gate": True}, group_id=uuid.uuid4().hex, lock_in_canvas=True, **options
            )
            wait_for(lambda: events(app, "busy", x), what="the member to wait")
            assert recorder.exists(key + ":queued")
            yield Waiting(worker, task, x, key + ":queued", recorder, holder, member)
        finally:
            recorder_for(app).open_gate(x)
            if holder.held():
                holder.release()
            worker.stop()
            recorder.delete(key + ":queued")


@pytest.mark.locks_may_remain("the wake message the release sent the killed waiter, until its ttl")
@pytest.mark.parametrize("requeued", [False, True], ids=["acked", "requeued"])
def test_a_pool_child_killed_while_waiting_frees_its_messages_enqueue_lock_unless_requeued(
    app: Celery, redis_server: RedisServer, prefix: str, requeued: bool
) -> None:
    """until_and_while_executing, a group member (it waits for a busy execution lock) sent with
    ``lock_in_canvas=True``, so that it has an enqueue lock: its pool child is killed while it
    waits. The worker's main process frees the message's enqueue lock with the child's
    execution lock (owner-checked), so the next ``delay()`` is sent, not refused as a
    duplicate of the dead message; unless Celery requeues the message (``task_acks_late`` with
    ``task_reject_on_worker_lost``: ``Request.on_failure`` rejects it with requeue), which is
    delivered and waits again with its enqueue lock, a ``delay()`` meanwhile its duplicate."""
    conf = {"task_acks_late": True, "task_reject_on_worker_lost": True} if requeued else {}
    with member_waiting(app, redis_server, prefix, conf) as waiting:
        [busy] = events(app, "busy", waiting.x)
        os.kill(int(busy[4]), signal.SIGKILL)  # the pid of the child it waits in
        if requeued:
            waiting.waits_again(app, "the requeued member to wait again")
            return
        wait_for(
            lambda: not waiting.recorder.exists(waiting.queued),
            what="the main process to free the enqueue lock",
        )
        waiting.member.get(timeout=RESULT_TIMEOUT, propagate=False)
        assert waiting.member.state == "FAILURE"
        waiting.next_call_runs(app)


@pytest.mark.locks_may_remain("the wake message the release sent the stopped waiter, until its ttl")
def test_a_waiter_past_its_hard_time_limit_keeps_its_requeued_messages_enqueue_lock(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    """until_and_while_executing, ``task_acks_late``: a group member sent with
    ``lock_in_canvas=True`` (it has an enqueue lock) waits for a busy execution lock past its hard
    time limit. Celery requeues its message (a time limit without ``acks_on_timeout``), then the
    pool stops the child with SIGTERM, which raises ``SystemExit`` in the wait. The child is
    exiting, not failing the message: the requeued message keeps its enqueue lock, and a
    ``delay()`` meanwhile is its duplicate, not a second message queued beside it."""
    conf = {"task_acks_late": True, "task_acks_on_failure_or_timeout": False}
    with member_waiting(app, redis_server, prefix, conf, time_limit=2) as waiting:
        waiting.waits_again(app, "the requeued member to wait again")  # after its time limit
        assert "TimeLimitExceeded" in waiting.worker.output()


@pytest.mark.locks_may_remain("the wake message the release sent the killed waiter, until its ttl")
@pytest.mark.parametrize("end", ["retried", "out_of_retries", "revoked"])
def test_with_retry_on_worker_lost_a_dead_waiter_frees_its_enqueue_lock_unless_a_retry_carries_it(
    app: Celery, redis_server: RedisServer, prefix: str, end: str
) -> None:
    """``task_retry_on_worker_lost`` (Celery 5.7): a lost pool child's task is retried, its retry
    carrying the message's enqueue lock; but not past ``max_retries``, nor after a
    ``revoke(terminate=True)`` (``Terminated``, not a lost worker). until_and_while_executing, a
    group member sent with ``lock_in_canvas=True`` (it has an enqueue lock) waits for a busy
    execution lock, and its pool child dies (SIGKILL, or revoked with SIGKILL). Retried: the
    retry waits again with the enqueue lock, and a ``delay()`` meanwhile is its duplicate. Not
    retried: the message is acknowledged and nothing will run it, so the worker's main process
    frees the enqueue lock, rather than refuse every ``delay()`` for ``lock_queue_ttl``."""
    annotations = {"max_retries": 0} if end == "out_of_retries" else {"default_retry_delay": 0}
    conf = {
        "task_retry_on_worker_lost": True,
        "task_annotations": {"taskapp.until_and_while_executing": annotations},
    }
    with member_waiting(app, redis_server, prefix, conf) as waiting:
        if end == "revoked":
            waiting.member.revoke(terminate=True, signal="SIGKILL")
        else:
            [busy] = events(app, "busy", waiting.x)
            os.kill(int(busy[4]), signal.SIGKILL)  # the pid of the child it waits in
        if end == "retried":
            waiting.waits_again(app, "the retry to wait")
            assert events(app, "busy", waiting.x)[1][6] == "1", "not the retry"
            return
        wait_for(
            lambda: not waiting.recorder.exists(waiting.queued),
            timeout=20,
            what=lambda: f"the main process to free the enqueue lock; the worker:\n{waiting.worker.output()}",
        )
        wait_for(lambda: waiting.member.state in ("FAILURE", "REVOKED"), what="the member's end")
        waiting.next_call_runs(app)


def hold_of(recorder: redis.Redis, key: str) -> dict[str, str]:
    """The holder fields of the lock ``key`` (empty: free)."""
    value = parse_value(recorder.get(key))
    return {} if value is None else parse_holder(value.holder)


@pytest.mark.parametrize("sent", ["delay", "send_task"])
@pytest.mark.parametrize(
    "mode",
    ["until_executed", pytest.param("until_expired", marks=pytest.mark.locks_may_remain("its lock_period"))],
)
def test_with_retry_on_worker_lost_a_dead_runs_hold_is_kept_for_its_retry(
    app: Celery, redis_server: RedisServer, prefix: str, mode: str, sent: str
) -> None:
    """``task_retry_on_worker_lost`` (Celery 5.7), a mode that keeps its lock across a task's
    retries (until_executed, until_expired): the pool child running the body is killed, and the
    worker's main process sends the retry (``Request._retry_worker_lost``, countdown
    ``default_retry_delay``). The dead run's hold is parked for the retry, as ``self.retry()``
    parks it: while the retry waits, a ``delay()`` is its duplicate, not a second run beside it;
    the retry runs the body once more, and its end lets go of the lock as any run's does. Also
    for a message sent without an enqueue lock (``send_task``): the retry is sent, never refused
    as a duplicate of the dead run's own hold (nothing sent, the task never run again)."""
    conf = {
        "task_retry_on_worker_lost": True,
        "task_annotations": {f"taskapp.{mode}": {"default_retry_delay": 2}},
    }
    worker = WorkerProcess(redis_server.url, prefix, f"q-{prefix}", "prefork", 2, "prefork", json.dumps(conf))
    worker.start()
    task: Any = app.tasks[f"taskapp.{mode}"]
    x = uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    with recorder_of(app) as recorder:
        try:
            wait_for(lambda: recorder.llen(f"{prefix}:ready"), what=lambda: f"the worker:\n{worker.output()}")
            if sent == "delay":
                result = task.delay(x, gate=True)
            else:
                result = app.send_task(task.name, (x,), {"gate": True})
            [start] = wait_for(lambda: events(app, "start", x), what="the body to start")
            os.kill(int(start[4]), signal.SIGKILL)  # the pid of the child the body runs in
            wait_for(  # the retry sent (RETRY is stored after it), the dead run's hold dealt with
                lambda: result.state == "RETRY" and hold_of(recorder, key).get("state") != "running",
                what=lambda: f"Celery's retry:\n{worker.output()}",
            )
            assert task.delay(x, gate=True).id == result.id, (
                f"a duplicate was sent beside the pending retry; the worker:\n{worker.output()}"
            )
            held = hold_of(recorder, key)
            assert (held.get("task"), held.get("try"), held.get("state")) == (result.id, "1", "queued")
            wait_for(
                lambda: len(events(app, "start", x)) >= 2,
                what=lambda: f"the retry to run:\n{worker.output()}",
            )
            recorder_for(app).open_gate(x)
            assert result.get(timeout=RESULT_TIMEOUT) == x
            assert [(event[3], event[6]) for event in events(app, "start", x)] == [
                (result.id, "0"),
                (result.id, "1"),
            ]
            if mode == "until_expired":  # kept for its period (600 s) after the retry's run, not its lease
                wait_for(lambda: recorder.pttl(key) > 60_000, what=lambda: f"the period:\n{worker.output()}")
                assert hold_of(recorder, key).get("try") == "1"
            else:
                wait_for(lambda: not recorder.exists(key), what=lambda: f"the release:\n{worker.output()}")
        finally:
            recorder_for(app).open_gate(x)
            worker.stop()


def faulty_lost_retry_worker(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch, fault: str, conf: dict[str, Any]
) -> WorkerProcess:
    """A started prefork worker (settings ``conf``) whose main process fails as ``fault`` says
    (``tests/lost_retry_app.py``) as it handles Celery's retry of a lost pool child's task."""
    monkeypatch.setenv("LOST_RETRY_FAULT", fault)
    worker = WorkerProcess(
        redis_server.url,
        prefix,
        f"q-{prefix}",
        "prefork",
        2,
        "prefork",
        json.dumps(conf),
        app="tests.lost_retry_app",
    )
    worker.start()
    return worker


def test_a_worker_interrupted_after_parking_a_lost_runs_hold_for_its_unsent_retry_frees_it(
    app: Celery, redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task_retry_on_worker_lost``, until_executed: the pool child running the body is killed,
    and the worker's main process parks the dead run's hold for the retry it is about to send,
    when a hard shutdown's ``WorkerTerminate`` lands (``tests/lost_retry_app.py``: right after
    ``PARK``'s reply was read), so that the retry is never sent. The hold, parked for a token no
    message carries, is given back as the exception goes by: not left to refuse every
    ``delay()`` of its arguments for ``lock_queue_ttl``."""
    conf = {
        "task_retry_on_worker_lost": True,
        "task_annotations": {"taskapp.until_executed": {"default_retry_delay": 2}},
    }
    worker = faulty_lost_retry_worker(redis_server, prefix, monkeypatch, "interrupted-after-park", conf)
    task: Any = app.tasks["taskapp.until_executed"]
    x = uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    with recorder_of(app) as recorder:
        try:
            wait_for(lambda: recorder.llen(f"{prefix}:ready"), what=lambda: f"the worker:\n{worker.output()}")
            result = task.delay(x, gate=True)
            [start] = wait_for(lambda: events(app, "start", x), what="the body to start")
            os.kill(int(start[4]), signal.SIGKILL)  # the pid of the child the body runs in
            wait_for(lambda: not worker.alive(), what=lambda: f"the worker to exit:\n{worker.output()}")
            assert recorder.lrange(f"{prefix}:parked", 0, -1) == [b"1"], worker.output()  # PARK parked it
            assert hold_of(recorder, key) == {}, (
                f"the hold parked for the unsent retry was left, PTTL {recorder.pttl(key)} ms; "
                f"the worker:\n{worker.output()}"
            )
            assert task.delay(x, gate=True).id != result.id, "refused as a duplicate of the unsent retry"
        finally:
            recorder_for(app).open_gate(x)
            worker.stop()
            recorder.delete(f"q-{prefix}", key)


def test_a_retry_sent_after_a_lost_pool_child_keeps_its_enqueue_lock_when_on_retry_raises(
    app: Celery, redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task_retry_on_worker_lost``, until_executing: the pool child is killed while the run is
    held up before its body (``before_start``), its message's enqueue lock not freed yet. Celery's
    main process sends the retry, which carries that enqueue lock, then calls the task's
    ``on_retry``, which raises (``tests/lost_retry_app.py``). The retry was sent all the same:
    its enqueue lock is not freed as a dead message's, and a ``delay()`` meanwhile is its
    duplicate, not a second message queued beside it."""
    conf = {
        "task_retry_on_worker_lost": True,
        "task_annotations": {"taskapp.slow_start": {"default_retry_delay": 0}},
    }
    worker = faulty_lost_retry_worker(redis_server, prefix, monkeypatch, "on-retry-raises", conf)
    task: Any = app.tasks["taskapp.slow_start"]
    x = uuid.uuid4().hex[:10]
    queued = task_lock_key(task, (x,))
    with recorder_of(app) as recorder:
        try:
            wait_for(lambda: recorder.llen(f"{prefix}:ready"), what=lambda: f"the worker:\n{worker.output()}")
            result = task.delay(x)
            [before] = wait_for(lambda: events(app, "before", x), what="the run to be held up")
            os.kill(int(before[4]), signal.SIGKILL)  # the pid of the child it is held up in
            wait_for(  # the retry held up in turn (retries 1), its on_retry raised before
                lambda: [event for event in events(app, "before", x) if event[6] == "1"],
                what=lambda: f"the retry to run:\n{worker.output()}",
            )
            assert "on_retry failed" in worker.output()
            assert recorder.exists(queued), f"the retry's enqueue lock was freed:\n{worker.output()}"
            assert task.delay(x).id == result.id, "a duplicate was sent beside the retry"
        finally:
            recorder_for(app).open_gate(x, times=2)
            worker.stop()
            recorder.delete(f"q-{prefix}", queued)


def test_a_retry_whose_pool_child_dies_while_it_waits_leaves_no_hold_behind(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    """until_executed, prefork: attempt 1 is published while attempt 0 still runs (``throw=False``)
    and waits for attempt 0's park in the other pool child, which is killed. The worker's main
    process gives the retry's hold up before attempt 0 parks it (its token is marked declined),
    and when attempt 0 ends its park frees the hold rather than parking it for no one."""
    worker = WorkerProcess(redis_server.url, prefix, f"q-{prefix}", "prefork", 2, "prefork")
    worker.start()
    task: Any = app.tasks["taskapp.retry_once"]
    x = uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"how": "no_throw"})
    declined = companion_key(key, "declined:*")
    with recorder_of(app) as recorder:
        try:
            wait_for(lambda: recorder.llen(f"{prefix}:ready"), what=lambda: f"the worker:\n{worker.output()}")
            result = task.delay(x, how="no_throw")
            [busy] = wait_for(lambda: events(app, "busy", x), what="attempt 1 to wait for attempt 0")
            os.kill(int(busy[4]), signal.SIGKILL)  # the pid of the child attempt 1 waits in
            wait_for(  # attempt 0 still runs: not parked yet (a parked hold was freed before too)
                lambda: list(recorder.scan_iter(match=declined)),
                what=lambda: f"the main process to decline the retry's hold:\n{worker.output()}",
            )
            recorder_for(app).open_gate(x)
            wait_for(lambda: events(app, "end", x), what="attempt 0 to end")
            wait_for(lambda: not recorder.exists(key), what=lambda: f"the hold to go: {recorder.get(key)!r}")
            assert not list(recorder.scan_iter(match=declined))
            result.get(timeout=RESULT_TIMEOUT, propagate=False)
            output = worker.output()  # the child's death declined it, not a wait that timed out
            assert "WorkerLostError" in output and "LockNotAcquired" not in output, output
        finally:
            recorder_for(app).open_gate(x)
            worker.stop()


# -- a release whose outcome is unknown --------------------------------------------------------


def test_a_soft_time_limit_after_a_synchronous_release_ran_is_not_reported_as_a_loss(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that releases before returning (``lock_on_lost="raise"``) is interrupted just after
    its RELEASE freed the key, before ``release()`` forgot the hold. ``task_postrun`` releases
    it again and finds the key gone: that is the interrupted release's doing (its outcome was
    unknown), not a loss to report ("no longer held", ``lost``, the lost metric)."""
    task = define(app, "released", lock_on_lost="raise")
    key = task_lock_key(task, (8,))
    free = celery_redislock.lock.OneServer.free
    fired: list[int] = []

    def freed_then_interrupted(self: Any, token: str) -> bool:
        freed = free(self, token)
        if not fired and self.name == key:
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return freed

    monkeypatch.setattr(celery_redislock.lock.OneServer, "free", freed_then_interrupted)
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    package = logging.getLogger("celery_redislock")
    handler, level = Collect(logging.WARNING), package.level
    package.addHandler(handler)
    package.setLevel(logging.WARNING)
    try:
        run_interrupted(app, task, 8)
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
    assert fired == [1]
    assert not [w for w in warnings if "no longer held" in w], warnings


@pytest.mark.locks_may_remain("the republished message's enqueue lock, deleted at the end")
def test_a_soft_time_limit_after_a_busy_retry_republished_keeps_its_enqueue_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_and_while_executing, ``lock_busy="retry"``: the run finds the execution lock held,
    renews its enqueue lock and republishes the message (same ticket), and a soft time limit
    lands once the republish returned, as the ``Retry`` is made (a function's entry, where
    CPython runs signal handlers). The message is queued again, so its enqueue lock stays (a run
    failing before its body frees it otherwise), and a ``delay()`` meanwhile is its duplicate,
    not sent. (A republish that raises may or may not have reached the broker: as a failed
    send at enqueue, the lock is freed then: ``test_a_failed_republish_...``.)"""
    task = define(
        app,
        "republished-then-interrupted",
        lock_mode="until_and_while_executing",
        lock_busy="retry",
        lock_retry_delay=120,
    )
    key = task_lock_key(task, (9,))
    queued = key + ":queued"
    fired: list[int] = []

    def interrupted_as_made(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return Retry(*args, **kwargs)

    monkeypatch.setattr(celery_redislock.busy, "Retry", interrupted_as_made)
    with recorder_of(app) as recorder:
        holder = RedisLock(recorder, key, ttl=30)  # another run holds the execution lock
        assert holder.acquire(blocking=False)
        try:
            with postruns(task) as done, threads_worker(app, concurrency=1):
                result = task.delay(9)
                wait_for(lambda: result.id in done and runs_over(task.name, result.id), what="its end")
                assert fired == [1]
                # the republished message (countdown 60-180 s) is waiting: its lock stays
                assert recorder.exists(queued), "the enqueue lock of a republished, queued message was freed"
                again = task.delay(9)
                assert again.id == result.id, "a duplicate was sent beside the queued message"
        finally:
            holder.release()
            recorder.delete(queued)


@pytest.mark.parametrize(
    ("owner", "name", "where"),
    [
        (celery_redislock.lock.RedisLock, "_free", "as it releases (nothing sent)"),
        (celery_redislock.execution.Execution, "keep", "as it lets go, before the release"),
    ],
)
def test_a_direct_call_inside_a_run_interrupted_as_it_lets_go_leaves_no_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch, owner: type, name: str, where: str
) -> None:
    """A worker's run calls a ``LockedTask`` directly (``inner(x)``): a soft time limit lands
    in the inner call {where}. A worker run interrupted there is let go by ``task_postrun``
    (``Execution.finish``); a direct call has no run of its own there, so its ``__call__`` lets
    go of what the interrupt left, before the outer run ends: the lock is neither left for its
    lease nor renewed on."""
    inner = define(app, f"direct_inner_{name}", lock_ttl=30)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(inner, (x,))
    outer = define(app, f"direct_outer_{name}", lambda self, x: inner(x), lock_on=lambda x: "outer")
    fired = interrupt_first_call(monkeypatch, owner, name, key)
    with recorder_of(app) as recorder:
        run_interrupted(app, outer, x)
        assert fired == [1]
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, PTTL {recorder.pttl(key)} ms"


def test_a_direct_call_inside_a_run_interrupted_as_it_took_its_lock_leaves_no_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the soft time limit landing right after the inner call took its lock (as it
    announces the hold: ``lock_acquired``), before its body: let go of by its ``__call__``."""
    inner = define(app, "direct_inner_taken", lock_ttl=30)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(inner, (x,))
    outer = define(app, "direct_outer_taken", lambda self, x: inner(x), lock_on=lambda x: "outer")
    acquired = celery_redislock.run_lock.acquired  # as execution imported it
    fired: list[int] = []

    def interrupted(task: Any, lock: Any, *args: Any) -> bool:
        if not fired and lock.name == key:
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return acquired(task, lock, *args)

    monkeypatch.setattr(celery_redislock.execution, "acquired", interrupted)
    with recorder_of(app) as recorder:
        run_interrupted(app, outer, x)
        assert fired == [1]
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, PTTL {recorder.pttl(key)} ms"


def interrupted_as_set(monkeypatch: pytest.MonkeyPatch, name: str, when: Callable[[Any], bool]) -> list[int]:
    """Make the first ``set`` of ``task.<name>`` (a ``ContextVar``) to a value ``when`` accepts, on
    a worker's thread, set it and then raise ``SoftTimeLimitExceeded``, as a signal handler does
    that lands right after the call returns; the returned list gets an item when it did."""
    real = getattr(celery_redislock.task, name)
    fired: list[int] = []

    class Interrupted:
        def get(self) -> Any:
            return real.get()

        def set(self, value: Any) -> Any:
            token = real.set(value)
            if not fired and when(value) and threading.current_thread() is not threading.main_thread():
                fired.append(1)
                raise SoftTimeLimitExceeded()
            return token

        def reset(self, token: Any) -> None:
            real.reset(token)

    monkeypatch.setattr(celery_redislock.task, name, Interrupted())
    return fired


def held_locks_interrupted(monkeypatch: pytest.MonkeyPatch, key: str) -> list[int]:
    """``interrupted_as_set`` of ``_held_locks`` (the keys held in a thread), set to name ``key``."""
    return interrupted_as_set(monkeypatch, "_held_locks", lambda value: key in value)


def test_a_direct_call_inside_a_run_interrupted_as_it_records_its_hold_leaves_no_lock(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the soft time limit landing right after the inner call, its lock taken, recorded
    its hold as the thread's (``task._held_locks``), before its body: let go of by its
    ``__call__`` all the same, not held on and renewed by the watchdog."""
    inner = define(app, "direct_inner_recorded", lock_ttl=30)
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(inner, (x,))
    outer = define(app, "direct_outer_recorded", lambda self, x: inner(x), lock_on=lambda x: "outer")
    fired = held_locks_interrupted(monkeypatch, key)
    with recorder_of(app) as recorder:
        run_interrupted(app, outer, x)
        assert fired == [1]
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, PTTL {recorder.pttl(key)} ms"


def test_a_soft_time_limit_as_a_run_records_its_hold_leaves_the_next_run_in_the_thread_locked(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same landing point in a worker's run: the run fails, its lock let go of as the trace
    ends, and the thread holds nothing of it after. The next run of the key on that thread (one
    worker thread) takes the lock (a fence in its request), rather than run its body under the
    hold of a run that is over, unlocked."""
    fences: list[object] = []
    task = define(
        app, "held_recorded", lambda self, x: fences.append(getattr(self.request, "lock_fence", "none"))
    )
    x = uuid.uuid4().int % 10**9
    key = task_lock_key(task, (x,))
    fired = held_locks_interrupted(monkeypatch, key)
    with recorder_of(app) as recorder, postruns(task) as done, threads_worker(app, concurrency=1):
        first = task.delay(x)
        with pytest.raises(SoftTimeLimitExceeded):
            first.get(timeout=RESULT_TIMEOUT)
        wait_for(lambda: first.id in done and runs_over(task.name, first.id), what="the first run's end")
        assert fired == [1]
        assert not recorder.exists(key), f"left: {recorder.get(key)!r}, PTTL {recorder.pttl(key)} ms"
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
    assert len(fences) == 1 and isinstance(fences[0], int), f"the next run's lock_fence: {fences}"


def test_a_direct_call_interrupted_as_it_hands_its_request_its_fields_leaves_them_to_no_later_call(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's run calls a ``LockedTask`` directly (``inner(x, 0)``): a soft time limit lands
    right after the inner call set the lock fields its own request is to get
    (``task._pending_request``), before that request is pushed. Nothing of them is left in the
    thread (one worker thread): a later run of ``inner`` calling itself with the same key, under
    its own hold, hands that call its own fence, not the interrupted call's."""
    fences: list[tuple[int, object]] = []

    def body(self: Any, x: int, depth: int) -> None:
        fences.append((depth, getattr(self.request, "lock_fence", None)))
        if depth:
            inner(x, depth - 1)

    inner = app.task(
        base=LockedTask, bind=True, shared=False, name="interrupted.pending_inner", lock_on=("x",)
    )(body)
    outer = define(app, "pending_outer", lambda self, x: inner(x, 0), lock_on=lambda x: "outer")
    x, y = (uuid.uuid4().int % 10**9 for _ in range(2))
    fired = interrupted_as_set(monkeypatch, "_pending_request", lambda value: value is not None)
    with threads_worker(app, concurrency=1):
        interrupted = outer.delay(x)
        with pytest.raises(SoftTimeLimitExceeded):
            interrupted.get(timeout=RESULT_TIMEOUT)
        assert fired == [1]
        inner.delay(y, 1).get(timeout=RESULT_TIMEOUT)
    [(_, fence)] = [entry for entry in fences if entry[0] == 1]
    assert isinstance(fence, int) and fences[-1] == (0, fence), f"the fences the calls saw: {fences}"


@contextmanager
def lost_before_the_body(app: Celery, task: Any) -> Iterator[list[str]]:
    """For the block, a ``lock_acquired`` receiver deletes the lock each run of ``task`` just took
    and waits until the watchdog finds the loss (``lock.lost``), all before the body starts: as a
    lease that runs out while the run frees its enqueue lock against a slow Redis, or while a
    ``lock_acquired`` receiver runs. The list gets ``"lost"`` for each loss so found."""
    client = redis.Redis.from_url(app.conf.redislock_url)
    seen: list[str] = []

    def receiver(sender: Any = None, key: str = "", task_id: str | None = None, **_: Any) -> None:
        if sender is not None and sender.name == task.name and task_id is not None:
            client.delete(key)
            run: Any = running[threading.get_ident(), task_id]  # an Execution
            lock = run.lock
            seen.append(wait_for(lambda: lock.lost.is_set() and "lost", 10, "the watchdog to find the loss"))

    lock_acquired.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        lock_acquired.disconnect(receiver)
        client.close()


def test_a_loss_found_before_the_body_starts_is_marked_in_the_request(app: Celery) -> None:
    """``lock_on_lost="log"``: the watchdog finds the lock lost after the acquire, before the body
    starts. The body's ``self.request.lock_lost`` says so, as ``check_lock()`` does (the loss is
    reported once, and the run's fields written into the request must not reset it)."""
    observed: list[tuple[bool, bool]] = []

    def body(self: Any, x: int) -> None:
        try:
            self.check_lock()
        except LockLost:
            observed.append((bool(self.request.lock_lost), True))
        else:
            observed.append((bool(self.request.lock_lost), False))

    task = define(app, "lost_before_body", body, lock_ttl=0.6)
    with lost_before_the_body(app, task) as seen, threads_worker(app, concurrency=1):
        assert task.delay(1).get(timeout=RESULT_TIMEOUT) == 1
    assert seen == ["lost"]
    assert observed == [(True, True)]


def test_terminate_stops_a_child_whose_lock_was_lost_before_its_body_started(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lock_on_lost="terminate"`` in a prefork pool child (as this process is made to look:
    ``pool_child``, ``os.kill`` recorded): the loss is found between the acquire and the body's
    start, while no body runs to stop; the child is stopped as the body starts, rather than
    letting it run beside the next holder."""
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: kills.append((pid, signum)))
    app_state(app).pool_child = os.getpid()
    ran: list[int] = []
    task = define(
        app, "terminate_before_body", lambda self, x: ran.append(x), lock_ttl=0.6, lock_on_lost="terminate"
    )
    try:  # os.kill recorded, not sent: the run goes on, and fails
        with (
            lost_before_the_body(app, task) as seen,
            threads_worker(app, concurrency=1),
            pytest.raises(LockLost),
        ):
            task.delay(2).get(timeout=RESULT_TIMEOUT)
    finally:
        app_state(app).pool_child = None
    assert seen == ["lost"]
    assert kills == [(os.getpid(), signal.SIGKILL)], f"the body ran ({ran}), the child was not stopped"
