"""The enqueue modes on a real Redis and real workers: duplicates refused at apply_async,
the lock handed to the worker, kept or released as each mode says."""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import GroupResult
from celery.signals import after_task_publish, task_failure, task_prerun
from kombu.exceptions import EncodeError

from celery_redislock import DuplicateTask, LockedTask, RedisLockError, signals, task_lock_key
from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW
from celery_redislock._task_scripts import ADOPT, SETTLE, WATCH
from celery_redislock.attempt import Attempt
from celery_redislock.lock import OneServer, companion_key
from celery_redislock.protocol import HEADER, holder_for, parse_holder, parse_value
from celery_redislock.state import LockClient, app_state
from celery_redislock.testing import RedisServer
from tests.interrupts import Arm, on_this_thread
from tests.invariants import stored
from tests.taskapp import make_app, recorder
from tests.workers import runs_over, threads_worker, wait_for

RESULT_TIMEOUT = 30


def queued(app: Celery) -> int:
    return int(recorder(app).client.llen(app.conf.task_default_queue))


def starts(app: Celery, x: object) -> list[list[str]]:
    return [event for event in recorder(app).events() if event[0] == "start" and event[2] == str(x)]


def attempts_started(app: Celery, attempt: int) -> list[list[str]]:
    return [event for event in recorder(app).events() if event[0] == f"attempt@{attempt}"]


@contextmanager
def worker(app: Celery) -> Iterator[None]:
    with threads_worker(app, concurrency=4):
        yield


def fresh() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.parametrize("duplicate", ["return", "raise"])
def test_500_delays_from_4_threads_publish_one_message(app: Celery, duplicate: str) -> None:
    x = fresh()
    task = app.tasks["taskapp.until_executed" if duplicate == "return" else "taskapp.refuse"]
    outcomes: list[Any] = []
    lock = threading.Lock()

    def send() -> None:
        for _ in range(125):
            try:
                result: Any = task.delay(x)
            except DuplicateTask as exc:
                result = exc
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert queued(app) == 1
    sent = [outcome for outcome in outcomes if not isinstance(outcome, DuplicateTask)]
    refused = [outcome for outcome in outcomes if isinstance(outcome, DuplicateTask)]
    if duplicate == "return":
        assert len(sent) == 500 and len({result.id for result in sent}) == 1
    else:
        assert len(sent) == 1 and len(refused) == 499
        assert {exc.existing_task_id for exc in refused} == {sent[0].id}
    with worker(app):
        assert sent[0].get(timeout=RESULT_TIMEOUT) == x
    assert len(starts(app, x)) == 1
    assert not recorder(app).client.exists(task_lock_key(task, (x,)))


