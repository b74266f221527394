"""A task's attempts and their locks: every retry runs, each attempt
owns its own hold, a resent script is recognised as its own, holders survive odd task ids, and
the adoption of an enqueue lock waits for replicas.

Real redis-servers, a real worker (threads pool, in-process); the suite's invariant checker
then finds no lock left.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery, chord, group
from celery.exceptions import Reject
from celery.signals import task_postrun, task_rejected, task_revoked
from redis.connection import AbstractConnection

from celery_redislock import LockedTask, RedisLock, RedisSemaphore, task_lock_key
from celery_redislock._permit_scripts import RELEASE_PERMIT
from celery_redislock._scripts import RELEASE, RENEW, Script
from celery_redislock._task_scripts import ADOPT, CLAIM, DECLINE, PARK, SETTLE
from celery_redislock.enqueue import give_up_ticket
from celery_redislock.inventory import read_lock, release_token
from celery_redislock.lock import companion_key
from celery_redislock.protocol import BEAT_HEADER, FRESH, HEADER, holder_for, parse_holder, parse_value
from celery_redislock.semaphore import release_permit_held_by
from celery_redislock.state import LockClient, app_state
from celery_redislock.testing import RedisServer
from tests.invariants import stored
from tests.taskapp import make_app, recorder
from tests.workers import WorkerProcess, runs_over, threads_worker, wait_for

RESULT_TIMEOUT = 30


def events(app: Celery, x: object) -> list[list[str]]:
    return [event for event in recorder(app).events() if event[2] == str(x)]


def attempts(app: Celery, x: object) -> list[str]:
    return [event[0] for event in events(app, x) if event[0].startswith("attempt@")]


def fresh() -> str:
    return uuid.uuid4().hex[:10]


# -- a retry is never swallowed ----------------------------------------------------------------------


PATHS = [
    "delay",
    "send_task",
    "beat_fallback",
    "on_error_run",
    "group",
    "chord",
    "autoretry",
    "in_canvas",
    "apply",
]


@pytest.mark.parametrize("path", PATHS)
def test_every_retry_path_runs_its_next_attempt(
    app: Celery, prefix: str, path: str, refused_port: int
) -> None:
    """An ``until_executed`` task that retries once runs its second attempt, whatever path sent
    its first: ``delay`` (the message carries the enqueue lock), ``send_task`` and beat's
    ``send_task`` fallback (no lock in the message), a message sent unlocked because Redis was
    unreachable (``redislock_on_error="run"``), a group or chord member (not locked at enqueue),
    ``autoretry_for``, a canvas member opted in (``lock_in_canvas``), and ``apply()`` (eager:
    Celery runs the retry at once, in the same thread). Before, a retry of a
    message without the lock header was refused as a duplicate of its own attempt (nothing sent,
    the lock parked for an hour), and a canvas member's retry waited ``lock_wait_timeout`` for a
    hold it could not adopt, then failed the chord."""
    x = fresh()
    task = app.tasks["taskapp.autoretry_once" if path == "autoretry" else "taskapp.retry_once"]
    with threads_worker(app):
        if path in ("delay", "autoretry"):
            result = task.delay(x)
        elif path == "apply":
            result = task.apply((x,))
        elif path == "send_task":
            result = app.send_task(task.name, (x,))
        elif path == "beat_fallback":
            slot = {"entry": "e", "slot": "1", "key": f"{prefix}:slot:e:1", "token": uuid.uuid4().hex}
            header = {**slot, "ttl": 60_000, "beat": "beat=test", "claimed": False}
            result = app.send_task(task.name, (x,), headers={BEAT_HEADER: header})
        elif path == "on_error_run":
            unreachable = f"redis://127.0.0.1:{refused_port}/0"  # held by the test: refused
            sender = make_app(
                app.conf.broker_url,
                prefix,
                app.conf.task_default_queue,
                redislock_url=unreachable,
                redislock_on_error="run",
            )
            result = sender.tasks[task.name].delay(x)
        elif path == "group":
            result = group([task.s(x)]).apply_async()
        elif path == "chord":
            result = chord([task.s(x)])(app.tasks["taskapp.collect"].s())
        else:
            # celery-types lists only Celery's own options; Signature.set passes on any other
            result = group([task.s(x).set(lock_in_canvas=True)]).apply_async()  # type: ignore[call-arg]
        outcome = result.get(timeout=RESULT_TIMEOUT)
    assert outcome == ([x] if path in ("group", "chord", "in_canvas") else x)
    assert attempts(app, x) == ["attempt@0", "attempt@1"]
    assert not recorder(app).client.exists(task_lock_key(task, (x,)))


@pytest.mark.parametrize("how", ["apply", "always_eager"])
def test_an_until_expired_task_retried_eagerly_runs_its_next_attempt(app: Celery, how: str) -> None:
    """``apply()`` and ``task_always_eager`` run a retry at once, in the same thread, once the
    attempt has ended (Celery's ``apply``, not a message the attempt parks its hold for): the
    attempt kept its hold for ``lock_period`` as after any run, and its retry waited
    ``lock_wait_timeout`` for a hold parked for it, then failed with ``LockNotAcquired``."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="attempts.expiring_retry",
        lock_mode="until_expired",
        lock_period=60,
        lock_wait_timeout=5,
    )
    def expiring_retry(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return x

    x = fresh()
    key = task_lock_key(expiring_retry, (x,))
    if how == "always_eager":
        app.conf.task_always_eager = True
        result = expiring_retry.delay(x)
    else:
        result = expiring_retry.apply((x,))
    assert result.get(timeout=RESULT_TIMEOUT) == x
    assert attempts(app, x) == ["attempt@0", "attempt@1"]
    assert 0 < recorder(app).client.pttl(key) <= 60_000  # kept for lock_period after the last run
    recorder(app).client.delete(key)


@pytest.mark.parametrize(
    ("mode", "duplicate", "held_by", "sent", "how"),
    [
        (mode, duplicate, held_by, "send_task", "args")
        for mode in ("until_executed", "until_expired")
        for duplicate in ("return", "raise")
        for held_by in ("queued", "running")
    ]
    + [
        (mode, "return", "running", "send_task", "kwargs_countdown")
        for mode in ("until_executed", "until_expired")
    ]
    + [(mode, "raise", "running", "delay", "args") for mode in ("until_executed", "until_expired")],
)
def test_a_retry_with_arguments_of_a_held_key_is_sent_and_meets_lock_busy(
    app: Celery, mode: str, duplicate: str, held_by: str, sent: str, how: str
) -> None:
    """An attempt retries with other arguments (``self.retry(args=...)``, or ``kwargs=`` with a
    countdown) whose key another message holds, queued or running. The retry continues a message
    already sent: it is sent whatever ``lock_duplicate`` says, and its worker finds the key held
    (``lock_busy="skip"``: it succeeds with ``None``). Before, the retry of a first attempt sent
    without an enqueue lock (``send_task``) was refused at enqueue as a duplicate: with
    ``"return"`` nothing was sent while Celery took it for sent (``RETRY`` forever); with
    ``"raise"``, Celery rejected the message for the ``DuplicateTask`` (``FAILURE``:
    ``Reject(DuplicateTask(...))``), the retry never run. (The retry of one sent with ``delay``
    passed, on the enqueue lock header it inherits from its attempt, whose key it is not.) The
    attempt's own hold goes as after any run: released, or kept for ``lock_period``."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="attempts.moves_on",
        lock_mode=mode,
        lock_duplicate=duplicate,
        lock_on=("x", "n"),
        lock_period=60 if mode == "until_expired" else None,  # the only mode with one
    )
    def moves_on(self: Any, x: str, n: int = 0, gate: bool = False) -> int:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if n == 0 and how == "args":
            raise self.retry(args=(x, 1), countdown=0)
        if n == 0:
            raise self.retry(kwargs={"n": 1}, countdown=1)
        if gate:
            recorder(app).wait_gate(x)
        return n

    x, client = fresh(), recorder(app).client
    first_key, next_key = task_lock_key(moves_on, (x, 0)), task_lock_key(moves_on, (x, 1))
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it
    # One thread for the first attempt: its retry runs once it has stored RETRY (Celery checks,
    # then writes: a RETRY stored after the retry's SUCCESS would stand).
    with threads_worker(app, concurrency=1 if held_by == "queued" else 2):
        if held_by == "queued":
            other = moves_on.apply_async((x, 1), queue=idle)
        else:
            other = moves_on.delay(x, 1, gate=True)
            wait_for(lambda: [e for e in events(app, x) if e[3] == other.id], what="the other to run")
        first = moves_on.delay(x) if sent == "delay" else app.send_task(moves_on.name, (x,))
        wait_for(first.ready, timeout=RESULT_TIMEOUT, what=lambda: f"the retry to end (state {first.state})")
        assert first.get(timeout=RESULT_TIMEOUT) is None  # the retry met the other's hold: skipped
        if held_by == "running":
            recorder(app).open_gate(x)
            assert other.get(timeout=RESULT_TIMEOUT) == 1
    ran = [
        (e[0], e[6])
        for e in events(app, x)
        if e[3] == first.id and e[0] in ("attempt@0", "attempt@1", "busy")
    ]
    assert ran == [("attempt@0", "0"), ("busy", "1")]
    if mode == "until_expired":  # both kept for lock_period after their run
        assert 0 < client.pttl(first_key) <= 60_000
        client.delete(first_key)
    assert not client.exists(first_key)
    if held_by == "queued" or mode == "until_expired":
        assert client.exists(next_key)
        client.delete(next_key, idle)


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_retry_with_arguments_of_a_free_key_holds_it_while_it_waits(app: Celery, mode: str) -> None:
    """An attempt of a message sent with ``delay`` retries with other arguments, whose key is
    free; the retry waits (here in a queue no worker consumes). It must hold that key's enqueue
    lock meanwhile, its message carrying the ticket, so that a ``delay()`` of those arguments is
    refused as a duplicate of it, as one of a message sent by ``send_task`` was. Before, the
    retry inherited its attempt's enqueue lock header (the key of the attempt's arguments) and
    passed the enqueue check on it: nothing held the new key, and the ``delay()`` was sent
    beside the retry, to run the same arguments twice."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="attempts.moves_away",
        lock_mode=mode,
        lock_on=("x", "n"),
        lock_period=60 if mode == "until_expired" else None,
    )
    def moves_away(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if n == 0:
            raise self.retry(args=(x, 1), countdown=0, queue=idle)
        return n

    x, client = fresh(), recorder(app).client
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it
    first_key, next_key = task_lock_key(moves_away, (x, 0)), task_lock_key(moves_away, (x, 1))
    with threads_worker(app):
        first = moves_away.delay(x)
        wait_for(lambda: first.state == "RETRY", what="the retry to be sent")  # stored once let go
    held = parse_value(client.get(next_key))
    assert held is not None and parse_holder(held.holder)["task"] == first.id
    assert parse_holder(held.holder)["try"] == "1" and parse_holder(held.holder)["state"] == "queued"
    message = client.lindex(idle, 0)
    assert isinstance(message, bytes)
    ticket = json.loads(message)["headers"][HEADER]
    assert ticket == {"key": next_key, "token": held.token, FRESH: True}
    assert moves_away.delay(x, 1).id == first.id  # refused: the retry is queued
    assert client.llen(app.conf.task_default_queue) == 0
    client.delete(next_key, idle)
    if mode == "until_expired":  # kept for lock_period after its run
        client.delete(first_key)
    assert not client.exists(first_key)


@pytest.mark.parametrize("how", ["retry", "replace"])
@pytest.mark.parametrize("key", ["other", "same"])
def test_a_revoked_retry_or_replacement_frees_a_key_no_run_held_and_keeps_a_parked_one(
    app: Celery, how: str, key: str
) -> None:
    """``until_expired``: the task is revoked while attempt 0 runs; attempt 0 then retries (or
    replaces itself) and the worker drops that message as it arrives (``task_revoked``).

    * Other arguments (another key): the message took that key's enqueue lock afresh, which no
      run ever held: it is freed, as a revoked ``delay()``'s is. Before, it was given up as a
      hold parked by a run (``DECLINE``) and kept for ``lock_period`` from the send: no call of
      those arguments could run within the period, though none ran.
    * The same key: the hold attempt 0 parks for it is kept for what is left of the period
      (attempt 0 ran), as after any run."""
    started: list[str] = []
    dropped: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.revoked_{how}_{key}",
        lock_mode="until_expired",
        lock_on=("x", "n") if key == "other" else ("x",),
        lock_period=60,
    )
    def step(self: Any, x: str, n: int = 0) -> int:
        started.append(self.request.id)
        recorder(app).wait_gate(x)
        if how == "retry":
            raise self.retry(args=(x, 1), countdown=0)
        raise self.replace(step.si(x, 1))

    def revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
        if sender is not None and sender.name == step.name:
            dropped.append(request.id)

    x, client = fresh(), recorder(app).client
    first_key, next_key = task_lock_key(step, (x, 0)), task_lock_key(step, (x, 1))
    assert (first_key == next_key) == (key == "same")
    task_revoked.connect(revoked, weak=False)
    try:
        with threads_worker(app):
            first = step.delay(x)
            wait_for(lambda: started, what="attempt 0 to start")
            assert app.control.revoke(first.id, reply=True, limit=1, timeout=10), "the worker did not answer"
            recorder(app).open_gate(x)
            wait_for(lambda: dropped == [first.id], what="the worker to drop the revoked message")
            wait_for(lambda: runs_over(step.name), what="attempt 0 to let go")
    finally:
        task_revoked.disconnect(revoked)
    assert started == [first.id]
    assert 0 < client.pttl(first_key) <= 60_000, "attempt 0's key is not kept for its period"
    client.delete(first_key)
    assert not client.exists(next_key), f"left: {client.get(next_key)!r}, {client.pttl(next_key)} ms"


