"""LockedTask in real workers on a real Redis: exclusion per signature, busy policies, outcomes, crashes.

Each pool gets its own app (key prefix and queue) and workers for the module:
``threads`` in-process, ``solo`` as two worker subprocesses, ``prefork`` as one
worker subprocess with two children. Tests use arguments of their own (a
fresh ``x``) so they do not meet each other's locks.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import task_lock_key
from celery_redislock.testing import RedisServer
from tests import invariants
from tests.taskapp import Recorder, make_app
from tests.workers import WorkerProcess, threads_worker, wait_for

RESULT_TIMEOUT = 30


@dataclass
class Pool:
    name: str
    app: Celery
    recorder: Recorder
    workers: list[WorkerProcess]

    def task(self, name: str) -> Any:
        return self.app.tasks[f"taskapp.{name}"]

    def started(self, x: object, n: int = 1) -> list[list[str]]:
        """Wait until ``n`` bodies called with ``x`` have started; their start events."""
        return wait_for(
            lambda: starts if len(starts := self.events("start", x)) >= n else [],
            what=f"{n} start(s) of {x}",
        )

    def events(self, kind: str | None = None, x: object = None) -> list[list[str]]:
        return [
            event
            for event in self.recorder.events()
            if (kind is None or event[0] == kind) and (x is None or event[2] == str(x))
        ]


def start_subprocess_workers(
    server: RedisServer, prefix: str, queue: str, pool: str, count: int = 2
) -> list[WorkerProcess]:
    if pool == "solo":
        workers = [WorkerProcess(server.url, prefix, queue, "solo", 1, f"solo{i}") for i in range(count)]
    else:
        workers = [WorkerProcess(server.url, prefix, queue, "prefork", 2, "prefork")]
    ready = redis.Redis.from_url(server.url, socket_timeout=70)  # outlasts the BLPOP (redis-py 8: 5 s)
    for worker in workers:
        worker.start()
    for worker in workers:
        if ready.blpop([f"{prefix}:ready"], timeout=60) is None:
            raise AssertionError(f"worker did not start:\n{worker.output()}")
    return workers


@pytest.fixture(scope="module", params=["threads", "solo", "prefork"])
def pool(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Pool]:
    prefix = f"pool-{request.param}-{uuid.uuid4().hex[:8]}"
    queue = f"q-{prefix}"
    app = make_app(redis_server.url, prefix, queue)
    with ExitStack() as stack:
        workers: list[WorkerProcess] = []
        if request.param == "threads":
            stack.enter_context(threads_worker(app))
        else:
            workers = start_subprocess_workers(redis_server, prefix, queue, request.param)
            for worker in workers:
                stack.callback(worker.stop)
        yield Pool(request.param, app, app.recorder, workers)  # type: ignore[attr-defined]
    client = redis_server.client()
    invariants.check(client, prefix)  # every key with a TTL, no lock left by the module's tests
    client.close()


def fresh() -> str:
    return uuid.uuid4().hex[:10]


def assert_no_overlap(events: list[list[str]]) -> None:
    """Start/end events (in recorded order) of one key never interleave."""
    running = 0
    for event in events:
        if event[0] == "start":
            running += 1
            assert running == 1, f"two bodies ran at once: {events}"
        elif event[0] == "end":
            running -= 1


# -- one signature at a time -------------------------------------------------------------------


def test_skip_runs_one_and_the_duplicate_returns_none(pool: Pool) -> None:
    x, task = fresh(), pool.task("hold_skip")
    first = task.delay(x, gate=True)
    pool.started(x)
    duplicate = task.delay(x, gate=True)
    assert duplicate.get(timeout=RESULT_TIMEOUT) is None
    pool.recorder.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == x
    assert len(pool.events("start", x)) == 1
    busy = pool.events("busy", x)
    assert [event[3] for event in busy] == [duplicate.id]


@pytest.mark.parametrize("busy", ["retry", "wait"])
def test_retry_and_wait_run_both_one_after_the_other(pool: Pool, busy: str) -> None:
    x, task = fresh(), pool.task(f"hold_{busy}")
    first = task.delay(x, gate=True)
    pool.started(x)
    second = task.delay(x, gate=True)
    wait_for(lambda: pool.events("busy", x), what="the second call to find the lock busy")
    pool.recorder.open_gate(x, times=2)
    assert first.get(timeout=RESULT_TIMEOUT) == x
    assert second.get(timeout=RESULT_TIMEOUT) == x
    events = [event for event in pool.events(x=x) if event[0] in ("start", "end")]
    assert [event[0] for event in events] == ["start", "end", "start", "end"]
    assert [event[3] for event in events] == [first.id, first.id, second.id, second.id]
    assert int(events[2][5]) > int(events[0][5])  # the later holder's fence is greater
    assert events[2][6] == "0"  # a retry for a busy lock is not one of the task's own retries


def test_raise_fails_the_duplicate_with_lock_not_acquired(pool: Pool) -> None:
    x, task = fresh(), pool.task("hold_raise")
    first = task.delay(x, gate=True)
    pool.started(x)
    duplicate = task.delay(x, gate=True)
    with pytest.raises(Exception, match="is busy held by 'task=") as raised:
        duplicate.get(timeout=RESULT_TIMEOUT)
    assert type(raised.value).__name__ == "LockNotAcquired"
    assert first.id in str(raised.value)
    pool.recorder.open_gate(x)
    assert first.get(timeout=RESULT_TIMEOUT) == x


def test_different_arguments_run_concurrently(pool: Pool) -> None:
    a, b, task = fresh(), fresh(), pool.task("hold_skip")
    results = [task.delay(a, gate=True), task.delay(b, gate=True)]
    pool.started(a)
    pool.started(b)  # both bodies are running at once
    pool.recorder.open_gate(a)
    pool.recorder.open_gate(b)
    assert [result.get(timeout=RESULT_TIMEOUT) for result in results] == [a, b]


def test_lock_on_names_serialise_by_those_arguments_only(pool: Pool) -> None:
    user, other_user, task = fresh(), fresh(), pool.task("per_user")
    first = task.delay(user, 1, gate=True)
    pool.started(f"{user}-1")
    assert task.delay(user, 2).get(timeout=RESULT_TIMEOUT) is None  # same user: skipped
    other = task.delay(other_user, 1, gate=True)
    pool.started(f"{other_user}-1")  # another user runs beside the first
    pool.recorder.open_gate(f"{user}-1")
    pool.recorder.open_gate(f"{other_user}-1")
    assert first.get(timeout=RESULT_TIMEOUT) == f"{user}-1"
    assert other.get(timeout=RESULT_TIMEOUT) == f"{other_user}-1"
    assert task_lock_key(task, (user, 1)) == task_lock_key(task, (user, 2), {"gate": True})


def test_empty_lock_on_is_one_lock_per_task(pool: Pool) -> None:
    a, b, task = fresh(), fresh(), pool.task("per_task")
    first = task.delay(a, gate=True)
    pool.started(a)
    assert task.delay(b).get(timeout=RESULT_TIMEOUT) is None
    pool.recorder.open_gate(a)
    assert first.get(timeout=RESULT_TIMEOUT) == a
    assert task.delay(b).get(timeout=RESULT_TIMEOUT) == b


# -- every outcome releases ----------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads"], indirect=True)
@pytest.mark.parametrize("kind", ["success", "failure", "retry", "ignore", "reject"])
def test_every_outcome_releases_the_lock(pool: Pool, kind: str) -> None:
    x, task = fresh(), pool.task("outcome")
    key = task_lock_key(task, (kind, x))
    result = task.delay(kind, x)
    runs = 2 if kind == "retry" else 1
    wait_for(
        lambda: len(pool.events("released", kind)) >= runs,
        what=lambda: f"{runs} release(s); events so far: {pool.events(x=x)}, result {result.state}",
    )
    assert not pool.recorder.client.exists(key)
    if kind == "success":
        assert result.get(timeout=RESULT_TIMEOUT) == x
    if kind == "retry":
        assert result.get(timeout=RESULT_TIMEOUT) == x
        assert [event[0] for event in pool.events(x=x) if "@" in event[0]] == ["retry@0", "retry@1"]
    if kind == "failure":
        with pytest.raises(ValueError, match="the body failed"):
            result.get(timeout=RESULT_TIMEOUT)


@pytest.mark.parametrize("pool", ["threads"], indirect=True)
def test_a_retry_that_arrives_before_its_previous_attempt_released_waits_for_it(pool: Pool) -> None:
    x, task = fresh(), pool.task("outcome")
    task.delay("retry_race", x)
    busy = wait_for(lambda: pool.events("busy", "retry_race"), what="the retry to find the lock held")
    assert busy[0][6] == "1"  # the retry, blocked by its own previous attempt
    pool.recorder.open_gate(x)
    wait_for(lambda: len(pool.events("released", "retry_race")) == 2, what="both attempts to release")
    assert [event[0] for event in pool.events(x=x)] == ["retry_race@0", "retry_race@1"]


# -- the watchdog, lost locks --------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads", "prefork"], indirect=True)
def test_a_body_longer_than_three_leases_keeps_its_lock(pool: Pool) -> None:
    x, task = fresh(), pool.task("long")
    assert task.delay(x, leases=3).get(timeout=RESULT_TIMEOUT) is True
    assert not pool.recorder.client.exists(task_lock_key(task, (x, 3)))


def test_on_lost_raise_stops_the_body_with_lock_lost(pool: Pool) -> None:
    """The body calls ``self.check_lock()`` between short waits: the first call after the
    loss raises ``LockLost``."""
    x, task = fresh(), pool.task("lost")
    result = task.delay(x)
    pool.started(x)
    pool.recorder.client.delete(task_lock_key(task, (x,)))
    with pytest.raises(Exception, match="lost") as raised:
        result.get(timeout=RESULT_TIMEOUT)
    assert type(raised.value).__name__ == "LockLost"
    assert pool.events("end", x) == []
    pool.recorder.open_gate(x)  # nothing waits on it any more; expires with the prefix's keys


def test_on_lost_raise_fails_a_body_that_returns_after_the_loss(pool: Pool) -> None:
    """The body is in one blocking call when its lock is lost; nothing interrupts it, it returns
    normally, and the run fails with ``LockLost`` instead of reporting success."""
    x, task = fresh(), pool.task("lost_at_end")
    result = task.delay(x)
    pool.started(x)
    pool.recorder.client.delete(task_lock_key(task, (x,)))
    wait_for(lambda: pool.events("lost", x), what="the watchdog to find the lock lost")
    pool.recorder.open_gate(x)
    with pytest.raises(Exception, match="lost") as raised:
        result.get(timeout=RESULT_TIMEOUT)
    assert type(raised.value).__name__ == "LockLost"
    assert len(pool.events("end", x)) == 1  # the body ran to its end: nothing was raised inside it


@pytest.mark.parametrize("pool", ["threads"], indirect=True)
def test_on_lost_log_marks_the_request_and_lets_the_body_finish(pool: Pool) -> None:
    x, task = fresh(), pool.task("lost_logged")
    result = task.delay(x)
    pool.started(x)
    pool.recorder.client.delete(task_lock_key(task, (x,)))
    wait_for(lambda: pool.events("noticed", x), what="the body to see request.lock_lost")
    pool.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x


# -- crashes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork"], indirect=True)
def test_sigkill_of_the_pool_child_frees_the_lock_at_once(pool: Pool) -> None:
    x, task = fresh(), pool.task("crash")
    key = task_lock_key(task, (x,))
    killed = task.delay(x)
    child_pid = int(pool.started(x)[0][4])
    # a 300 s lease: its expiry cannot explain a quick free
    assert 0 < pool.recorder.client.pttl(key) <= 300_000
    os.kill(child_pid, signal.SIGKILL)
    wait_for(lambda: not pool.recorder.client.exists(key), what="the main process to free the lock")
    with pytest.raises(Exception, match="Worker exited prematurely"):
        killed.get(timeout=RESULT_TIMEOUT)
    assert task.delay(x, gate=False).get(timeout=RESULT_TIMEOUT) == x
    assert "released its lock" in pool.workers[0].output()


# -- direct calls ----------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads"], indirect=True)
def test_a_direct_call_nested_in_one_holding_the_same_key_does_not_deadlock(pool: Pool) -> None:
    x, task = fresh(), pool.task("nested")
    depths = task.delay(x, 2).get(timeout=RESULT_TIMEOUT)
    fences = depths[1::2]
    assert depths[0::2] == [2, 1, 0] and len(set(fences)) == 1 and fences[0] is not None
    assert not pool.recorder.client.exists(task_lock_key(task, (x, 2)))


@pytest.mark.parametrize(
    ("pool_name", "signal_name"),
    [("prefork", "SIGTERM"), ("prefork", "SIGQUIT"), ("solo", "SIGTERM"), ("solo", "SIGQUIT")],
)
def test_worker_shutdown_releases_the_locks_of_interrupted_tasks(
    redis_server: RedisServer, prefix: str, pool_name: str, signal_name: str
) -> None:
    queue = f"q-{prefix}"
    app = make_app(redis_server.url, prefix, queue)
    [worker] = start_subprocess_workers(redis_server, prefix, queue, pool_name, count=1)
    try:
        x, task = fresh(), app.tasks["taskapp.crash"]
        key = task_lock_key(task, (x,))
        task.delay(x)
        wait_for(lambda: app.recorder.events(), what="the body to start")  # type: ignore[attr-defined]
        assert app.recorder.client.pttl(key) > 200_000  # type: ignore[attr-defined]
        worker.process.send_signal(getattr(signal, signal_name))  # type: ignore[union-attr]
        if signal_name == "SIGTERM":  # a warm shutdown lets the body end; its lock is held until then
            worker.wait_for_line("Warm shutdown", what="the warm shutdown to begin")
            assert app.recorder.client.pttl(key) > 200_000  # type: ignore[attr-defined]
            app.recorder.open_gate(x)  # type: ignore[attr-defined]
        worker.process.wait(timeout=60)  # type: ignore[union-attr]
        assert not app.recorder.client.exists(key), worker.output()  # type: ignore[attr-defined]
    finally:
        worker.stop()
