"""What ``apply_async`` and the watchdog start, cut short: an asynchronous exception (Celery's
``SoftTimeLimitExceeded``, raised by a signal handler at any bytecode of a pool child; simulated
here at the first bytecode of a function the package calls, where CPython checks for pending
signals), or a thread that cannot start (``RuntimeError: can't start new thread``).

No enqueue lock is left naming a message that was not sent, and no lock of the process goes
unrenewed because a renewing thread once failed to start.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

import celery_redislock.enqueue
import celery_redislock.watchdog
from celery_redislock import task_lock_key
from celery_redislock._scripts import ACQUIRE
from celery_redislock.attempt import companion_key
from celery_redislock.connection import client_for
from celery_redislock.lock import RedisLock
from celery_redislock.protocol import parse_value, text
from celery_redislock.signals import lock_lost
from celery_redislock.watchdog import Lease, Watchdog, get_watchdog
from tests.interrupts import Arm, Interrupt, define, on_this_thread
from tests.invariants import stored
from tests.workers import renewed, threads_worker, wait_for

RESULT_TIMEOUT = 30
#: How long a test waits for a renewal (every 0.2 s here) before calling renewals frozen.
FROZEN = 10
WATCHDOG = "celery-redislock-watchdog"
REPORTER = "celery-redislock-loss-reports"


def failing_start(
    monkeypatch: pytest.MonkeyPatch, name: str, error: BaseException, *, began: bool = False
) -> list[threading.Thread]:
    """From now on, the first ``Thread.start`` of a thread named ``name`` raises ``error``: before
    the thread is made, or, with ``began``, once it runs. Returns the threads named ``name``
    started since (a list that grows)."""
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def failing(self: threading.Thread) -> None:
        if self.name != name:
            start(self)
            return
        first = not started
        started.append(self)
        if first and not began:
            raise error
        start(self)
        if first:
            raise error

    monkeypatch.setattr(threading.Thread, "start", failing)
    return started


def held_lease(client: redis.Redis, key: str) -> tuple[RedisLock, Lease]:
    """A lock held on ``key`` (0.6 s, renewed by no watchdog yet), and a lease to renew it."""
    lock = RedisLock(client, key, ttl=0.6, watchdog=False)
    assert lock.acquire(blocking=False)
    assert lock.token is not None
    return lock, Lease(client, key, lock.token, lock.ttl, weakref.ref(lock))


def test_a_soft_time_limit_as_the_watchdog_thread_starts_does_not_freeze_renewals(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's soft time limit lands as ``Watchdog.add`` starts the renewing thread (at the first
    bytecode of ``Thread.start``: the thread is restarted by nearly every run, as it exits when
    nothing is held). That run fails; the next run's lock is renewed all the same, so a duplicate
    of it is skipped while it runs (no frozen watchdog, no lock lost unnoticed)."""
    gate = threading.Event()
    starts: list[int] = []

    def body(self: Any, x: int) -> None:
        starts.append(x)
        if x == 5:
            gate.wait(RESULT_TIMEOUT)

    task = define(app, "renewed", body, lock_ttl=0.6)
    watchdog = get_watchdog()
    wait_for(lambda: watchdog._thread is None, what="no renewing thread (nothing held)")
    started = failing_start(monkeypatch, WATCHDOG, SoftTimeLimitExceeded())
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    key = task_lock_key(task, (5,))
    try:
        with threads_worker(app, concurrency=2):
            with pytest.raises(SoftTimeLimitExceeded):
                task.delay(4).get(timeout=RESULT_TIMEOUT)
            assert len(started) == 1
            running = task.delay(5)
            wait_for(lambda: 5 in starts, what="the long run to start")
            renewed(recorder, key, timeout=FROZEN)
            assert task.delay(5).get(timeout=RESULT_TIMEOUT) is None  # skipped: the lock is held
            gate.set()
            assert running.get(timeout=RESULT_TIMEOUT) == 5
        assert starts.count(5) == 1
    finally:
        gate.set()
        celery_redislock.watchdog._watchdog = None  # a frozen one (the bug) must not reach later tests
        recorder.delete(key)
        recorder.close()