@pytest.mark.parametrize("when", ["before_the_park", "after_the_park"])
@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_rejected_retry_gives_the_hold_parked_for_it_up(app: Celery, mode: str, when: str) -> None:
    """Attempt 0 retries (the same key) with a serializer the worker does not accept (pickle): the
    worker rejects the retry's message as it arrives (``ContentDisallowed``: ``task_rejected``),
    before attempt 0 parks its hold for it (``retry(throw=False)``, attempt 0 going on until the
    test lets it end), or after (the message waits in a queue no worker consumes until the test
    moves it to the worker's). The hold is given up as for a revoked retry: ``until_executed``'s
    is freed, ``until_expired``'s kept for what is left of ``lock_period`` (attempt 0 ran).
    Before, the rejection freed the ticket as a first message's: an ``until_expired`` hold parked
    already went (a call of the arguments could run again within the period), and one not parked
    yet was parked by attempt 0 for the message that was gone, held for ``lock_queue_ttl``."""
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it
    started: list[str] = []
    rejected: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.rejected_{mode}_{when}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str) -> str:
        started.append(self.request.id)
        if when == "after_the_park":
            raise self.retry(countdown=0, serializer="pickle", queue=idle)
        self.retry(countdown=0, serializer="pickle", throw=False)
        recorder(app).wait_gate(x)
        return x

    def on_rejected(sender: Any = None, message: Any = None, **_: Any) -> None:
        if (message.headers or {}).get("task") == step.name:
            rejected.append(message.headers["id"])

    x, client = fresh(), recorder(app).client
    key = task_lock_key(step, (x,))
    task_rejected.connect(on_rejected, weak=False)
    try:
        with threads_worker(app):
            first = step.delay(x)
            wait_for(lambda: started, what="attempt 0 to start")
            if when == "after_the_park":
                wait_for(lambda: client.llen(idle) and runs_over(step.name), what="attempt 0 to park")
                parked = parse_value(client.get(key))
                assert parked is not None and parse_holder(parked.holder)["try"] == "1"
                client.lmove(idle, app.conf.task_default_queue, "RIGHT", "LEFT")
            # the package's receiver, connected before this one, has given the ticket up by then
            wait_for(lambda: rejected == [first.id], what="the worker to reject the retry's message")
            if when == "before_the_park":
                recorder(app).open_gate(x)
                wait_for(lambda: runs_over(step.name) and first.ready(), what="attempt 0 to end")
    finally:
        task_rejected.disconnect(on_rejected)
    assert started == [first.id]
    declined = list(client.scan_iter(match=companion_key(key, "declined:*")))
    try:
        if mode == "until_executed":
            assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"
            assert declined == []
        else:
            kept = parse_value(client.get(key))
            assert kept is not None and kept.kept, f"not kept: {client.get(key)!r}"
            assert 0 < client.pttl(key) <= 60_000, f"kept for {client.pttl(key)} ms"
    finally:
        client.delete(key, idle, *declined)


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_retry_a_worker_does_not_know_before_the_park_gives_the_hold_up(
    app: Celery, redis_server: RedisServer, prefix: str, mode: str
) -> None:
    """Attempt 0 retries (the same key) to a queue whose worker does not register the task (a
    rolling deploy: a worker of the release before the task existed): that worker drops the
    retry's message as unknown (``task_unknown``) before attempt 0 parks its hold for it
    (``retry(throw=False)``, attempt 0 going on until the test lets it end). The task's mode is
    unknown there, so the drop marks the retry's token declined, and the park lets go of the
    hold with the run's own mode: ``until_executed``'s is freed, ``until_expired``'s kept for
    what is left of ``lock_period``. Before, the drop freed the ticket owner-checked, which the
    hold not parked yet was not, and attempt 0 parked it for the message that was gone: held
    for ``lock_queue_ttl``, every call of the arguments refused meanwhile."""
    other_queue, client = f"q-{prefix}-other", recorder(app).client
    # tests.taskapp's app, which does not register the task below
    other = WorkerProcess(redis_server.url, f"{prefix}-other", other_queue, "solo", 1, "other")
    started: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.unknown_{mode}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str) -> str:
        started.append(self.request.id)
        self.retry(countdown=0, queue=other_queue, throw=False)
        recorder(app).wait_gate(x)
        return x

    x = fresh()
    key = task_lock_key(step, (x,))
    other.start()
    try:
        if client.blpop([f"{prefix}-other:ready"], timeout=60) is None:
            raise AssertionError(f"the other worker did not start:\n{other.output()}")
        with threads_worker(app):
            step.delay(x)
            wait_for(lambda: started, what="attempt 0 to start")
            other.wait_for_line(f"Received unregistered task of type '{step.name}'")
            marked = companion_key(key, "declined:*")
            wait_for(lambda: list(client.scan_iter(match=marked)), what="the drop to mark the retry declined")
            recorder(app).open_gate(x)
            wait_for(lambda: runs_over(step.name), what="attempt 0 to end")
    finally:
        other.stop()
    declined = list(client.scan_iter(match=companion_key(key, "declined:*")))
    try:
        if mode == "until_executed":
            assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"
            assert declined == []
        else:  # the mark lives as long as the kept hold: a park sent again keeps it again
            kept = parse_value(client.get(key))
            assert kept is not None and kept.kept, f"not kept: {client.get(key)!r}"
            assert 0 < client.pttl(key) <= 60_000, f"kept for {client.pttl(key)} ms"
    finally:
        client.delete(key, *declined)


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_retry_a_worker_does_not_know_after_the_park_gives_the_hold_up_as_its_run_would(
    app: Celery, redis_server: RedisServer, prefix: str, mode: str
) -> None:
    """Attempt 0 retries (the same key) and parks its hold for the retry, whose message waits in
    a queue no worker consumes until the test moves it to the queue of a worker that does not
    register the task (a rolling deploy), which drops it as unknown (``task_unknown``). The
    task's mode and period are unknown there; the parked hold names them (``period=<ms>`` in
    its holder, written by the park), and the drop lets go of it as the run would have:
    ``until_executed``'s is freed, ``until_expired``'s kept for what is left of
    ``lock_period`` (attempt 0 ran). Before, the drop freed it whatever the mode: an
    ``until_expired`` period cut short, a call of the arguments could run again within it."""
    idle, other_queue, client = (
        f"{app.conf.task_default_queue}-idle",
        f"q-{prefix}-other",
        recorder(app).client,
    )
    # tests.taskapp's app, which does not register the task below
    other = WorkerProcess(redis_server.url, f"{prefix}-other", other_queue, "solo", 1, "other")
    started: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.unknown_parked_{mode}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str) -> str:
        started.append(self.request.id)
        raise self.retry(countdown=0, queue=idle)

    x = fresh()
    key = task_lock_key(step, (x,))
    other.start()
    try:
        if client.blpop([f"{prefix}-other:ready"], timeout=60) is None:
            raise AssertionError(f"the other worker did not start:\n{other.output()}")
        with threads_worker(app):
            step.delay(x)
            wait_for(lambda: client.llen(idle) and runs_over(step.name), what="attempt 0 to park")
        parked = parse_value(client.get(key))
        assert parked is not None and parse_holder(parked.holder)["state"] == "queued"
        client.lmove(idle, other_queue, "RIGHT", "LEFT")
        other.wait_for_line(f"Received unregistered task of type '{step.name}'")
        wait_for(
            lambda: parse_value(client.get(key)) != parked,
            what=lambda: f"the drop to give the parked hold up: {client.get(key)!r}",
        )
    finally:
        other.stop()
    assert started == [parse_holder(parked.holder)["task"]]
    try:
        if mode == "until_executed":
            assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"
        else:
            kept = parse_value(client.get(key))
            assert kept is not None and kept.kept, f"not kept: {client.get(key)!r}"
            assert 0 < client.pttl(key) <= 60_000, f"kept for {client.pttl(key)} ms"
    finally:
        client.delete(key, idle)


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_retry_with_an_eta_that_is_no_time_is_not_sent_and_names_it(app: Celery, mode: str) -> None:
    """Attempt 0 retries (the same key) with ``eta="not a date"``. The retry is not sent, and the
    attempt fails with ``LockConfigurationError`` naming the task and ``eta`` (Celery's
    ``retry`` rejects the attempt for it, ``Reject(requeue=False)``); its hold goes as after any
    run: released, or kept for ``lock_period``; nothing else is left. Before, the retry was sent,
    then the eta was read to park the hold for it: a bare ``ValueError("Invalid isoformat
    string")`` failed the attempt, its hold not parked, the worker dropped the retry as an
    invalid message, and its token stayed marked declined for ``lock_queue_ttl``."""
    idle = f"{app.conf.task_default_queue}-idle"  # no worker consumes it

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.no_time_{mode}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        raise self.retry(eta="not a date", queue=idle)

    x, client = fresh(), recorder(app).client
    key = task_lock_key(step, (x,))
    with threads_worker(app):
        first = step.delay(x)
        wait_for(lambda: first.ready() and runs_over(step.name), what="attempt 0 to end")
    assert first.state == "FAILURE"
    assert f"LockConfigurationError(\"task {step.name!r}: eta='not a date' is not valid" in repr(first.result)
    assert client.llen(idle) == 0, "the retry was sent"
    assert attempts(app, x) == ["attempt@0"]
    declined = list(client.scan_iter(match=companion_key(key, "declined:*")))
    try:
        assert declined == []
        if mode == "until_executed":
            assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"
        else:
            kept = parse_value(client.get(key))
            assert kept is not None and kept.kept, f"not kept: {client.get(key)!r}"
    finally:
        client.delete(key, idle, *declined)


