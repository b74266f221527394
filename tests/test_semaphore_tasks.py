"""``lock_limit``: up to N runs of one signature at once on a real prefork worker, each holding a permit."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError, signals, task_lock_key
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisServer
from tests import invariants
from tests.taskapp import Recorder, make_app
from tests.test_task_config import define, new_app, nothing_under
from tests.workers import WorkerProcess, threads_worker, wait_for

RESULT_TIMEOUT = 30
LIMIT = 3
NEEDS_MODE = "above 1 it needs lock_mode 'while_executing' or 'until_and_while_executing'"


@pytest.fixture(scope="module")
def worker_app(redis_server: RedisServer) -> Iterator[Celery]:
    """The tests' app, with a prefork worker of 4 children consuming its queue."""
    prefix = f"limit-{uuid.uuid4().hex[:8]}"
    queue = f"q-{prefix}"
    app = make_app(redis_server.url, prefix, queue)
    worker = WorkerProcess(redis_server.url, prefix, queue, "prefork", LIMIT + 1, "limited")
    worker.start()
    try:
        ready = redis_server.client(socket_timeout=70)  # outlasts the BLPOP (redis-py 8: 5 s)
        assert ready.blpop([f"{prefix}:ready"], timeout=60) is not None, worker.output()
        ready.close()
        app.worker = worker  # type: ignore[attr-defined]
        yield app
    finally:
        worker.stop()
    with redis_server.client() as client:
        invariants.check(client, prefix)  # every key with a TTL, no permit left by the module's tests


def held_permits(client: redis.Redis, key: str) -> int:
    return int(client.exists(*(companion_key(key, f"permit:{i}") for i in range(1, LIMIT + 1))))


def test_up_to_the_limit_run_at_once_and_the_next_follows_lock_busy(worker_app: Celery) -> None:
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    task, x = worker_app.tasks["taskapp.limited"], uuid.uuid4().hex[:10]
    runs = [task.delay(x, gate=True) for _ in range(LIMIT)]
    starts = wait_for(lambda: found if len(found := _starts(recorder, x)) == LIMIT else [], what="3 starts")
    fences = {int(start[5]) for start in starts}
    assert len(fences) == LIMIT  # a permit, and a fence, each
    assert held_permits(recorder.client, task_lock_key(task, (x,), {"gate": True})) == LIMIT
    assert task.delay(x, gate=True).get(timeout=RESULT_TIMEOUT) is None  # the 4th: skipped (lock_busy)
    recorder.open_gate(x, LIMIT)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in runs] == [x] * LIMIT
    assert len(_starts(recorder, x)) == LIMIT
    assert held_permits(recorder.client, task_lock_key(task, (x,), {"gate": True})) == 0


def test_sigkill_of_a_pool_child_frees_its_permit_at_once(worker_app: Celery) -> None:
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    task, x = worker_app.tasks["taskapp.limited"], uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    runs = [task.delay(x, gate=True) for _ in range(LIMIT)]
    starts = wait_for(lambda: found if len(found := _starts(recorder, x)) == LIMIT else [], what="3 starts")
    os.kill(int(starts[0][4]), signal.SIGKILL)  # a 300 s lease: its expiry cannot explain a quick free
    wait_for(
        lambda: held_permits(recorder.client, key) == LIMIT - 1, what="the main process to free the permit"
    )
    # the main process logs it once the permit is freed: its output may come a moment later
    worker_app.worker.wait_for_line("released its lock", what="the release logged")  # type: ignore[attr-defined]
    late = task.delay(x, gate=True)
    wait_for(lambda: len(_starts(recorder, x)) == LIMIT + 1, what="the next run to take the freed permit")
    recorder.open_gate(x, LIMIT)
    killed = next(run for run in runs if run.id == starts[0][3])
    with pytest.raises(Exception, match="Worker exited prematurely"):
        killed.get(timeout=RESULT_TIMEOUT)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in [*runs, late] if run is not killed] == [x] * LIMIT
    assert held_permits(recorder.client, key) == 0