def test_a_watchdog_thread_that_cannot_start_does_not_freeze_renewals(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under resource pressure ``Thread.start`` raises ``RuntimeError: can't start new thread`` as
    ``add`` starts the renewing thread: that ``add`` raises, and the next one starts the thread,
    which renews every lease, the first one's too."""
    started = failing_start(monkeypatch, WATCHDOG, RuntimeError("can't start new thread"))
    watchdog = Watchdog()
    (first, first_lease), (second, second_lease) = (held_lease(client, f"{prefix}:{n}") for n in (1, 2))
    try:
        with pytest.raises(RuntimeError):
            watchdog.add(first_lease, time.monotonic())
        watchdog.add(second_lease, time.monotonic())
        renewed(client, first.name, timeout=FROZEN)
        renewed(client, second.name, timeout=FROZEN)
        assert len(started) == 2
    finally:
        for lock, lease in ((first, first_lease), (second, second_lease)):
            watchdog.discard(lease)
            lock.release()


def test_a_soft_time_limit_once_the_watchdog_thread_began_leaves_one_renewer(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit lands in ``Thread.start`` once the renewing thread runs (as ``start``
    waits for it): ``add`` raises with no thread recorded, and the next ``add`` may start
    another. One of the two renews, the other ends: never two renewers (each would take the
    other's renewals for landed), and every lease is renewed."""
    started = failing_start(monkeypatch, WATCHDOG, SoftTimeLimitExceeded(), began=True)
    watchdog = Watchdog()
    (first, first_lease), (second, second_lease) = (held_lease(client, f"{prefix}:{n}") for n in (1, 2))
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            watchdog.add(first_lease, time.monotonic())
        watchdog.add(second_lease, time.monotonic())
        wait_for(
            lambda: [thread for thread in started if thread.is_alive()] == [watchdog._thread],
            timeout=FROZEN,
            what=lambda: f"one renewer: {started} alive, {watchdog._thread} recorded",
        )
        renewed(client, first.name, timeout=FROZEN)
        renewed(client, second.name, timeout=FROZEN)
    finally:
        for lock, lease in ((first, first_lease), (second, second_lease)):
            watchdog.discard(lease)
            lock.release()


def test_a_loss_report_thread_that_cannot_start_does_not_silence_later_losses(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread that logs and signals losses cannot start as the first loss is found (the
    renewing thread logs the error and goes on): the next loss starts it, and both losses are
    announced, in order."""
    reports: list[str] = []

    def receiver(sender: Any = None, key: str = "", **_: Any) -> None:
        reports.append(key)

    watchdog = get_watchdog()
    wait_for(lambda: watchdog._reporter is None, what="no reporting thread (nothing to report)")
    started = failing_start(monkeypatch, REPORTER, RuntimeError("can't start new thread"))
    lock_lost.connect(receiver, weak=False)
    try:
        keys = [f"{prefix}:{n}" for n in (1, 2)]
        for key in keys:
            lock = RedisLock(client, key, ttl=0.6)
            assert lock.acquire(blocking=False)
            client.delete(key)  # lost: the next renewal finds it gone
            assert lock.lost.wait(FROZEN)
            wait_for(lambda: started, what="a reporting thread started")
        wait_for(lambda: reports == keys, timeout=FROZEN, what=lambda: f"both losses announced: {reports}")
        assert len(started) == 2
    finally:
        lock_lost.disconnect(receiver)


@pytest.mark.parametrize(
    ("duplicate", "where"),
    [("return", "as-the-hold-is-recorded"), ("return", "once-taken"), ("replace", "once-taken")],
)
def test_a_soft_time_limit_after_the_enqueue_lock_is_taken_leaves_no_lock_without_a_message(
    app: Celery, monkeypatch: pytest.MonkeyPatch, duplicate: str, where: str
) -> None:
    """``apply_async`` (called from a task body, under its soft time limit) is interrupted after
    Redis granted the enqueue lock, before the message is sent: as the hold is recorded (the lock
    object knows no token yet), or once the take returned. The lock is given back, by the
    message's token: no lock is left for ``lock_queue_ttl`` (an hour) naming a task never sent,
    whose ``AsyncResult`` every later ``delay()`` would get."""
    task = define(app, f"queued_{duplicate}", lock_mode="until_executed", lock_duplicate=duplicate)
    fired: list[int] = []

    def interrupt() -> None:
        if not fired:
            fired.append(1)
            raise SoftTimeLimitExceeded()

    if where == "once-taken":
        name = "_replace" if duplicate == "replace" else "_acquire"
        take = getattr(celery_redislock.enqueue, name)

        def taken_then_interrupted(*args: Any) -> Any:
            taken = take(*args)
            interrupt()
            return taken

        monkeypatch.setattr(celery_redislock.enqueue, name, taken_then_interrupted)
    else:

        class Interrupted(RedisLock):
            def take_hold(self, token: str, fence: int, sent_at: float) -> None:
                interrupt()
                super().take_hold(token, fence, sent_at)

        monkeypatch.setattr(celery_redislock.enqueue, "RedisLock", Interrupted)
    client = redis.Redis.from_url(app.conf.redislock_url)
    key = task_lock_key(task, (3,))
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            task.apply_async((3,), task_id="never-sent")
        assert fired == [1]
        assert not client.exists(key), f"enqueue lock left with no message sent: {client.get(key)!r}"
    finally:
        client.delete(key)
        client.close()


def test_a_soft_time_limit_after_a_replace_gives_the_lock_back_to_the_queued_message(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lock_duplicate="replace"``: a call is interrupted just after ``REPLACE`` took the lock
    over from the queued message (as its reply is looked at), before its own message is sent.
    The lock goes back to the queued message, no longer superseded, which runs: neither is lost
    (the queued one dropped as superseded by a message that was never sent)."""
    task = define(app, "replaced", lock_mode="until_executing", lock_duplicate="replace")
    client = redis.Redis.from_url(app.conf.redislock_url)
    key = task_lock_key(task, (8,))
    queued = task.delay(8)
    before = stored(client, key)
    value = parse_value(before)
    assert value is not None
    main = threading.current_thread()
    fired: list[int] = []

    def interrupted(reply: Any) -> str:
        if not fired and threading.current_thread() is main:
            fired.append(1)
            raise SoftTimeLimitExceeded()
        return text(reply)

    monkeypatch.setattr(celery_redislock.enqueue, "text", interrupted)
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            task.apply_async((8,), task_id="never-sent")
        assert fired == [1]
        assert stored(client, key) == before  # given back to the queued message
        assert not client.exists(companion_key(key, f"superseded:{value.token}"))
        with threads_worker(app, concurrency=1):
            assert queued.get(timeout=RESULT_TIMEOUT) == 8
    finally:
        client.delete(key)
        client.close()


def test_an_enqueue_interrupted_as_the_take_is_answered_leaves_no_lock(
    app: Celery, interrupt_read: Arm
) -> None:
    """``apply_async`` is interrupted after its take reached Redis, before the reply was read: the
    take ran (the lock is held for the message), and is given back all the same."""
    task = define(app, "unread", lock_mode="until_executed")
    client = redis.Redis.from_url(app.conf.redislock_url)
    key = task_lock_key(task, (9,))
    taken: list[bool] = []

    def take_ran() -> None:
        wait_for(lambda: client.exists(key), what="the take to run")
        taken.append(True)

    client_for(app)[0].script_load(ACQUIRE.source)  # connected, loaded: the next read is the take's
    fired = interrupt_read(on_this_thread(), then=take_ran)
    try:
        with pytest.raises(Interrupt):
            task.apply_async((9,), task_id="never-sent")
        assert fired == [1] and taken == [True]
        assert not client.exists(key), f"enqueue lock left with no message sent: {client.get(key)!r}"
    finally:
        client.delete(key)
        client.close()