@pytest.mark.parametrize("sent", ["retry", "delay"])
@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_an_eta_celerys_worker_reads_is_read_alike(app: Celery, mode: str, sent: str) -> None:
    """An ``eta`` string that Celery's worker reads (``dateutil``'s ``isoparse``) but
    ``datetime.fromisoformat`` does not: ``"2020-01-01T24:00:00"`` (midnight, the next day; past,
    so due at once), given to attempt 0's retry of the same key, or to ``apply_async``. It is
    read as the worker reads it: the attempt parks its hold for its retry, which adopts it and
    runs. Before, the retry was sent, then the eta read failed (``ValueError('hour must be in
    0..23')``): attempt 0 failed, its hold not parked, and its retry, which ran, met it kept
    (``until_expired``: waited ``lock_wait_timeout``, then ``LockNotAcquired``) or took the lock
    afresh; and ``apply_async`` refused the eta (``LockConfigurationError``)."""
    eta = "2020-01-01T24:00:00"

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.late_midnight_{mode}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
    )
    def step(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if sent == "retry" and self.request.retries == 0:
            raise self.retry(eta=eta)
        return x

    x, client = fresh(), recorder(app).client
    key = task_lock_key(step, (x,))
    with threads_worker(app):
        result = step.apply_async((x,), eta=eta) if sent == "delay" else step.delay(x)
        assert result.get(timeout=RESULT_TIMEOUT) == x
        wait_for(lambda: runs_over(step.name), what="the last attempt to let go")
    assert attempts(app, x) == (["attempt@0", "attempt@1"] if sent == "retry" else ["attempt@0"])
    if mode == "until_expired":
        kept = parse_value(client.get(key))
        assert kept is not None and kept.kept, f"not kept: {client.get(key)!r}"
        assert parse_holder(kept.holder)["try"] == ("1" if sent == "retry" else "0")
        client.delete(key)
    assert not client.exists(key), f"left: {client.get(key)!r}, {client.pttl(key)} ms"


def test_a_retry_back_to_arguments_kept_for_their_period_meets_lock_busy(app: Celery) -> None:
    """``until_expired``: attempt 0 (key 1) retries with other arguments (key 2), and attempt 1
    retries back to the first ones while attempt 0's run keeps key 1 for ``lock_period``. That
    hold's run is over: attempt 2 is a run of key 1 within its period, and meets it as any call
    of those arguments does, with ``lock_busy`` (``"skip"``: it succeeds with ``None``), at once.
    Before, it was taken for the run it continues letting go: it waited ``lock_wait_timeout``
    for a hold nothing frees before the period ends, then failed with ``LockNotAcquired``."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="attempts.comes_back",
        lock_mode="until_expired",
        lock_on=("x", "n"),
        lock_period=60,
        lock_wait_timeout=60,  # waited for, the test times out first
    )
    def comes_back(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries < 2:
            raise self.retry(args=(x, 1 - n), countdown=0)
        return n

    x, client = fresh(), recorder(app).client
    first_key, next_key = task_lock_key(comes_back, (x, 0)), task_lock_key(comes_back, (x, 1))
    with threads_worker(app):
        first = comes_back.delay(x)
        wait_for(
            lambda: [e for e in events(app, x) if e[0] == "busy"],
            timeout=RESULT_TIMEOUT,
            what=lambda: f"attempt 2 to meet key 1 kept; events {events(app, x)}",
        )
        assert first.get(timeout=RESULT_TIMEOUT) is None  # skipped
    ran = [(e[0], e[6]) for e in events(app, x) if e[0] in ("attempt@0", "attempt@1", "attempt@2", "busy")]
    assert ran == [("attempt@0", "0"), ("attempt@1", "1"), ("busy", "2")]
    for key, attempt in ((first_key, "0"), (next_key, "1")):  # each kept by the attempt that ran it
        kept = parse_value(client.get(key))
        assert kept is not None and kept.kept and parse_holder(kept.holder)["try"] == attempt
    client.delete(first_key, next_key)


@pytest.mark.parametrize("ends", ["kept", "period_over"])
def test_a_retry_back_to_arguments_whose_attempt_still_runs_meets_how_it_ends(app: Celery, ends: str) -> None:
    """``until_expired``: attempt 0 (key 1) sends its retry with other arguments (key 2) with
    ``retry(throw=False)`` and goes on running; attempt 1 retries back to the first arguments,
    and attempt 2 finds key 1 still held by attempt 0's run, which it waits for as for the run
    it continues letting go. Then attempt 0 ends:

    * ``kept``: within ``lock_period``, it keeps key 1 for the rest of it. Attempt 2 is a run of
      key 1 within its period, woken by the keep, and meets it as any call of those arguments
      does, with ``lock_busy`` (``"skip"``: it succeeds with ``None``). Before, it waited
      ``lock_wait_timeout`` for a hold nothing frees before the period ends, then failed with
      ``LockNotAcquired``.
    * ``period_over``: past its period (the test waits for the server clock to pass it), it
      releases key 1, which attempt 2 takes, with a fence above attempt 0's, and runs."""
    ended: list[tuple[int, str, Any]] = []
    period = 60 if ends == "kept" else 1

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.comes_back_early_{ends}",
        lock_mode="until_expired",
        lock_on=("x", "n"),
        lock_period=period,
        lock_wait_timeout=60,  # waited for, the test times out first
    )
    def comes_back_early(self: Any, x: str, n: int = 0) -> int:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            self.retry(args=(x, 1), countdown=0, throw=False)
            recorder(app).wait_gate(x)
        elif self.request.retries == 1:
            raise self.retry(args=(x, 0), countdown=0)
        return n

    def on_postrun(sender: Any = None, state: str = "", retval: Any = None, **_: Any) -> None:
        if sender is not None and sender.name == comes_back_early.name:
            ended.append((sender.request.retries, state, retval))

    def server_us() -> int:
        seconds, micros = client.time()
        return int(seconds) * 1_000_000 + int(micros)

    x, client = fresh(), recorder(app).client
    first_key, next_key = task_lock_key(comes_back_early, (x, 0)), task_lock_key(comes_back_early, (x, 1))
    task_postrun.connect(on_postrun, weak=False)
    try:
        with threads_worker(app):
            comes_back_early.delay(x)
            wait_for(
                lambda: [e for e in events(app, x) if e[0] == "busy" and e[6] == "2"],
                timeout=RESULT_TIMEOUT,
                what=lambda: f"attempt 2 to find key 1 held by attempt 0; events {events(app, x)}",
            )
            if ends == "period_over":  # a hold's fence is the server time of its grant, in µs
                first_fence = int(events(app, x)[0][5])
                wait_for(lambda: server_us() > first_fence + period * 1_000_000, what="the period to pass")
            recorder(app).open_gate(x)  # attempt 0 ends
            wait_for(
                lambda: [e for e in ended if e[0] == 2],
                timeout=RESULT_TIMEOUT,
                what=lambda: f"attempt 2 to end; ended {ended}, key 1 {client.get(first_key)!r}",
            )
            wait_for(lambda: runs_over(comes_back_early.name), what="every attempt to let go")
    finally:
        task_postrun.disconnect(on_postrun)
    if ends == "period_over":
        assert [e for e in ended if e[0] == 2] == [(2, "SUCCESS", 0)]
        assert attempts(app, x) == ["attempt@0", "attempt@1", "attempt@2"]
        fences = {e[6]: int(e[5]) for e in events(app, x) if e[0].startswith("attempt@")}
        assert fences["2"] > fences["0"]
    else:
        assert [e for e in ended if e[0] == 2] == [(2, "SUCCESS", None)]  # skipped
        assert attempts(app, x) == ["attempt@0", "attempt@1"]
        for key, attempt in ((first_key, "0"), (next_key, "1")):  # each kept by the attempt that ran it
            kept = parse_value(client.get(key))
            assert kept is not None and kept.kept and parse_holder(kept.holder)["try"] == attempt
    client.delete(first_key, next_key)