def test_a_message_redelivered_while_its_first_delivery_runs_takes_no_second_permit(
    worker_app: Celery,
) -> None:
    """A redelivery (acks_late, a visibility timeout) is the same message again: same task id and
    retry count. With permits free, it must still see its first delivery's permit as its own."""
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    task, x = worker_app.tasks["taskapp.limited_acks_late"], uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    first = task.delay(x, gate=True)
    wait_for(lambda: _starts(recorder, x), what="the first delivery to start")
    task.apply_async((x,), {"gate": True}, task_id=first.id)  # the message delivered again
    wait_for(
        lambda: _busy(recorder, first.id) or len(_starts(recorder, x)) > 1,
        what="the redelivery to find its permit held, or to run",
    )
    assert len(_starts(recorder, x)) == 1 and held_permits(recorder.client, key) == 1
    recorder.open_gate(x)  # the first delivery ends, and wakes the redelivery: it is ignored
    assert first.get(timeout=RESULT_TIMEOUT) == x
    worker_app.worker.wait_for_line("redelivered while its first delivery runs; ignored")  # type: ignore[attr-defined]
    assert len(_starts(recorder, x)) == 1 and held_permits(recorder.client, key) == 0


def _busy(recorder: Recorder, task_id: str) -> list[list[str]]:
    return [event for event in recorder.events() if event[0] == "busy" and event[3] == task_id]


def _starts(recorder: Recorder, x: str) -> list[list[str]]:
    return [event for event in recorder.events() if event[0] == "start" and event[2] == x]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_limit": 0}, "lock_limit=0 is not valid; allowed: an int from 1 to 1000"),
        ({"lock_limit": "3"}, "lock_limit='3' is not valid; allowed: an int from 1 to 1000"),
        ({"lock_limit": True}, "lock_limit=True is not valid; allowed: an int from 1 to 1000"),
        (
            {"lock_limit": 2, "lock_mode": "until_executed"},
            "lock_limit=2 is not valid; above 1 it needs lock_mode",
        ),
        (
            {"lock_limit": 2, "lock_mode": "until_executing"},
            "lock_limit=2 is not valid; above 1 it needs lock_mode",
        ),
    ],
)
def test_a_bad_lock_limit_names_the_task_option_and_value(
    redis_server: RedisServer, client: redis.Redis, prefix: str, options: dict[str, Any], message: str
) -> None:
    app = new_app(redis_server.url, prefix)
    with pytest.raises(LockConfigurationError, match=f"^task 'cfg.add': {message}"):
        define(app, **options)
    assert nothing_under(client, prefix)


def test_the_app_setting_is_the_default_and_refused_with_replicas(
    redis_server: RedisServer, prefix: str
) -> None:
    assert define(new_app(redis_server.url, prefix, redislock_limit=4)).lock_options.limit == 4
    replicated = new_app(redis_server.url, prefix, redislock_limit=4, redislock_replicas=1)
    with pytest.raises(
        LockConfigurationError, match="redislock_limit=4 is not valid; above 1 it cannot be used"
    ):
        define(replicated)


def test_a_bad_replicas_setting_is_named_not_taken_for_replicas(
    redis_server: RedisServer, prefix: str
) -> None:
    """The limit is checked against the app's checked ``redislock_replicas``, never its raw value."""
    app = new_app(redis_server.url, prefix, redislock_limit=2, redislock_replicas="1")
    with pytest.raises(
        LockConfigurationError, match="redislock_replicas='1' is not valid; allowed: an int from 0 to"
    ):
        define(app)


def test_until_and_while_executing_runs_up_to_the_limit_and_retries_the_next(worker_app: Celery) -> None:
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    task, x = worker_app.tasks["taskapp.limited_queued"], uuid.uuid4().hex[:10]
    # One at a time: a queued message holds the enqueue lock until its run starts.
    runs = [task.delay(x, gate=True)]
    wait_for(lambda: len(_starts(recorder, x)) == 1, what="the first run to start")
    runs.append(task.delay(x, gate=True))
    wait_for(lambda: len(_starts(recorder, x)) == 2, what="the second run to start")
    runs.append(task.delay(x, gate=True))  # both permits held: it retries (lock_busy="retry")
    wait_for(lambda: [e for e in recorder.events() if e[0] == "busy" and e[2] == x], what="the third busy")
    assert len(_starts(recorder, x)) == 2
    recorder.open_gate(x)  # one run ends: the third takes its permit at its next retry
    wait_for(lambda: len(_starts(recorder, x)) == 3, what="the third run to start")
    recorder.open_gate(x, 2)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in runs] == [x] * 3