def test_until_executing_refuses_while_queued_and_allows_while_running(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executing"]
    first = task.delay(x, gate=True)
    assert task.delay(x, gate=True).id == first.id  # queued: a duplicate
    with worker(app):
        wait_for(lambda: starts(app, x))
        second = task.delay(x, gate=True)  # running: the lock went at the start
        assert second.id != first.id
        wait_for(lambda: len(starts(app, x)) == 2, what="both to run at once")
        recorder(app).open_gate(x, times=2)
        assert first.get(timeout=RESULT_TIMEOUT) == second.get(timeout=RESULT_TIMEOUT) == x


def test_until_executed_refuses_while_queued_and_running_then_allows(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    key = task_lock_key(task, (x,), {"gate": True})
    first = task.delay(x, gate=True)
    assert 0 < recorder(app).client.pttl(key) <= 3_600_000  # lock_queue_ttl while queued
    assert task.delay(x, gate=True).id == first.id
    with worker(app):
        wait_for(lambda: starts(app, x))
        assert recorder(app).client.pttl(key) <= 30_000  # running: the lease, renewed by the watchdog
        assert task.delay(x, gate=True).id == first.id  # running: still a duplicate
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: not recorder(app).client.exists(key), what="the release")
        again = task.delay(x, gate=False)
        assert again.id != first.id and again.get(timeout=RESULT_TIMEOUT) == x


def test_until_and_while_executing_keeps_one_queued_and_one_running(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_and_while_executing"]
    with worker(app):
        first = task.delay(x, gate=True)
        wait_for(lambda: starts(app, x))
        second = task.delay(x, gate=True)  # one more may wait while one runs
        assert second.id != first.id
        assert task.delay(x, gate=True).id == second.id  # but only one
        recorder(app).open_gate(x, times=2)
        assert first.get(timeout=RESULT_TIMEOUT) == second.get(timeout=RESULT_TIMEOUT) == x
    events = [event for event in recorder(app).events() if event[2] == x and event[0] in ("start", "end")]
    assert [(event[0], event[3]) for event in events] == [
        ("start", first.id),
        ("end", first.id),
        ("start", second.id),
        ("end", second.id),
    ]


def test_a_busy_retry_keeps_the_enqueue_lock_for_its_new_queueing(app: Celery) -> None:
    # lock_queue_ttl 5 s, lock_retry_delay 60 s: the republished duplicate waits 30-90 s in the
    # queue, so its enqueue lock must be extended to outlive that wait, or a third copy could be sent.
    x, task = fresh(), app.tasks["taskapp.requeued_slowly"]
    queued_key = task_lock_key(task, (x,), {"gate": True}) + ":queued"
    with worker(app):
        first = task.delay(x, gate=True)
        wait_for(lambda: starts(app, x))
        second = task.delay(x, gate=True)
        assert 0 < recorder(app).client.pttl(queued_key) <= 5_000
        wait_for(
            lambda: any(event[0] == "busy" and event[3] == second.id for event in recorder(app).events())
        )
        wait_for(lambda: recorder(app).client.pttl(queued_key) > 5_000, what="the enqueue lock's extension")
        assert recorder(app).client.pttl(queued_key) <= 95_000
        assert task.delay(x, gate=True).id == second.id  # still the one waiting
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
    recorder(app).client.delete(queued_key)  # the retry is still in its countdown: let it go unlocked


def test_a_busy_retry_of_a_message_sent_without_an_enqueue_lock_is_republished(app: Celery) -> None:
    """until_and_while_executing (``lock_busy="retry"``): a message sent with ``send_task`` (no
    enqueue lock in it) finds the execution lock held while another message holds the enqueue
    lock. Its busy retry republishes it, the same message queued again: not a new call refused
    as a duplicate of the queued one, which sent nothing and left the message RETRY forever,
    never run."""
    x, task = fresh(), app.tasks["taskapp.until_and_while_executing"]
    with worker(app):
        first = task.delay(x, gate=True)
        wait_for(lambda: starts(app, x))
        second = task.delay(x, gate=True)  # queued behind it, with the enqueue lock
        copy = app.send_task(task.name, (x,), {"gate": True})
        wait_for(
            lambda: any(event[0] == "busy" and event[3] == copy.id for event in recorder(app).events()),
            what="the copy to find the lock busy",
        )
        recorder(app).open_gate(x, times=3)
        assert first.get(timeout=RESULT_TIMEOUT) == second.get(timeout=RESULT_TIMEOUT) == x
        assert copy.get(timeout=RESULT_TIMEOUT) == x, "the busy retry was swallowed"
    assert sorted(event[3] for event in starts(app, x)) == sorted([first.id, second.id, copy.id])


def test_until_expired_holds_after_the_run_for_its_period(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_expired"]
    key = task_lock_key(task, (x,))
    with worker(app):
        first = task.delay(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
        assert task.delay(x).id == first.id  # after the run: still refused
    ttl = recorder(app).client.pttl(key)
    assert 590_000 < ttl <= 600_000  # lock_period (600 s) from when it was taken
    recorder(app).client.delete(key)


def test_until_executed_keeps_the_lock_across_its_retries(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.retry_twice"]
    with worker(app):
        result = task.delay(x)
        for attempt in range(2):
            wait_for(partial(attempts_started, app, attempt))
            assert task.delay(x).id == result.id  # refused between the retries
            recorder(app).open_gate(x)
        assert result.get(timeout=RESULT_TIMEOUT) == x
    attempts = [event[0] for event in recorder(app).events() if event[0].startswith("attempt")]
    assert attempts == ["attempt@0", "attempt@1", "attempt@2"]
    assert not recorder(app).client.exists(task_lock_key(task, (x,)))


def test_send_task_of_a_duplicate_does_not_run_the_body(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    original = task.delay(x, gate=True)
    # send_task bypasses apply_async: no enqueue check, no lock in the message
    copy = app.send_task("taskapp.until_executed", (x,), {"gate": True})
    with worker(app):
        assert copy.get(timeout=RESULT_TIMEOUT) is None  # caught at execution: skipped
        recorder(app).open_gate(x)
        assert original.get(timeout=RESULT_TIMEOUT) == x
    assert len(starts(app, x)) == 1


def test_revoking_a_queued_task_frees_its_enqueue_lock(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """The worker frees it, and says so at INFO under ``celery_redislock.enqueue`` (the loggers
    table of docs/operations.md)."""
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    key = task_lock_key(task, (x,))
    with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock"):
        queued_result = task.apply_async((x,), countdown=2)  # held by the worker until its eta
        wait_for(lambda: recorder(app).client.exists(key))
        queued_result.revoke()
        wait_for(
            lambda: not recorder(app).client.exists(key), what="the worker to free the revoked task's lock"
        )
    assert starts(app, x) == []
    freed = [
        (record.name, record.levelno)
        for record in caplog.records
        if f"[{queued_result.id}] revoked: its enqueue lock {key} released" in record.getMessage()
    ]
    assert freed == [("celery_redislock.enqueue", logging.INFO)]


@pytest.mark.locks_may_remain("the message is never consumed: its enqueue lock stays until it expires")
def test_an_expiring_message_bounds_its_enqueue_lock(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    task.apply_async((x,), expires=30)
    assert 0 < recorder(app).client.pttl(task_lock_key(task, (x,))) <= 30_000


@pytest.mark.locks_may_remain("the message is never consumed: its enqueue lock stays until it expires")
def test_a_zero_countdown_beside_an_eta_leaves_the_eta_to_extend_the_enqueue_lock(app: Celery) -> None:
    """Celery converts a ``countdown`` to an eta only when it is non-zero (``if countdown:``):
    ``countdown=0`` beside an ``eta`` sends the message for that eta, and its lock must live
    until then plus ``lock_queue_ttl``, not expire while the message still waits."""
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    task.apply_async((x,), countdown=0, eta=datetime.now(timezone.utc) + timedelta(hours=2))
    pttl = recorder(app).client.pttl(task_lock_key(task, (x,)))
    assert pttl > 2 * 3_600_000, f"the lock expires in {pttl} ms, before the message's eta"


@pytest.mark.locks_may_remain("the message is never consumed: its enqueue lock stays until it expires")
def test_a_tasks_own_expires_bounds_its_enqueue_lock(app: Celery) -> None:
    """``expires`` set on the task (Celery's ``Task.apply_async`` applies it under the call's
    options, as ``task_annotations`` does): the message expires after 30 s, and so does its lock."""

    @app.task(base=LockedTask, shared=False, name="enqueue.expiring", lock_mode="until_executed", expires=30)
    def expiring(x: str) -> str:
        return x

    x = fresh()
    expiring.delay(x)
    assert 0 < recorder(app).client.pttl(task_lock_key(expiring, (x,))) <= 30_000


def test_a_publish_error_releases_the_enqueue_lock(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.keyed_by_x"]
    with pytest.raises(EncodeError):
        task.delay(x, blob=object())  # keyed by x alone, but the message cannot be encoded
    assert not recorder(app).client.exists(task_lock_key(task, (x,)))
    assert queued(app) == 0


@pytest.mark.parametrize("mode", ["until_executing", "until_executed", "until_and_while_executing"])
@pytest.mark.parametrize("damage", ["a_body_that_does_not_decode", "a_content_type_the_worker_refuses"])
def test_a_message_the_worker_cannot_decode_frees_its_enqueue_lock(
    app: Celery, mode: str, damage: str
) -> None:
    """A message whose body the worker cannot read: corrupt (Celery's consumer logs the
    ``DecodeError`` and acknowledges it, ``on_decode_error``, which sends no signal), or of a
    content type the worker does not accept (``ContentDisallowed``: ``task_rejected``). It never
    runs: its enqueue lock, read from its headers, is freed as it is dropped, so that the next
    call of its arguments is sent and runs rather than being refused for ``lock_queue_ttl``."""
    x, task, client = fresh(), app.tasks[f"taskapp.{mode}"], recorder(app).client
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it
    key = task_lock_key(task, (x,))
    task.apply_async((x,), queue=idle)
    popped = client.rpop(idle)
    assert isinstance(popped, bytes), f"{idle} holds {popped!r}"
    sent = json.loads(popped)  # kombu's Redis envelope: the body base64-encoded
    if damage == "a_body_that_does_not_decode":
        sent["body"] = base64.b64encode(b"{not json").decode()
    else:
        sent["content-type"] = "application/x-python-serialize"  # pickle: not in accept_content
    client.lpush(app.conf.task_default_queue, json.dumps(sent))
    with worker(app):
        after = fresh()  # consumed after the damaged message (FIFO): it was dropped by then
        assert task.delay(after).get(timeout=RESULT_TIMEOUT) == after
        assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
    assert len(starts(app, x)) == 1


def cut_off_after_the_take(
    app: Celery, key: str, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch
) -> threading.Event:
    """From now on, this thread's first script call is cut off once it ran (its reply lost: a
    ``ConnectionError`` once the lock ``key`` is in Redis), and every script call naming ``key``
    fails to be sent (Redis unreachable) until the returned event is cleared: the take of an
    enqueue lock whose undo fails too. Commands other than scripts (the broker's) go through."""
    down, client = threading.Event(), recorder(app).client
    send: Any = redis.connection.AbstractConnection.send_packed_command

    def failing_send(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        data = b"".join(command) if isinstance(command, list) else bytes(command)
        if down.is_set() and b"EVALSHA" in data and key.encode() in data:
            raise redis.ConnectionError("injected: Redis unreachable")
        return send(self, command, *args, **kwargs)

    def taken() -> None:
        wait_for(lambda: client.exists(key), what="the take to reach Redis")
        down.set()

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", failing_send)
    interrupt_read(on_this_thread(), error=redis.ConnectionError, then=taken)
    return down


@pytest.mark.parametrize("mode", ["until_executing", "until_executed", "until_and_while_executing"])
def test_a_take_whose_reply_and_undo_are_lost_still_lets_the_unlocked_message_run_and_free_it(
    redis_server: RedisServer, prefix: str, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``redislock_on_error="run"``: the enqueue lock's take reaches Redis, its reply is lost and
    its undo cannot be sent. The message is sent, as the setting says; it carries the ticket all
    the same, so that its worker adopts or frees the lock the take left, owner-checked. Before,
    it was sent without it: ``until_executed``'s run found its own message's lock held and was
    skipped, its body never run, and in every mode the lock refused each later call of its
    arguments for ``lock_queue_ttl``."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_on_error="run")
    try:
        x, task, client = fresh(), app.tasks[f"taskapp.{mode}"], recorder(app).client
        key = task_lock_key(task, (x,)) + (":queued" if mode == "until_and_while_executing" else "")
        task.delay(fresh())  # the connection made and the scripts loaded: the next call is the take
        down = cut_off_after_the_take(app, key, interrupt_read, monkeypatch)
        sent = task.delay(x)
        down.clear()
        assert client.exists(key), "the take left no lock: nothing to test"
        with worker(app):
            assert sent.get(timeout=RESULT_TIMEOUT) == x
            wait_for(lambda: not client.exists(key), what="the lock the take left to go")
            again = task.delay(x)
            assert again.id != sent.id
            assert again.get(timeout=RESULT_TIMEOUT) == x
        assert len(starts(app, x)) == 2
    finally:
        app.close()


def test_a_take_whose_reply_and_undo_are_lost_under_fail_raises_and_leaves_the_lock_to_its_ttl(
    app: Celery, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``redislock_on_error="fail"`` (the default), the take cut off as above: ``apply_async``
    raises ``RedisLockError`` naming the key, nothing is sent, and the lock stays until it expires
    (``lock_queue_ttl``), a WARNING naming its key (docs/design.md: ``redislock release KEY``)."""
    x, warm, task, client = fresh(), fresh(), app.tasks["taskapp.until_executed"], recorder(app).client
    key = task_lock_key(task, (x,))
    task.delay(warm)  # the connection made and the scripts loaded: the next call is the take
    down = cut_off_after_the_take(app, key, interrupt_read, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="celery_redislock"), pytest.raises(RedisLockError) as raised:
        task.delay(x)
    down.clear()
    assert f"could not take enqueue lock {key!r}" in str(raised.value)
    assert any(key in record.getMessage() for record in caplog.records if record.levelno == logging.WARNING)
    assert queued(app) == 1  # the first call's message alone
    assert 0 < client.pttl(key) <= 3_600_000
    client.delete(key, task_lock_key(task, (warm,)))  # the second: its message is never consumed


def test_a_chord_of_identical_signatures_runs_every_member(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    with worker(app):
        result = chord([task.s(x) for _ in range(3)])(app.tasks["taskapp.collect"].s())
        assert result.get(timeout=RESULT_TIMEOUT) == [x, x, x]
    assert len(starts(app, x)) == 3


@pytest.mark.parametrize("member", ["head", "last"])
def test_a_chain_with_a_member_queued_already_completes(app: Celery, member: str) -> None:
    """A chain's result is its last member's, frozen before anything is sent: a member refused
    at enqueue as a duplicate (its head, sent by the caller, or the last, sent by the worker as
    the one before it ends) sends nothing, and the chain's ``.get()`` waited forever. Members
    of a chain pass the enqueue check as a group's do; the worker's check skips the duplicate."""
    x, task, collect = fresh(), app.tasks["taskapp.until_executed"], app.tasks["taskapp.collect"]
    twin = task.si(x, gate=True)  # the signature of the one queued first
    steps = [twin, collect.s()] if member == "head" else [collect.si([x]), twin]
    with worker(app):
        first = task.delay(x, gate=True)
        wait_for(lambda: starts(app, x))
        result = chain(*steps).apply_async()
        wait_for(
            lambda: any(event[0] == "busy" and event[3] != first.id for event in recorder(app).events()),
            timeout=RESULT_TIMEOUT,
            what="the chain's duplicate to reach the worker (refused at enqueue, the chain waits forever)",
        )
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
        assert result.get(timeout=RESULT_TIMEOUT) is None  # the duplicate skipped (lock_busy="skip")
    assert len(starts(app, x)) == 1


@pytest.mark.parametrize(
    ("mode", "sent"),
    [
        ("while_executing", "delay"),
        ("until_executed", "delay"),
        ("until_and_while_executing", "delay"),
        ("until_expired", "delay"),
        ("until_expired", "group"),
    ],
)
def test_a_run_replaced_by_a_call_of_the_same_key_runs_the_replacement(
    app: Celery, mode: str, sent: str
) -> None:
    """``self.replace(sig)`` sends ``sig`` under the run's own task id, then ends the run
    (``Ignore``): its result is the replacement's. One of the same key must run: not be refused
    at enqueue as a duplicate of the run it replaces (``until_executed``), nor, finding that run
    still letting go, ignored at the worker as a copy of itself delivered again. Here the
    replaced run lets go only once the replacement has found the lock held. ``until_expired``:
    the replaced run does not keep its lock for ``lock_period``: its replacement takes it, and
    keeps it for that long after its own run; also as a group member, whose replacement is one
    too."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"enqueue.replaced_{mode}",
        lock_mode=mode,
        lock_on=("x",),
        lock_period=60 if mode == "until_expired" else None,  # the only mode with one
        lock_wait_timeout=5,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"step{n}", self, x)
        if n == 0:
            raise self.replace(step.si(x, 1))
        return n

    def replacement_sent(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == step.name and (headers or {}).get("replaced_task_nesting"):
            with suppress(AssertionError):  # the assertions below tell what happened
                wait_for(lambda: any(e[0] == "busy" for e in recorder(app).events()), timeout=10)

    x = fresh()
    after_task_publish.connect(replacement_sent, weak=False)
    try:
        with worker(app):
            if sent == "group":
                assert group([step.s(x)]).apply_async().get(timeout=RESULT_TIMEOUT) == [1]
            else:
                assert step.delay(x).get(timeout=RESULT_TIMEOUT) == 1
    finally:
        after_task_publish.disconnect(replacement_sent)
    assert [e[0] for e in recorder(app).events() if e[0].startswith("step")] == ["step0", "step1"]
    if mode == "until_expired":
        key = task_lock_key(step, (x,))
        assert 0 < recorder(app).client.pttl(key) <= 60_000  # the replacement's period
        recorder(app).client.delete(key)


@pytest.mark.parametrize(
    ("mode", "sent", "duplicate"),
    [
        ("until_executed", "delay", "return"),
        ("until_expired", "delay", "return"),
        ("until_expired", "group", "return"),
        ("until_executed", "delay", "replace"),
    ],
)
def test_a_call_of_the_key_a_run_replaces_itself_with_is_refused_until_the_replacement_runs(
    app: Celery, mode: str, sent: str, duplicate: str
) -> None:
    """A run replaced by a call of the same key (``self.replace(sig)``) hands its hold over to
    its replacement, as an attempt parks its hold for its retry: a ``delay()`` of that key
    between the run's end and the replacement's start is refused as a duplicate of the task
    (the replacement runs under its id), and the replacement runs. Here the replacement's
    worker starts it only once that ``delay()`` was made. Before, the run released its lock for
    the replacement to take it afresh: the ``delay()`` took the enqueue lock and was sent, and
    the replacement found it held, a new call's: skipped (``None``) or, a group member, failed
    its group after ``lock_wait_timeout``. With ``lock_duplicate="replace"`` the call does not
    take the hold over either: it is the task's, handed to its replacement, as a retry's is."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"enqueue.handed_{mode}",
        lock_mode=mode,
        lock_duplicate=duplicate,
        lock_on=("x",),
        lock_period=60 if mode == "until_expired" else None,
        lock_wait_timeout=5,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"step{n}", self, x)
        if n == 0:
            raise self.replace(step.si(x, 1))
        return n

    go = threading.Event()

    def replacement_starts(sender: Any = None, args: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == step.name and list(args or ())[1:] == [1]:
            go.wait(timeout=RESULT_TIMEOUT)

    x, client = fresh(), recorder(app).client
    key = task_lock_key(step, (x,))

    def let_go() -> bool:
        held = client.get(key)
        return any(e[0] == "step0" for e in recorder(app).events()) and (
            held is None or b" state=running " not in held
        )

    task_prerun.connect(replacement_starts, weak=False)
    try:
        with worker(app):
            first = group([step.s(x)]).apply_async() if sent == "group" else step.delay(x)
            wait_for(let_go, what=lambda: f"the replaced run to let go: {client.get(key)!r}")
            again = step.delay(x)
            assert again.id == (first.results[0].id if isinstance(first, GroupResult) else first.id)
            go.set()
            assert first.get(timeout=RESULT_TIMEOUT) == ([1] if sent == "group" else 1)
    finally:
        go.set()
        task_prerun.disconnect(replacement_starts)
    assert [e[0] for e in recorder(app).events() if e[0].startswith("step")] == ["step0", "step1"]
    if mode == "until_expired":
        assert 0 < client.pttl(key) <= 60_000  # the replacement's period
        client.delete(key)


def test_a_replacement_that_never_runs_gives_its_handed_hold_up(app: Celery) -> None:
    """``until_expired``: a run hands its hold over to its replacement of the same key, which
    expires before it runs (revoked at the worker). Nothing will adopt the hold: it is given up
    as a retry's is, kept for what is left of the run's ``lock_period`` (that run ran), not for
    ``lock_queue_ttl`` as a hold parked for no one, nor freed, which would let a call of the
    same arguments run again within the period."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="enqueue.replaced_expiring",
        lock_mode="until_expired",
        lock_on=("x",),
        lock_period=60,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"step{n}", self, x)
        if n == 0:
            gone = datetime.now(timezone.utc) - timedelta(seconds=1)
            raise self.replace(step.si(x, 1).set(expires=gone))
        return n

    x, client = fresh(), recorder(app).client
    key = task_lock_key(step, (x,))
    with worker(app):
        first = step.delay(x)
        wait_for(lambda: starts_of_step(app, x), what="the run to start")
        wait_for(lambda: runs_over(step.name), what="the replaced run to let go")
        wait_for(
            lambda: 0 < client.pttl(key) <= 60_000,
            what=lambda: f"the hold to be kept for the period ({client.get(key)!r}, {client.pttl(key)} ms)",
        )
        assert step.delay(x).id == first.id  # within the period: refused
    assert [e[0] for e in recorder(app).events() if e[0].startswith("step")] == ["step0"]
    client.delete(key)


def starts_of_step(app: Celery, x: str) -> list[list[str]]:
    return [e for e in recorder(app).events() if e[0] == "step0" and e[2] == x]


@pytest.mark.parametrize("mode", ["while_executing", "until_executed"])
def test_a_retried_run_replaced_by_a_call_of_the_same_key_runs_the_replacement(
    app: Celery, mode: str
) -> None:
    """A run that retried once replaces itself with a call of the same key, which reaches a
    worker while that run still holds the lock. The replacement (Celery sends it with no retry
    count: 0, one replacement deeper) must wait for the run it replaces. Before, it took the
    run's hold, of a later retry count than its own, for a later attempt's: it was ignored as a
    stale copy of an earlier one (``Ignore``, no result stored), and the task never completed."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"enqueue.retried_replaced_{mode}",
        lock_mode=mode,
        lock_on=("x",),
        lock_wait_timeout=5,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"step{n}@{self.request.retries}", self, x)
        if self.request.retries == 0 and n == 0:
            raise self.retry(countdown=0)
        if n == 0:
            raise self.replace(step.si(x, 1))
        return n

    def replacement_sent(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == step.name and (headers or {}).get("replaced_task_nesting"):
            with suppress(AssertionError):  # the assertions below tell what happened
                wait_for(lambda: any(e[0] == "busy" for e in recorder(app).events()), timeout=10)

    x = fresh()
    after_task_publish.connect(replacement_sent, weak=False)
    try:
        with worker(app):
            result = step.delay(x)
            wait_for(result.ready, timeout=RESULT_TIMEOUT, what=lambda: f"the task to end ({result.state})")
            assert result.get(timeout=RESULT_TIMEOUT) == 1
    finally:
        after_task_publish.disconnect(replacement_sent)
    assert [e[0] for e in recorder(app).events() if e[0].startswith("step")] == [
        "step0@0",
        "step0@1",
        "step1@0",
    ]


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_run_replaced_by_a_call_of_other_arguments_lets_go_as_after_any_run(app: Celery, mode: str) -> None:
    """A run replaces itself with a call of other arguments (another key), which waits (here in a
    queue no worker consumes). The replacement continues the task, as a retry does: it holds its
    key's enqueue lock while it waits, so that a ``delay()`` of those arguments is refused as a
    duplicate of the task; and the run lets go of its own lock as after any run (kept for
    ``lock_period`` in ``until_expired``). Before, the replacement was sent without a lock (the
    ``delay()`` was sent beside it), and an ``until_expired`` run released its lock for a
    replacement that would never take it: a call of its arguments ran again within the period."""
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"enqueue.replaced_away_{mode}",
        lock_mode=mode,
        lock_on=("x", "n"),
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"step{n}", self, x)
        if n == 0:
            raise self.replace(step.si(x, 1).set(queue=idle))
        return n

    x, client = fresh(), recorder(app).client
    first_key, next_key = task_lock_key(step, (x, 0)), task_lock_key(step, (x, 1))
    with worker(app):
        first = step.delay(x)
        wait_for(lambda: client.llen(idle), what="the replacement to be sent")
        wait_for(lambda: runs_over(step.name), what="the replaced run to let go")
    if mode == "until_expired":
        assert 0 < client.pttl(first_key) <= 60_000, "the replaced run did not keep its lock for its period"
        client.delete(first_key)
    assert not client.exists(first_key)
    held = parse_value(client.get(next_key))
    assert held is not None, "the replacement holds no enqueue lock"
    assert parse_holder(held.holder)["task"] == first.id
    assert step.delay(x, 1).id == first.id  # refused: the replacement is queued
    client.delete(next_key, idle)


def test_a_run_replaced_by_another_tasks_call_whose_enqueue_lock_is_held_still_ends(app: Celery) -> None:
    """A task replaces itself (``self.replace(sig)``) with a call of another ``until_executed``
    task, whose arguments' message is queued already (here in a queue no worker consumes). The
    replacement carries the replaced task's id, and that task's result is the replacement's: it
    continues a message sent already, as a retry does, so it is never refused as a duplicate. It
    is sent without the enqueue lock, held by the queued message, and its worker finds the key
    held (``lock_busy="skip"``: the result is ``None``). Before, it was refused (nothing sent,
    Celery's replace then ended the run with ``Ignore``): the replaced task never got a result."""
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it

    @app.task(base=LockedTask, shared=False, name="enqueue.replacing_target", lock_mode="until_executed")
    def target(x: str) -> str:
        recorder(app).push(f"{recorder(app).prefix}:targets", x)
        return x

    @app.task(bind=True, shared=False, name="enqueue.replaced_by_another")
    def replaced(self: Any, x: str) -> None:
        raise self.replace(target.si(x))

    x, client = fresh(), recorder(app).client
    key = task_lock_key(target, (x,))
    queued_call = target.apply_async((x,), queue=idle)
    try:
        with worker(app):
            result = replaced.delay(x)
            assert result.get(timeout=RESULT_TIMEOUT) is None  # the replacement ran, and skipped
        assert client.llen(f"{recorder(app).prefix}:targets") == 0
        held = parse_value(client.get(key))
        assert held is not None and parse_holder(held.holder)["task"] == queued_call.id
    finally:
        client.delete(key, idle)


def test_a_link_callback_refused_as_a_duplicate_leaves_its_parents_success(app: Celery) -> None:
    """``lock_duplicate="raise"``: Celery's worker sends a task's ``link`` callback once the task
    has succeeded, before it stores the result; a ``DuplicateTask`` from that send failed the
    task that succeeded (``FAILURE``, its errbacks called). A callback Celery sends gets the
    ``"return"`` outcome: not sent, nothing raised into the worker."""

    @app.task(shared=False, name="enqueue.parent")
    def parent(x: str) -> str:
        return x

    x, refuse = fresh(), app.tasks["taskapp.refuse"]
    with worker(app):
        first = refuse.delay(x, gate=True)
        wait_for(lambda: starts(app, x))
        result = parent.apply_async((x,), link=refuse.si(x, gate=True))
        assert result.get(timeout=RESULT_TIMEOUT) == x
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
    assert len(starts(app, x)) == 1


def test_group_members_opted_in_are_deduplicated_at_enqueue(app: Celery) -> None:
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    # celery-types lists only Celery's own options; Signature.set passes on any other
    group([task.s(x).set(lock_in_canvas=True) for _ in range(3)]).apply_async()  # type: ignore[call-arg]
    assert queued(app) == 1
    with worker(app):
        wait_for(
            lambda: not recorder(app).client.exists(task_lock_key(task, (x,))), what="the one run to end"
        )
    assert len(starts(app, x)) == 1


def test_a_message_redelivered_while_its_first_delivery_runs_does_not_run(app: Celery) -> None:
    """A redelivery (acks_late, a Redis visibility timeout) is the same message again: same
    task id, same retry count, same lock header. Publish exactly that while the first runs."""
    x, task = fresh(), app.tasks["taskapp.acks_late"]
    key = task_lock_key(task, (x,), {"gate": True})
    first = task.delay(x, gate=True)
    token = stored(recorder(app).client, key)[:32].decode()  # the message's: the run adopts under its own
    with worker(app):
        wait_for(lambda: starts(app, x))
        # celery-types types headers as str to str; Celery sends any JSON value
        header = {HEADER: {"key": key, "token": token}}
        task.apply_async((x,), {"gate": True}, task_id=first.id, headers=header)  # type: ignore[arg-type]
        wait_for(lambda: [e for e in recorder(app).events() if e[0] == "busy" and e[3] == first.id])
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
    assert len(starts(app, x)) == 1
    assert not recorder(app).client.exists(key)


def test_a_redelivered_copy_whose_first_delivery_ends_while_another_call_waits_does_not_run(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """The first delivery ends while its redelivered copy watches its hold and another call of the
    key (``lock_busy="wait"``) waits, queued before the copy: the release hands the hold to the
    copy, which learns that its first delivery ended and is ignored; the other call runs next."""
    x, task = fresh(), app.tasks["taskapp.hold_wait"]
    key = task_lock_key(task, (x,), {"gate": True})
    client = recorder(app).client
    first = task.delay(x, gate=True)
    with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock.busy"):
        wait_for(lambda: starts(app, x))
        other = task.delay(x, gate=True)
        wait_for(lambda: client.zcard(companion_key(key, "queue")) == 1, what="the other call to wait")
        task.apply_async((x,), {"gate": True}, task_id=first.id)  # the message delivered again
        wait_for(lambda: stored(client, key)[32:33] != b":", what="the copy to watch the hold")
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: "redelivered while its first delivery runs; ignored" in caplog.text)
        wait_for(lambda: len(starts(app, x)) == 2, what="the other call to run")
        recorder(app).open_gate(x)
        assert other.get(timeout=RESULT_TIMEOUT) == x
    assert [event[3] for event in starts(app, x)] == [first.id, other.id]


@pytest.mark.parametrize("stall", ["before_its_reply_is_read", "in_a_lock_busy_receiver"])
def test_a_copy_counts_its_first_deliverys_lease_from_before_it_asked(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stall: str
) -> None:
    """A redelivered copy asks how long its first delivery's lease has left, then sends
    ``lock_busy``. A stall between the script's run and the copy's decision (its thread held up
    before it reads the reply, or a receiver slower than the lease: it runs out meanwhile, that
    delivery's worker dead) must not make the copy count the lease from after the stall, take
    the delivery that died for one alive, and drop the message: the lease ran out, so it runs.
    The lease is counted from before the copy asked, the earliest it can end."""
    x, task, task_id = fresh(), app.tasks["taskapp.hold_skip"], str(uuid.uuid4())
    key = task_lock_key(task, (x,))
    client = recorder(app).client
    client.set(key, f"{'a' * 32}:1:{holder_for(task_id, 0, 'dead@host', 1)}", px=60_000)
    mode, granted, renewals = Attempt.mode, Attempt.granted, [1]

    def mode_then_last_renewed(attempt: Attempt) -> str:
        # The dead delivery's last renewal, 1.5 s before its lease runs out: as the copy asks,
        # not before the worker started (which could outlast the lease: the copy then found
        # the lock free, and had nothing to decide)
        sent = mode(attempt)
        if renewals:
            renewals.pop()
            client.pexpire(key, 1500)  # no one renews it
        return sent

    def run_out() -> None:
        wait_for(lambda: not client.exists(key), what="the dead delivery's lease to run out")

    def granted_then_stalled(attempt: Attempt, reply: Any) -> int | None:
        fence = granted(attempt, reply)
        if fence is None and stall == "before_its_reply_is_read":
            run_out()
        return fence

    def slow_receiver(sender: Any = None, **_: Any) -> None:
        if stall == "in_a_lock_busy_receiver":
            run_out()

    monkeypatch.setattr(Attempt, "mode", mode_then_last_renewed)
    monkeypatch.setattr(Attempt, "granted", granted_then_stalled)
    signals.lock_busy.connect(slow_receiver, weak=False)
    try:
        with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock.busy"):
            result = task.apply_async((x,), task_id=task_id)  # the message delivered again
            wait_for(lambda: "its first delivery" in caplog.text, what="the copy to decide")
            assert "redelivered while its first delivery runs" not in caplog.text
            assert "redelivered after its first delivery's worker died" in caplog.text
            assert result.get(timeout=RESULT_TIMEOUT) == x
    finally:
        signals.lock_busy.disconnect(slow_receiver)
    assert [event[3] for event in starts(app, x)] == [task_id]
    assert not client.exists(key)


#: The scripts a task's lock sends, as ``CountingClient`` names them.
SCRIPTS = {
    "ACQUIRE": ACQUIRE,
    "ADOPT": ADOPT,
    "RELEASE": RELEASE,
    "RENEW": RENEW,
    "SETTLE": SETTLE,
    "WATCH": WATCH,
}
SCRIPT_NAMES = {script.sha: name for name, script in SCRIPTS.items()}


class CountingClient(redis.Redis):
    """A lock client that notes each command it sends (a script by its name), from any thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(SCRIPT_NAMES.get(args[1], "EVALSHA") if args[0] == "EVALSHA" else str(args[0]))
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # unannotated


@pytest.fixture
def counting(app: Celery, redis_server: RedisServer) -> Iterator[CountingClient]:
    """The app's lock client, counting; the scripts it names loaded (no NOSCRIPT to count)."""
    client = CountingClient(host="127.0.0.1", port=redis_server.port)
    for script in SCRIPTS.values():
        client.script_load(script.source)
    app_state(app).client = LockClient(os.getpid(), client, redis_server.url, False)
    yield client
    client.close()


def test_a_copy_that_finds_its_runs_hold_kept_decides_with_one_script_call(
    app: Celery, counting: CountingClient, caplog: pytest.LogCaptureFixture
) -> None:
    """``until_expired``: a copy of the message delivered again once its run ended and kept the
    lock for ``lock_period`` is ignored after its ``ADOPT`` (which any run sends) and one
    ``WATCH``, which tells it the hold is kept: no read besides."""
    x, task = fresh(), app.tasks["taskapp.until_expired"]
    key = task_lock_key(task, (x,))
    client = recorder(app).client
    first = task.delay(x)
    header = {HEADER: {"key": key, "token": stored(client, key)[:32].decode()}}
    with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock.busy"):
        assert first.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: parse_value(stored(client, key)).kept, what="the run to keep its lock")  # type: ignore[union-attr]
        counting.sent.clear()
        task.apply_async((x,), task_id=first.id, headers=header)  # type: ignore[arg-type]  # the message again
        wait_for(lambda: "redelivered once its first delivery ran, which keeps lock" in caplog.text)
        assert counting.sent == ["ADOPT", "WATCH"]
    assert len(starts(app, x)) == 1
    client.delete(key)


def test_a_copy_watching_its_running_first_delivery_learns_at_once_that_it_ended_and_kept_the_lock(
    app: Celery, counting: CountingClient, caplog: pytest.LogCaptureFixture
) -> None:
    """``until_expired``: a copy of the message delivered again while its first delivery runs
    watches that run's hold with its first script call after its ``ADOPT`` (``WATCH``, no read
    before it). The run ends and keeps its lock for ``lock_period``: the copy is told so at once,
    and is ignored as one that arrives once the run ended (not, ``lock_ttl/3`` later, as one
    whose first delivery runs)."""
    x, task = fresh(), app.tasks["taskapp.until_expired"]
    key = task_lock_key(task, (x,), {"gate": True})
    client = recorder(app).client
    first = task.delay(x, gate=True)
    header = {HEADER: {"key": key, "token": stored(client, key)[:32].decode()}}
    with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock.busy"):
        wait_for(lambda: starts(app, x))
        counting.sent.clear()
        task.apply_async((x,), {"gate": True}, task_id=first.id, headers=header)  # type: ignore[arg-type]
        wait_for(lambda: stored(client, key)[32:33] != b":", what="the copy to watch the hold")
        assert [name for name in counting.sent if name != "RENEW"][:2] == ["ADOPT", "WATCH"]
        recorder(app).open_gate(x)
        assert first.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: "its first delivery" in caplog.text, what="the copy to decide")
        assert "redelivered once its first delivery ran, which keeps lock" in caplog.text
        assert "redelivered while its first delivery runs" not in caplog.text
    assert len(starts(app, x)) == 1
    kept = parse_value(stored(client, key))
    assert kept is not None and kept.kept
    client.delete(key)


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_copy_watching_its_running_first_delivery_learns_at_once_that_it_retried(
    app: Celery, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """A copy of the message delivered again while its first delivery runs watches that run's
    hold. The run retries, parking its hold for its retry's message: the copy is told so at
    once, and is ignored as one whose first delivery handed its lock to its retry (not, after
    ``lock_ttl/3``, 100 s here, as one whose first delivery runs); the retry adopts the hold
    and runs, once."""

    @app.task(base=LockedTask, bind=True, shared=False, name=f"enqueue.retries_{mode}",
              lock_mode=mode, lock_ttl=300, lock_period=600 if mode == "until_expired" else None)  # fmt: skip
    def retries(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            recorder(app).wait_gate(x)
            raise self.retry(countdown=0)
        return x

    x, client = fresh(), recorder(app).client
    key = task_lock_key(retries, (x,))
    first = retries.delay(x)
    header = {HEADER: {"key": key, "token": stored(client, key)[:32].decode()}}
    with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock.busy"):
        wait_for(lambda: attempts_started(app, 0))
        retries.apply_async((x,), task_id=first.id, headers=header)  # the message again
        wait_for(lambda: stored(client, key)[32:33] != b":", what="the copy to watch the hold")
        recorder(app).open_gate(x)
        # Well within the copy's watch of a live run (lock_ttl/3: 100 s): woken by the park.
        wait_for(lambda: "its first delivery" in caplog.text, timeout=60, what="the copy to decide")
        assert "redelivered once its first delivery handed lock" in caplog.text
        assert "redelivered while its first delivery runs" not in caplog.text
        assert first.get(timeout=RESULT_TIMEOUT) == x
    assert [len(attempts_started(app, attempt)) for attempt in (0, 1)] == [1, 1]
    fences = {event[0]: int(event[5]) for event in recorder(app).events() if event[0].startswith("attempt@")}
    assert fences["attempt@1"] > fences["attempt@0"]
    if mode == "until_expired":
        kept = parse_value(stored(client, key))
        assert kept is not None and kept.kept and parse_holder(kept.holder)["try"] == "1"
        client.delete(key)
    else:
        wait_for(lambda: not client.exists(key), what="the retry to release")


def test_a_soft_time_limit_as_a_watching_copy_leaves_the_queue_ends_the_copy(
    app: Celery, caplog: pytest.LogCaptureFixture, interrupt_read: Arm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above (``until_executed``): the copy, woken by its first delivery's park, leaves the
    waiter queue (``OneServer.abandon``), and a soft time limit lands as that reply is read. The
    copy's run ends with the limit (``task_failure``), not logged as a failure to leave the queue
    while the copy went on to its decision; the retry adopts the hold and runs, once, and the
    lock goes."""

    @app.task(base=LockedTask, bind=True, shared=False, name="enqueue.retries_interrupted_copy",
              lock_mode="until_executed", lock_ttl=300)  # fmt: skip
    def retries(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            recorder(app).wait_gate(x)
            raise self.retry(countdown=0)
        return x

    x, client = fresh(), recorder(app).client
    key = task_lock_key(retries, (x,))
    client.script_load(RELEASE.source)  # the interrupted read is the release's own reply
    leaving, abandon = threading.local(), OneServer.abandon

    def leave(self: OneServer, token: str, member: str) -> None:
        leaving.now = True
        try:
            abandon(self, token, member)
        finally:
            leaving.now = False

    monkeypatch.setattr(OneServer, "abandon", leave)
    fired = interrupt_read(lambda: getattr(leaving, "now", False), SoftTimeLimitExceeded)
    failed: list[type[BaseException]] = []

    def failure(sender: Any = None, exception: BaseException | None = None, **_: Any) -> None:
        if sender is not None and sender.name == retries.name and exception is not None:
            failed.append(type(exception))

    task_failure.connect(failure, weak=False)
    try:
        first = retries.delay(x)
        header = {HEADER: {"key": key, "token": stored(client, key)[:32].decode()}}
        with worker(app), caplog.at_level(logging.INFO, logger="celery_redislock"):
            wait_for(lambda: attempts_started(app, 0))
            retries.apply_async((x,), task_id=first.id, headers=header)  # the message again
            wait_for(lambda: stored(client, key)[32:33] != b":", what="the copy to watch the hold")
            recorder(app).open_gate(x)
            decided = "its first delivery"  # what the copy logs as it is ignored
            wait_for(lambda: failed or decided in caplog.text, what="the copy's run to end")
            assert failed == [SoftTimeLimitExceeded], caplog.text
            wait_for(lambda: attempts_started(app, 1), what="the retry to run")
            wait_for(lambda: not client.exists(key), what="the retry to release")
    finally:
        task_failure.disconnect(failure)
    assert fired
    assert "could not leave the waiter queue" not in caplog.text
    assert decided not in caplog.text
    assert [len(attempts_started(app, attempt)) for attempt in (0, 1)] == [1, 1]