@pytest.mark.parametrize("how", ["apply", "task_always_eager"])
def test_an_eager_retry_with_other_arguments_leaves_the_attempts_key_kept_for_its_period(
    app: Celery, how: str
) -> None:
    """``until_expired`` under ``apply()`` (or ``task_always_eager``): an attempt retries with
    other arguments, which ``apply()`` runs next in the same thread. The attempt's key is kept
    for ``lock_period`` after its run, as after any run, and as a worker does: only a retry of
    the same key, which takes the lock again at once, lets go of it. Before, every eager retry
    let go, and the attempt's key was free at once (PTTL -2)."""
    x, client, moves_on = fresh(), recorder(app).client, app.tasks["taskapp.moves_on"]
    first_key, next_key = task_lock_key(moves_on, (x, 0)), task_lock_key(moves_on, (x, 1))
    if how == "apply":
        assert moves_on.apply((x,)).get() == 1
    else:
        app.conf.task_always_eager = True
        assert moves_on.delay(x).get() == 1
    assert 0 < client.pttl(first_key) <= 60_000
    assert 0 < client.pttl(next_key) <= 60_000
    client.delete(first_key, next_key)


# -- each attempt owns its own hold -------------------------------------------------------------------


def test_a_stale_attempt_cannot_adopt_the_hold_parked_for_the_next(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Attempt 0 retries (countdown 60 s) and parks its hold for attempt 1. A copy of attempt 0's
    message arrives meanwhile (a redelivery: same id, attempt and lock header). It must not adopt
    the hold parked for attempt 1, nor run: before, every attempt shared the enqueue token and
    ADOPT took any queued hold, so the stale copy ran attempt 0 again."""
    caplog.set_level(logging.INFO, logger="celery_redislock")
    x, task = fresh(), app.tasks["taskapp.retry_once"]
    key = task_lock_key(task, (x,), {"countdown": 60})
    client = recorder(app).client
    first = task.delay(x, countdown=60)
    enqueue_token = stored(client, key)[:32].decode()
    with threads_worker(app):
        wait_for(lambda: parse_holder(stored(client, key).decode().split(":", 2)[2]).get("try") == "1")
        # celery-types types headers as str to str; Celery sends any JSON value
        header = {HEADER: {"key": key, "token": enqueue_token}}
        task.apply_async((x,), {"countdown": 60}, task_id=first.id, headers=header)  # type: ignore[arg-type]
        wait_for(
            lambda: "this stale copy is ignored" in caplog.text,
            what=lambda: f"the stale copy to be ignored; events {events(app, x)}",
        )
    assert attempts(app, x) == ["attempt@0"]
    value = stored(client, key).decode()
    assert value[:32] != enqueue_token  # parked for attempt 1, under its own token
    client.delete(key)  # attempt 1 waits out its countdown; let it go


def test_copies_of_an_until_expired_tasks_attempts_are_ignored_while_its_lock_is_kept(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """``until_expired``: attempt 0 retries, attempt 1 adopts the hold parked for it, runs, and
    keeps it for ``lock_period``. A copy of either attempt's message arrives then (a redelivery:
    same id, attempt and lock header): attempt 0's finds a later attempt's hold (a stale copy),
    attempt 1's its own run's hold, kept for the period; both are ignored at once, and the body
    does not run again within the period."""
    caplog.set_level(logging.INFO, logger="celery_redislock")

    @app.task(base=LockedTask, bind=True, shared=False, name="attempts.kept_retry",
              lock_mode="until_expired", lock_period=600)  # fmt: skip
    def kept_retry(self: Any, x: str) -> str:
        recorder(app).record(f"attempt@{self.request.retries}", self, x)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return x

    x, client = fresh(), recorder(app).client
    key = task_lock_key(kept_retry, (x,))
    first = kept_retry.delay(x)
    header = {HEADER: {"key": key, "token": stored(client, key)[:32].decode()}}

    def deliver_again(attempt: int, ignored: str) -> None:
        kept_retry.apply_async((x,), task_id=first.id, retries=attempt, headers=header)
        wait_for(lambda: ignored in caplog.text, what=lambda: f"{ignored!r} logged; events {events(app, x)}")

    with threads_worker(app):
        assert first.get(timeout=RESULT_TIMEOUT) == x
        kept = parse_value(stored(client, key))
        assert kept is not None and kept.kept and parse_holder(kept.holder)["try"] == "1"
        deliver_again(0, "this stale copy is ignored")
        deliver_again(1, "redelivered once its first delivery ran")
    assert attempts(app, x) == ["attempt@0", "attempt@1"]
    assert parse_value(stored(client, key)) == kept  # untouched
    client.delete(key)


@pytest.mark.parametrize(
    ("how", "where"), [("no_throw", "single"), ("catch", "single"), ("no_throw", "cluster")]
)
def test_an_attempt_that_goes_on_after_its_retry_never_overlaps_the_next(
    request: pytest.FixtureRequest, app: Celery, prefix: str, how: str, where: str
) -> None:
    """``self.retry(throw=False)``, or a body that catches the ``Retry``, publishes attempt 1
    while attempt 0 still runs. Attempt 1 must wait for attempt 0 to let go (woken by its
    park), then hold the lock with a token of its own and a greater fence, and attempt 0's
    token can neither release nor renew attempt 1's hold. Before, attempt 1 adopted the running
    hold at once (both ran, one fence), and attempt 0's release deleted attempt 1's lock.
    The same on a Redis Cluster (the waiter's queue and wake list in the lock's slot)."""
    client: Any = recorder(app).client
    if where == "cluster":
        cluster = request.getfixturevalue("cluster")
        app = make_app(app.conf.broker_url, prefix, app.conf.task_default_queue, redislock_url=cluster.url)
        client = cluster.client()
    x, task = fresh(), app.tasks["taskapp.retry_once"]
    key = task_lock_key(task, (x,), {"how": how, "gate1": True})
    with threads_worker(app):
        task.delay(x, how=how, gate1=True)  # both attempts store a result: events tell them apart
        wait_for(lambda: attempts(app, x), what="attempt 0 to start")
        first_token = client.get(key)[:32]
        wait_for(
            lambda: [e for e in events(app, x) if e[0] == "busy" and e[6] == "1"],
            timeout=10,
            what=lambda: f"attempt 1 to find attempt 0 running; events {events(app, x)}",
        )
        recorder(app).open_gate(x)
        # Within 10 s, a third of the 30 s lease: woken by the park, not by a wait running out.
        wait_for(lambda: len(attempts(app, x)) == 2, timeout=10, what="attempt 1 to start")
        value = client.get(key)
        assert value is not None and value[:32] != first_token
        assert parse_holder(value.decode().split(":", 2)[2])["try"] == "1"
        assert RENEW(client, [key], [600_000, first_token.decode()]) == [1]  # not owned
        assert RELEASE(client, [key], [first_token.decode()]) == 0
        assert client.get(key) == value
        recorder(app).open_gate(f"{x}-1")
        wait_for(lambda: not client.exists(key), what="attempt 1 to end and release")
    kinds = [
        (event[0], event[6]) for event in events(app, x) if event[0] in ("attempt@0", "attempt@1", "end")
    ]
    assert kinds == [("attempt@0", "0"), ("end", "0"), ("attempt@1", "1"), ("end", "1")]
    fences = {event[6]: int(event[5]) for event in events(app, x) if event[0].startswith("attempt@")}
    assert fences["1"] > fences["0"]
    assert not client.exists(key, companion_key(key, "queue"), companion_key(key, "waiters"))
    if where == "cluster":
        client.close()
        app.close()


# -- a resent script, odd task ids, replicas -----------------------------------------------------------


@contextmanager
def first_reply_lost(script: Script, then: Callable[[], None] | None = None) -> Iterator[list[Any]]:
    """The first reply to ``script`` is lost after the script ran: the connection reads it,
    then fails as a dropped connection does, so that the client's retry policy (redis-py 6+
    retries by default) sends the script again; ``then()`` runs in between (what happens
    before the resend). Yields the lost replies."""
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response
    guard = threading.Lock()
    pending: set[AbstractConnection] = set()  # connections awaiting the doomed reply
    lost: list[Any] = []

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        packed = b"".join(command) if isinstance(command, list) else command
        with guard:
            if not lost and not pending and script.sha.encode() in packed:
                pending.add(self)
        send(self, command, check_health)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = read(self, *args, **kwargs)
        with guard:
            if self not in pending:
                return reply
            pending.discard(self)
            lost.append(reply)
        if then is not None:
            then()
        raise redis.ConnectionError("the reply was lost (test seam)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AbstractConnection, "send_packed_command", send_packed_command)
        patch.setattr(AbstractConnection, "read_response", read_response)
        yield lost


def test_a_resent_adopt_is_recognised_as_its_own(redis_server: RedisServer, prefix: str) -> None:
    """The worker's ADOPT runs, its reply is lost, and the client sends it again. The second
    run must see the hold as this run's own, not as a redelivered twin's: before, it found the
    hold running under the same attempt, took the message for its own twin, and watched the
    lease run out before running (logged as "its first delivery's worker died")."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=3)
    # The lock client retries as redis-py 6+ clients built with redis.Redis(...) do by default
    # (a client from a URL does not): this in-process worker uses it.
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert (retry := retrying.get_retry()) is not None and retry.get_retries() > 0
    app_state(app).client = LockClient(os.getpid(), retrying, redis_server.url, False)
    x, task = fresh(), app.tasks["taskapp.until_executed"]
    result = task.delay(x)
    with first_reply_lost(ADOPT) as lost, threads_worker(app):
        assert result.get(timeout=RESULT_TIMEOUT) == x
    assert len(lost) == 1
    assert [event[0] for event in events(app, x)] == ["start", "end", "released"]  # no "busy"
    app.close()
    retrying.close()