@pytest.mark.parametrize(("name", "limit"), [("limited_wait", 2), ("waits_long", 1)], ids=["permit", "lock"])
def test_a_pool_child_killed_waiting_leaves_the_queue_and_the_next_waiter_is_woken(
    worker_app: Celery, name: str, limit: int
) -> None:
    """A run waiting for a permit, or a lock (``lock_busy="wait"``), whose pool child is SIGKILLed
    leaves the waiter queue once the main process sees the death: a release later wakes the live
    waiter behind it at once, not at its wait's end (the dead waiter would take that wake)."""
    recorder: Recorder = worker_app.recorder  # type: ignore[attr-defined]
    task, x = worker_app.tasks[f"taskapp.{name}"], uuid.uuid4().hex[:10]
    key = task_lock_key(task, (x,), {"gate": True})
    holders = [task.delay(x, gate=True) for _ in range(limit)]
    wait_for(lambda: len(_starts(recorder, x)) == limit, what="runs to hold every place")
    doomed = task.delay(x, gate=True)
    wait_for(lambda: _queued(recorder.client, key, doomed.id), what="a run to queue")
    os.kill(int(_busy(recorder, doomed.id)[0][4]), signal.SIGKILL)
    wait_for(lambda: doomed.state == "FAILURE", what="the main process to see the death")
    late = task.delay(x, gate=True)
    wait_for(lambda: _queued(recorder.client, key, late.id), what="the next run to queue")
    recorder.open_gate(x)  # a holder ends: its release wakes the first live waiter
    wait_for(lambda: len(_starts(recorder, x)) == limit + 1, timeout=20, what="the live waiter to run")
    recorder.open_gate(x, limit)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in [*holders, late]] == [x] * (limit + 1)
    with pytest.raises(Exception, match="Worker exited prematurely"):
        doomed.get(timeout=RESULT_TIMEOUT)
    assert not _queued(recorder.client, key, doomed.id)
    assert held_permits(recorder.client, key) == 0 and not recorder.client.exists(key)


def _queued(client: redis.Redis, key: str, task_id: str) -> bool:
    """Whether the run of ``task_id`` waits in the lock's queue (a member names its holder)."""
    members = cast("list[bytes]", client.zrange(companion_key(key, "queue"), 0, -1))
    return any(f"task={task_id} ".encode() in member for member in members)


def test_a_lost_permit_is_signalled_under_the_runs_lock_key(redis_server: RedisServer, prefix: str) -> None:
    """A run of a ``lock_limit`` task whose permit is lost: ``lock_lost`` names the key its
    ``lock_acquired`` named (``task_lock_key``), not the permit's."""
    app = new_app(redis_server.url, prefix)
    lost = threading.Event()
    acquired: list[str] = []
    reports: list[dict[str, Any]] = []

    def body(self: Any, x: str) -> bool:
        return lost.wait(RESULT_TIMEOUT)  # until the loss is reported

    task = define(app, body, bind=True, lock_limit=2, lock_ttl=0.6)
    key = task_lock_key(task, ("x",))

    def on_acquired(sender: Any = None, **fields: Any) -> None:
        if sender is task:
            acquired.append(fields["key"])

    def on_lost(sender: Any = None, **fields: Any) -> None:
        if getattr(sender, "task_name", None) == task.name:
            reports.append(fields)
            lost.set()

    signals.lock_acquired.connect(on_acquired, weak=False)
    signals.lock_lost.connect(on_lost, weak=False)
    try:
        with threads_worker(app):
            result = task.delay("x")
            wait_for(lambda: acquired, what="the run to take a permit")
            with redis_server.client() as client:
                client.delete(*(companion_key(key, f"permit:{i}") for i in (1, 2)))
            assert result.get(timeout=RESULT_TIMEOUT) is True
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        signals.lock_lost.disconnect(on_lost)
        app.close()
    assert acquired == [key]
    assert [(report["key"], report["reason"]) for report in reports] == [(key, "not owned")]