def test_a_resent_slot_claim_is_recognised_as_its_own(redis_server: RedisServer, prefix: str) -> None:
    """A beat slot's message claims its slot on the worker (``CLAIM``); the reply is lost, and the
    client sends the claim again. The second must find the slot its own: it found the marker
    naming its own task id and attempt, took itself for a copy of its message, and the slot's
    only run was ignored."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)  # retries, as redis-py 6+ does
    app_state(app).client = LockClient(os.getpid(), retrying, redis_server.url, False)
    x, task = fresh(), app.tasks["taskapp.hold_skip"]
    slot = {"entry": "e", "slot": "1", "key": f"{prefix}:slot:e:1", "token": uuid.uuid4().hex}
    header = {**slot, "ttl": 60_000, "beat": "beat=test", "claimed": True}
    retrying.script_load(CLAIM.source)  # the claim's first reply lost, not its loading's
    result = app.send_task(task.name, (x,), headers={BEAT_HEADER: header})
    with first_reply_lost(CLAIM) as lost, threads_worker(app):
        assert result.get(timeout=RESULT_TIMEOUT) == x
    assert len(lost) == 1
    assert [event[0] for event in events(app, x)] == ["start", "end", "released"]
    app.close()
    retrying.close()


def test_a_resent_settle_is_recognised_as_its_own(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``until_expired``: the run's SETTLE runs, its reply is lost, and the client sends it again.
    The first run kept the hold for the period under no token (``KEPT_TOKEN``); the second
    must see it as this run's own (its fence), and keep it again: not as a hold lost, which
    the run would report and then try to release."""
    caplog.set_level(logging.INFO, logger="celery_redislock")
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_ttl=3)
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)  # retries, as in the test above
    app_state(app).client = LockClient(os.getpid(), retrying, redis_server.url, False)
    x, task = fresh(), app.tasks["taskapp.until_expired"]
    key = task_lock_key(task, (x,))
    retrying.script_load(SETTLE.source)  # the reply lost is SETTLE's, not that of its loading
    result = task.delay(x)
    with first_reply_lost(SETTLE) as lost, threads_worker(app):
        assert result.get(timeout=RESULT_TIMEOUT) == x
    assert len(lost) == 1 and lost[0] > 3000  # kept for the period by the first run
    kept = parse_value(stored(retrying, key))
    assert kept is not None and kept.kept and kept.fence == int(events(app, x)[0][5])
    assert 3000 < retrying.pttl(key) <= 600_000
    assert "no longer held" not in caplog.text
    retrying.delete(key)
    app.close()
    retrying.close()


def test_a_hold_is_never_parked_for_a_declined_token(client: redis.Redis, prefix: str) -> None:
    """A retry that failed before adopting (``DECLINE``) and the park of its previous attempt
    (``PARK``), in either order: the hold goes, the marker too, and a waiter queued for the lock
    is woken by the park's free, as by a release."""
    key, running, retry = f"{prefix}:declined", "a" * 32, "b" * 32
    holder, queued = "task=t try=0 state=running", "task=t try=1 state=queued"
    marker = companion_key(key, f"declined:{retry}")

    # declined first: marked, and the park frees the hold instead, waking the waiter; the
    # retry's own place in the queue (a waiter that died) and its wake list go at once
    client.set(key, f"{running}:1:{holder}", px=30_000)
    dead = f"30000:{retry}:0:task=t try=1 state=running"
    client.zadd(companion_key(key, "queue"), {dead: 1})
    client.zadd(companion_key(key, "waiters"), {dead: time.time() * 1000 + 60_000})
    client.rpush(companion_key(key, f"wake:{retry}"), "retry")
    client.pexpire(companion_key(key, f"wake:{retry}"), 60_000)
    assert DECLINE(client, [key], [retry, 60_000, 0]) == 0
    assert not client.exists(*(companion_key(key, name) for name in ("queue", "waiters", f"wake:{retry}")))
    assert 0 < client.pttl(marker) <= 60_000
    waiter = RedisLock(client, key, ttl=60)  # it would look again only after a third of that
    got: list[float] = []

    def wait() -> None:
        if waiter.acquire(timeout=120):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    wait_for(lambda: client.zcard(companion_key(key, "queue")), what="the waiter to queue")
    parked = time.monotonic()
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 0]) == 2
    thread.join(timeout=60)
    assert got and got[0] - parked < 10 and waiter.owned()  # woken by the park, not by looking again
    assert not client.exists(marker)
    waiter.release()
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 0]) == 0  # resent: no-op
    assert not client.exists(key)

    # parked first: the decline frees the parked hold
    client.set(key, f"{running}:2:{holder}", px=30_000)
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 0]) == 1
    assert DECLINE(client, [key], [retry, 60_000, 0]) == 2
    assert not client.exists(key, marker)

    # with a period (until_expired): kept for what is left of it after the grant, then freed
    now_us = int(client.time()[0]) * 1_000_000
    client.set(key, f"{running}:{now_us - 20_000_000}:{holder}", px=30_000)  # granted 20 s ago
    assert DECLINE(client, [key], [retry, 60_000, 0]) == 0
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 50_000]) == 3
    assert 25_000 < client.pttl(key) <= 30_000  # 50 s after the grant
    both = client.pipeline(transaction=True)  # read at one instant: two reads are ms apart
    both.pttl(marker)
    both.pttl(key)
    marker_ttl, key_ttl = both.execute()
    assert 0 < marker_ttl <= key_ttl  # as long as the hold: a resend keeps it too
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 50_000]) == 3  # resent
    assert 25_000 < client.pttl(key) <= 30_000
    client.delete(marker)
    client.set(key, f"{running}:{now_us - 20_000_000}:{holder}", px=30_000)
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 10_000]) == 1
    assert DECLINE(client, [key], [retry, 60_000, 10_000]) == 2  # the period is over: freed
    assert not client.exists(key, marker)

    # parked, then declined inside the period: kept, owned by no message any more, so that no
    # copy of the retry's message (delivered again) can adopt it and run within the period
    client.set(key, f"{running}:{now_us - 20_000_000}:{holder}", px=30_000)
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 50_000]) == 1
    assert DECLINE(client, [key], [retry, 60_000, 50_000]) == 3
    assert 25_000 < client.pttl(key) <= 30_000
    kept = parse_value(client.get(key))
    assert kept is not None and kept.token not in (running, retry) and kept.fence == now_us - 20_000_000
    refused = ADOPT(client, [key], [retry, "c" * 32, 60_000, holder])
    assert isinstance(refused, list) and refused[1] == queued.encode()  # busy, the holder kept
    assert not release_token(client, key, retry)
    client.delete(key)


def test_adopt_takes_over_only_a_hold_kept_by_an_earlier_attempt_of_its_task_id(
    client: redis.Redis, prefix: str
) -> None:
    """``ADOPT`` of a retry's or replacement's ticket whose hold its previous attempt kept for
    ``lock_period`` instead of parking it (an interrupt between the retry's send and the run's
    record of it): the message takes it over (its own token, a fence above the kept one, its
    holder, the lock's ttl), as it would have adopted it parked. Not a hold kept by the same
    attempt (a copy of a message whose first delivery ran and kept it), by a later one (a stale
    copy), by another task id's run, nor one whose ticket the message declined (``DECLINE``:
    it failed before adopting, and the park let go of the hold): those are refused, the hold
    untouched."""
    key, ticket, own = f"{prefix}:kept", "b" * 32, "c" * 32
    granted = int(client.time()[0]) * 1_000_000 - 20_000_000

    def kept_by(holder: str) -> bytes:
        value = f"{'0' * 32}:{granted}:{holder}"
        client.set(key, value, px=40_000)
        return value.encode()

    def adopt(attempt: str) -> Any:
        return ADOPT(client, [key], [ticket, own, 30_000, f"task=t {attempt} state=running node=n pid=2"])

    refusals = [
        ("try=1", "task=t try=1 state=running node=n pid=1"),  # the same attempt
        ("try=1", "task=t try=1 state=queued node=n pid=1 period=60000"),  # parked for it, declined
        ("try=1", "task=t try=2 state=running node=n pid=1"),  # a later retry
        ("try=0 rep=1", "task=t try=0 state=running node=n pid=1 rep=1"),  # the same replacement
        ("try=3", "task=t try=0 state=running node=n pid=1 rep=1"),  # a deeper replacement
        ("try=1", "task=u try=0 state=running node=n pid=1"),  # another task id
        ("try=1", "task=t2 try=0 state=running node=n pid=1"),
        ("try=1", "t:1"),  # not a task's holder
    ]
    for attempt, holder in refusals:
        value = kept_by(holder)
        refused = adopt(attempt)
        assert isinstance(refused, list) and refused[1] == holder.encode(), (attempt, holder, refused)
        assert client.get(key) == value and 30_000 < client.pttl(key) <= 40_000

    declined = companion_key(key, f"declined:{ticket}")
    client.set(declined, "1", px=40_000)
    value = kept_by("task=t try=0 state=running node=n pid=1")
    assert isinstance(adopt("try=1"), list) and client.get(key) == value
    client.delete(declined)

    for attempt, holder in [
        ("try=1", "task=t try=0 state=running node=n pid=1"),  # the retry of the attempt that kept it
        ("try=0 rep=1", "task=t try=4 state=running node=n pid=1"),  # a replacement
        ("try=1 rep=1", "task=t try=0 state=running node=n pid=1 rep=1"),  # a replacement's retry
    ]:
        kept_by(holder)
        fence = adopt(attempt)
        assert isinstance(fence, int) and fence > granted, (attempt, holder, fence)
        taken = parse_value(client.get(key))
        running = f"task=t {attempt} state=running node=n pid=2"
        assert taken == (own, fence, running) and 0 < client.pttl(key) <= 30_000
        assert adopt(attempt) == fence  # resent after a lost reply: its own, the same fence
        assert RELEASE(client, [key], [own]) == 1
    assert not client.exists(key)


@pytest.mark.parametrize(
    ("parked_by", "known_period_ms", "kept"),
    [("this_version", 0, True), ("an_older_version", 0, False), ("an_older_version", 50_000, True)],
)
def test_a_decline_lets_go_of_a_parked_hold_with_the_period_its_holder_names(
    client: redis.Redis, prefix: str, parked_by: str, known_period_ms: int, kept: bool
) -> None:
    """``DECLINE`` of a hold parked (``until_expired``, granted 20 s ago, a 50 s period) for a
    retry that a worker drops. Parked by this version, its holder names the parking run's period
    (``period=50000``): kept for what is left of it, also by a worker that does not know the
    task (no period: ``0``). Parked by an older version (no such field, during a rolling
    upgrade): freed by such a worker, as before, and kept by one that knows the period."""
    key, running, retry = f"{prefix}:declined-period", "a" * 32, "b" * 32
    holder = "task=t try=0 state=running"
    queued = holder_for("t", 1, "node", 1, "queued", period_ms=50_000 if parked_by == "this_version" else 0)
    assert ("period=50000" in queued) == (parked_by == "this_version")
    granted = int(client.time()[0]) * 1_000_000 - 20_000_000
    client.set(key, f"{running}:{granted}:{holder}", px=30_000)
    assert PARK(client, [key], [running, holder, retry, queued, 60_000, 50_000]) == 1
    assert DECLINE(client, [key], [retry, 60_000, known_period_ms]) == (3 if kept else 2)
    if kept:
        assert 25_000 < client.pttl(key) <= 30_000  # 50 s after the grant
        value = parse_value(client.get(key))
        assert value is not None and value.kept and value.fence == granted and value.holder == queued
        client.delete(key)
    assert not client.exists(key, companion_key(key, f"declined:{retry}"))


def test_a_resent_release_does_not_raise_lock_not_owned(client: redis.Redis, prefix: str) -> None:
    """RELEASE runs, its reply is lost, and the client sends it again: the second run finds the
    key gone. The release succeeded, so ``release()`` must not raise ``LockNotOwned``."""
    lock = RedisLock(client, f"{prefix}:resent-release", ttl=5)
    assert lock.acquire()
    with first_reply_lost(RELEASE) as lost:
        lock.release()
    assert lost == [1]
    assert not client.exists(f"{prefix}:resent-release")


def test_a_message_lock_release_sent_again_after_a_lost_reply_is_reported_released(
    redis_server: RedisServer, prefix: str
) -> None:
    """A message that will never run lets go of its enqueue lock (``give_up_ticket``: revoked,
    failed before its run); the release's reply is lost and the client's retry policy (a
    ``redis.Redis(...)``'s) sends it again, whose run finds the lock gone, as its first run
    left it. Reported (logged) ``released``, as ``RedisLock.release`` counts a resend; before,
    ``None``: "not the token's"."""
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert (retry := retrying.get_retry()) is not None and retry.get_retries() > 0
    key, token = f"{prefix}:resent-ticket", "c" * 32
    retrying.set(key, f"{token}:1:{holder_for('t', 0, 'node', 1, 'queued')}", px=30_000)
    retrying.script_load(RELEASE.source)  # its first send runs it (no NOSCRIPT reply to lose)
    try:
        with first_reply_lost(RELEASE) as lost:
            assert give_up_ticket(retrying, (key, token), False, None, "a test") == "released"
        assert lost == [1] and not retrying.exists(key)
    finally:
        retrying.close()


def test_a_dead_childs_permit_release_sent_again_after_a_lost_reply_is_reported_released(
    redis_server: RedisServer, prefix: str
) -> None:
    """The worker's main process frees the permit of a pool child that died
    (``release_permit_held_by``, a ``lock_limit`` run's); the release's reply is lost and the
    client's retry policy sends it again, whose run finds the permit gone, as its first run left
    it. Reported released (``crash_released``: ``redislock.lock.crash_releases`` and its WARNING),
    as ``release_held_by`` reports a lock's; before, not released."""
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert (retry := retrying.get_retry()) is not None and retry.get_retries() > 0
    name, holder = f"{prefix}:dead-child", holder_for("t", 0, "node", 1)
    dead = RedisSemaphore(retrying, name, 2, ttl=30, watchdog=False, holder=holder)
    assert dead.acquire(blocking=False)
    retrying.script_load(RELEASE_PERMIT.source)  # its first send runs it (no NOSCRIPT reply to lose)
    try:
        with first_reply_lost(RELEASE_PERMIT) as lost:
            assert release_permit_held_by(retrying, name, 2, holder)
        assert lost == [1] and not retrying.exists(companion_key(name, "permit:1"))
    finally:
        retrying.close()


ODD_ID = "a b state=queued try=9 node=x pid=1 %20"


def test_a_task_id_with_spaces_and_field_names_is_read_whole(app: Celery) -> None:
    """A custom task id may hold spaces, ``state=`` and ``try=``: the holder written for it must
    read back whole (duplicate detection, the CLI), and its retry must still run. Before, the
    holder was split at every space and ``=``: the duplicate named task ``a``."""
    x, task = fresh(), app.tasks["taskapp.retry_once"]
    holder = holder_for(ODD_ID, 3, "node one=two", 42, "queued")
    assert parse_holder(holder) == {
        "task": ODD_ID,
        "try": "3",
        "state": "queued",
        "node": "node one=two",
        "pid": "42",
    }
    first = task.apply_async((x,), task_id=ODD_ID)
    assert task.delay(x).id == ODD_ID  # a duplicate names the queued task
    held = read_lock(recorder(app).client, task_lock_key(task, (x,)), app.conf.redislock_prefix)
    assert held is not None and held.task_id == ODD_ID and held.attempt == 0 and held.state == "queued"
    with threads_worker(app):
        assert first.get(timeout=RESULT_TIMEOUT) == x
    assert attempts(app, x) == ["attempt@0", "attempt@1"]


# -- a message its body rejects for a requeue ----------------------------------------------------


@pytest.mark.parametrize("mode", ["until_executed", "until_expired"])
def test_a_message_rejected_for_a_requeue_keeps_its_hold_for_it(app: Celery, mode: str) -> None:
    """An ``acks_late`` task whose body raises ``Reject(requeue=True)`` at its message's first
    delivery: Celery puts the message back in the queue, and the run parks its hold for the token
    the message carries, as for a retry. A duplicate sent between the two deliveries (here while
    the first delivery's ``task_postrun`` runs) is refused: it gets the message's task id; the
    next delivery adopts the hold, with a greater fence, and runs. Before, the run let go of its
    hold as after any run: the duplicate was sent and took the lock, and the requeued message,
    finding it held, was skipped (``None``)."""
    rejected, go = threading.Event(), threading.Event()

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"attempts.requeued_{mode}",
        lock_mode=mode,
        lock_period=60 if mode == "until_expired" else None,
        acks_late=True,
    )
    def requeued(self: Any, x: str) -> str:
        recorder(app).record("delivery", self, x)
        if len(deliveries(x)) == 1:
            raise Reject("not now", requeue=True)
        return x

    def deliveries(x: str) -> list[list[str]]:
        return [event for event in events(app, x) if event[0] == "delivery"]

    def on_postrun(sender: Any = None, state: str = "", **_: Any) -> None:
        if sender is not None and sender.name == requeued.name and state == "REJECTED":
            rejected.set()
            go.wait(RESULT_TIMEOUT)  # the message goes back to the queue once this returns

    x, client = fresh(), recorder(app).client
    key = task_lock_key(requeued, (x,))
    task_postrun.connect(on_postrun, weak=False)
    try:
        with threads_worker(app, concurrency=1):
            first = requeued.delay(x)
            assert rejected.wait(RESULT_TIMEOUT), "the first delivery was not rejected"
            try:
                duplicate = requeued.delay(x)
            finally:
                go.set()
            assert duplicate.id == first.id, "a duplicate was sent while the message was requeued"
            assert first.get(timeout=RESULT_TIMEOUT) == x
            wait_for(lambda: runs_over(requeued.name), what="the runs to let go")
    finally:
        task_postrun.disconnect(on_postrun)
    assert [event[3] for event in deliveries(x)] == [first.id, first.id]
    assert int(deliveries(x)[1][5]) > int(deliveries(x)[0][5])
    if mode == "until_expired":  # kept for its period by the run that ran
        kept = parse_value(client.get(key))
        assert kept is not None and kept.kept
        client.delete(key)
    assert not client.exists(key)


@pytest.mark.parametrize("how", ["not acks_late", "apply"])
def test_a_reject_for_a_requeue_that_nothing_requeues_lets_go_of_the_hold(app: Celery, how: str) -> None:
    """``Reject(requeue=True)`` where no message comes back: a task without ``acks_late`` (its
    message was acknowledged as it was received: Celery's reject does nothing) and ``apply()``
    (no message). The hold is not parked for a delivery that never comes: released, and the next
    ``delay()`` is sent and runs."""

    @app.task(base=LockedTask, bind=True, shared=False, name="attempts.rejects", lock_mode="until_executed")
    def rejects(self: Any, x: str, reject: bool = True) -> str:
        recorder(app).record("run", self, x)
        if reject:
            raise Reject("not now", requeue=True)
        return x

    x, client = fresh(), recorder(app).client
    key = task_lock_key(rejects, (x,))
    with threads_worker(app):
        if how == "apply":
            assert str(rejects.apply((x,)).state) == "REJECTED"
        else:
            first = rejects.delay(x)
            wait_for(lambda: [event for event in events(app, x) if event[0] == "run"], what="the run")
            wait_for(lambda: runs_over(rejects.name, first.id), what="the run to let go")
        assert not client.exists(key)
        second = rejects.delay(x, reject=False)
        assert second.get(timeout=RESULT_TIMEOUT) == x
    assert not client.exists(key)


def test_adopt_waits_for_replicas(prefix: str) -> None:
    """With ``redislock_replicas=1``, the worker's adoption of the enqueue lock waits (``WAIT``)
    for a replica, as every acquisition does: here the replica is gone by the time the task
    starts, so the adoption is not acknowledged, is rolled back, and the task fails with
    ``RedisLockError`` (``redislock_on_error="fail"``). Before, ADOPT did not wait: the task ran
    on a hold no replica had."""
    with RedisServer() as primary, RedisServer() as replica:
        replica_client, primary_client = replica.client(), primary.client()
        replica_client.replicaof("127.0.0.1", primary.port)
        wait_for(
            lambda: replica_client.info("replication").get("master_link_status") == "up", what="the replica"
        )
        app = make_app(
            primary.url, prefix, f"q-{prefix}", redislock_replicas=1, redislock_replica_timeout=0.5
        )
        x, task = fresh(), app.tasks["taskapp.until_executed"]
        key = task_lock_key(task, (x,))
        result = task.delay(x)  # enqueued while the replica acknowledges
        assert primary_client.exists(key)
        replica_client.replicaof("NO", "ONE")
        wait_for(
            lambda: primary_client.info("replication")["connected_slaves"] == 0, what="the replica to go"
        )
        with threads_worker(app), pytest.raises(Exception, match="replica") as raised:
            result.get(timeout=RESULT_TIMEOUT)
        assert type(raised.value).__name__ == "RedisLockError"
        assert starts_of(app, x) == []
        assert not primary_client.exists(key)  # rolled back
        app.close()
        replica_client.close()
        primary_client.close()


def starts_of(app: Celery, x: object) -> list[list[str]]:
    return [event for event in events(app, x) if event[0] == "start"]
