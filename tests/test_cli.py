"""``celery redislock ...`` on a real Redis, with locks held by a real prefork worker.

Most tests drive the command group in-process with click's ``CliRunner`` and
the app of ``tests.taskapp``; one runs the real ``celery`` command against the
examples' app and worker, through the ``celery.commands`` entry point.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import click
import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from kombu.utils import json as kombu_json

from celery_redislock import LockNotOwned, RedisLock, RedisSemaphore, task_lock_key
from celery_redislock._permit_scripts import RELEASE_PERMIT
from celery_redislock._scripts import FORCE_RELEASE
from celery_redislock.cli import force_release, read_lock, redislock
from celery_redislock.lock import companion_key
from celery_redislock.protocol import LockValue, parse_value
from celery_redislock.testing import RedisServer
from examples._support import QUEUE, ROOT, Worker
from tests.conftest import calls_since, command_calls
from tests.invariants import keys_without_ttl, stored
from tests.taskapp import Recorder, make_app
from tests.test_attempts import first_reply_lost
from tests.workers import WorkerProcess, wait_for

RESULT_TIMEOUT = 30


@dataclass(frozen=True)
class Ran:
    """What a command did (not click's ``Result``, whose traceback would keep the test's
    AsyncResults alive until the server is gone)."""

    exit_code: int
    output: str
    stdout: str


def run(app: Celery, *args: str, input: str | None = None) -> Ran:
    """``celery redislock ARGS`` for ``app``, in this process."""
    obj = CLIContext(app=app, no_color=True, workdir=None)
    result = CliRunner().invoke(redislock, list(args), obj=obj, input=input)
    return Ran(result.exit_code, result.output, result.stdout)


@dataclass
class Setup:
    app: Celery
    prefix: str
    recorder: Recorder
    worker: WorkerProcess
    #: a queue no worker consumes: messages sent there keep their enqueue locks
    idle_queue: str

    def task(self, name: str) -> Any:
        return self.app.tasks[f"taskapp.{name}"]

    def started(self, x: str) -> list[str]:
        """The start event of the body called with ``x``, once it has started."""
        return wait_for(
            lambda: next((e for e in self.recorder.events() if e[0] == "start" and e[2] == x), []),
            what=f"the body of {x} to start",
        )

    def cli(self, *args: str, input: str | None = None) -> Ran:
        return run(self.app, *args, input=input)

    def listed(self, *args: str) -> list[dict[str, Any]]:
        result = self.cli("list", "--json", *args)
        assert result.exit_code == 0, result.output
        return list(json.loads(result.stdout))


@pytest.fixture(scope="module")
def setup(redis_server: RedisServer) -> Iterator[Setup]:
    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    worker = WorkerProcess(redis_server.url, prefix, f"q-{prefix}", "prefork", 2, "prefork")
    worker.start()
    client = redis_server.client(socket_timeout=70)  # outlasts the BLPOP (redis-py 8: 5 s)
    try:
        if client.blpop([f"{prefix}:ready"], timeout=60) is None:
            raise AssertionError(f"worker did not start:\n{worker.output()}")
        yield Setup(app, prefix, app.recorder, worker, f"idle-{prefix}")  # type: ignore[attr-defined]
    finally:
        worker.stop()
    client.delete(f"idle-{prefix}")  # the messages no worker took
    assert keys_without_ttl(client, prefix) == []
    client.close()


def fresh() -> str:
    return uuid.uuid4().hex[:10]


def test_list_shows_a_running_tasks_lock_with_its_holder(setup: Setup) -> None:
    x, task = fresh(), setup.task("hold_skip")
    result = task.delay(x, gate=True)
    child_pid = int(setup.started(x)[4])
    key = task_lock_key(task, (x, True))
    value = stored(setup.recorder.client, key)
    [row] = [row for row in setup.listed() if row["key"] == key]
    assert 0 < row.pop("ttl") <= 30
    assert row.pop("node").startswith("prefork@")
    assert row == {
        "key": key,
        "task": "taskapp.hold_skip",
        "task_id": result.id,
        "attempt": 0,
        "state": "running",
        "mode": "while_executing",
        "pid": child_pid,
        "fence": int(value.split(b":")[1]),
        "holder": value.decode().split(":", 2)[2],
        "waiters": 0,
        "permit": None,
    }
    table = setup.cli("list").stdout
    header, line = table.splitlines()[0], next(line for line in table.splitlines() if key in line)
    assert header.split() == [
        "TASK",
        "TASK",
        "ID",
        "ATTEMPT",
        "STATE",
        "MODE",
        "NODE",
        "PID",
        "TTL",
        "FENCE",
        "KEY",
    ]
    assert line.split()[:4] == ["taskapp.hold_skip", result.id, "0", "running"]
    assert line.index(key) == header.index("KEY")  # the columns line up

    setup.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    assert setup.listed("--task", "taskapp.hold_skip") == []
    assert (
        "no locks held by task 'taskapp.hold_skip'" in setup.cli("list", "--task", "taskapp.hold_skip").stdout
    )


def test_list_shows_a_lock_kept_for_its_period_as_kept(setup: Setup) -> None:
    """``until_expired``: once its run ended, the lock is kept for the rest of ``lock_period``,
    held by no run. ``list`` says ``kept``, not ``running`` (which sent users to look for a run
    on a node that has none), with the task id, node and pid of the run that kept it."""
    x, task = fresh(), setup.task("until_expired")
    result = task.delay(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x
    key = task_lock_key(task, (x,))
    client = setup.recorder.client
    wait_for(lambda: parse_value(stored(client, key)).kept, what="the run to keep its lock")  # type: ignore[union-attr]
    [row] = [row for row in setup.listed() if row["key"] == key]
    assert (row["task_id"], row["state"], row["mode"]) == (result.id, "kept", "until_expired")
    assert row["pid"] == int(setup.started(x)[4])
    line = next(line for line in setup.cli("list").stdout.splitlines() if key in line)
    assert line.split()[:4] == ["taskapp.until_expired", result.id, "0", "kept"]
    client.delete(key)


def test_a_forced_release_frees_only_the_kept_hold_it_read(setup: Setup) -> None:
    """``until_expired``: a hold kept for its period is owned by no token (``KEPT_TOKEN``), the
    same for every kept hold. A forced release of one read earlier (``purge`` shows its table,
    then asks) freed whichever hold was kept at the key by then: a later run's, its period just
    begun, which was never shown. It frees only the hold it read (its fence, too)."""
    x, task = fresh(), setup.task("until_expired")
    key, client = task_lock_key(task, (x,)), setup.recorder.client

    def kept_run() -> LockValue:
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
        value = wait_for(
            lambda: (held := parse_value(client.get(key))) is not None and held.kept and held,
            what="the run to keep its lock",
        )
        assert isinstance(value, LockValue)
        return value

    kept_run()
    read = read_lock(client, key, setup.prefix)
    assert read is not None and read.state == "kept"
    client.delete(key)  # its period ends
    later = kept_run()
    assert later.fence > read.fence
    try:
        assert not force_release(client, read, "a test")
        assert parse_value(client.get(key)) == later
    finally:
        client.delete(key)


@pytest.mark.parametrize("kind", ["lock", "permit"])
def test_a_forced_release_sent_again_after_a_lost_reply_reports_it_released(
    redis_server: RedisServer, prefix: str, kind: str
) -> None:
    """The forced release runs, its reply is lost with its connection, and the client's retry
    policy (a ``redis.Redis(...)``'s, as a ``redislock_client`` may be) sends it again: the second
    run finds the hold gone, which its first run freed. Reported released, as a holder's own
    release sent again is; before, "not released: it changed hands since it was read"."""
    retrying = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert (retry := retrying.get_retry()) is not None and retry.get_retries() > 0
    name = f"{prefix}:forced-{kind}"
    holder = (
        RedisLock(retrying, name, ttl=30, watchdog=False)
        if kind == "lock"
        else RedisSemaphore(retrying, name, 2, ttl=30, watchdog=False)
    )
    assert holder.acquire(blocking=False)
    key = name if kind == "lock" else companion_key(name, "permit:1")
    read = read_lock(retrying, key, prefix)
    assert read is not None and read.fence == holder.fence
    script = FORCE_RELEASE if kind == "lock" else RELEASE_PERMIT
    retrying.script_load(script.source)  # its first send runs it (no NOSCRIPT reply to lose)
    try:
        with first_reply_lost(script) as lost:
            assert force_release(retrying, read, "a test")
        assert lost == [1] and not retrying.exists(key)
    finally:
        retrying.delete(key)
        retrying.close()


def test_enqueue_locks_are_listed_as_queued_and_released_by_task_and_arguments(setup: Setup) -> None:
    x = fresh()
    executed, swapped = setup.task("until_executed"), setup.task("until_and_while_executing")
    first = executed.apply_async((x,), queue=setup.idle_queue)
    second = swapped.apply_async((x,), queue=setup.idle_queue)
    rows = {row["task"]: row for row in setup.listed() if row["task_id"] in (first.id, second.id)}
    for name, sent, mode in (
        ("taskapp.until_executed", first, "until_executed"),
        ("taskapp.until_and_while_executing", second, "until_and_while_executing"),
    ):
        row = rows[name]
        assert (row["task_id"], row["state"], row["mode"]) == (sent.id, "queued", mode)
        assert (row["node"], row["pid"]) == (socket.gethostname(), os.getpid())
        assert 3500 < row["ttl"] <= 3600  # lock_queue_ttl
    assert rows["taskapp.until_and_while_executing"]["key"] == task_lock_key(swapped, (x,)) + ":queued"

    for name in ("taskapp.until_executed", "taskapp.until_and_while_executing"):
        released = setup.cli("release", "--task", name, "--args", json.dumps([x]))
        assert released.exit_code == 0, released.output
        assert released.stdout.startswith("released ")
    assert [row for row in setup.listed() if row["task_id"] in (first.id, second.id)] == []
    assert executed.apply_async((x,), queue=setup.idle_queue).id != first.id  # not a duplicate any more
    assert setup.cli("purge", "--task", "taskapp.until_executed", "--yes").exit_code == 0


def test_release_key_frees_a_running_tasks_lock_and_its_watchdog_reports_the_loss(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    x, task = fresh(), setup.task("lost_logged")
    result = task.delay(x)
    setup.started(x)
    key = task_lock_key(task, (x,))
    value = stored(setup.recorder.client, key)
    _, fence, holder = value.decode().split(":", 2)
    with caplog.at_level(logging.WARNING, logger="celery_redislock.inventory"):
        released = setup.cli("release", key)
    assert released.exit_code == 0, released.output
    assert released.stdout == f"released {key} (held by {holder}, fence {fence})\n"
    assert holder.startswith(f"task={result.id} try=0 state=running node=prefork@")
    why = "by hand, celery redislock release KEY"
    assert [record.getMessage() for record in caplog.records] == [
        f"lock {key} force-released ({why}); it was held by {holder}, fence {fence}"
    ]
    wait_for(  # the body sees request.lock_lost, set by its watchdog
        lambda: any(e[0] == "noticed" and e[2] == x for e in setup.recorder.events()),
        what="the watchdog to report the loss",
    )
    # logged by the watchdog's reporting thread, which may come after the body saw the loss
    setup.worker.wait_for_line(f"lock '{key}' lost (not owned)", what="the loss logged")
    setup.recorder.open_gate(x)
    assert result.get(timeout=RESULT_TIMEOUT) == x


def test_release_by_task_uses_lock_on_as_the_worker_does(setup: Setup) -> None:
    user = fresh()
    task = setup.task("per_user")  # lock_on=("user_id",)
    result = task.delay(user, 1, gate=True)
    setup.started(f"{user}-1")
    released = setup.cli(
        "release", "--task", "taskapp.per_user", "--args", json.dumps([user]), "--kwargs", '{"item": 9}'
    )
    assert released.exit_code == 0, released.output
    assert released.stdout.startswith(f"released {task_lock_key(task, (user, 1))} ")
    setup.recorder.open_gate(f"{user}-1")
    assert result.get(timeout=RESULT_TIMEOUT) == f"{user}-1"


def test_companion_keys_are_not_listed_and_show_counts_the_waiters(setup: Setup) -> None:
    client = setup.recorder.client
    key = f"{setup.prefix}:plain-{fresh()}"
    holder, waiter = RedisLock(client, key, ttl=10), RedisLock(client, key, ttl=10)
    holder.acquire()
    thread = threading.Thread(target=waiter.acquire)
    thread.start()
    try:
        wait_for(lambda: client.zcard(companion_key(key, "queue")) == 1, what="the waiter to queue")
        rows = [row for row in setup.listed() if key in row["key"]]
        assert [(row["key"], row["task"], row["node"], row["pid"]) for row in rows] == [
            (key, None, socket.gethostname(), os.getpid())
        ]
        shown = setup.cli("show", key)
        assert shown.exit_code == 0, shown.output
        fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
        assert fields["waiters"] == "1"
        assert fields["fence"] == str(holder.fence)
        assert fields["task"] == "-"
    finally:
        holder.release()  # wakes the waiter
        thread.join()
        waiter.release()


def test_a_limited_tasks_permits_are_listed_and_released_by_call_and_purged(setup: Setup) -> None:
    """A task with ``lock_limit`` 3 holds a permit per run, ``{KEY}:permit:<i>``, outside
    ``prefix:*``: listed as the task's, freed by ``release --task`` and by ``purge``."""
    task, x = setup.task("limited"), fresh()
    key = task_lock_key(task, (x,), {"gate": True})

    def started(count: int) -> list[list[str]]:
        def starts() -> list[list[str]]:
            found = [e for e in setup.recorder.events() if e[0] == "start" and e[2] == x]
            return found if len(found) == count else []

        return wait_for(starts, what=f"{count} runs of {x} to start")

    runs = [task.delay(x, gate=True) for _ in range(2)]
    starts = started(2)
    rows = setup.listed("--task", "taskapp.limited")
    assert sorted((row["key"], row["permit"], row["task"], row["state"]) for row in rows) == [
        (companion_key(key, f"permit:{i}"), i, "taskapp.limited", "running") for i in (1, 2)
    ]
    assert {row["task_id"] for row in rows} == {run.id for run in runs} == {e[3] for e in starts}
    released = setup.cli(
        "release", "--task", "taskapp.limited", "--args", json.dumps([x]), "--kwargs", '{"gate": true}'
    )
    assert released.exit_code == 0, released.output
    assert released.stdout.count("released ") == 2
    assert setup.listed("--task", "taskapp.limited") == []
    setup.recorder.open_gate(x, 2)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in runs] == [x] * 2  # lost, logged, not failed
    runs = [task.delay(x, gate=True) for _ in range(2)]
    started(4)
    assert len(setup.listed("--task", "taskapp.limited")) == 2
    purged = setup.cli("purge", "--task", "taskapp.limited", "--yes")
    assert purged.exit_code == 0 and "released 2 of 2 lock(s)" in purged.stdout, purged.output
    setup.recorder.open_gate(x, 2)
    assert [run.get(timeout=RESULT_TIMEOUT) for run in runs] == [x] * 2
    assert setup.recorder.client.exists(*(companion_key(key, f"permit:{i}") for i in (1, 2, 3))) == 0


def test_the_key_of_a_limited_call_is_not_called_free_while_its_permits_are_held(setup: Setup) -> None:
    """The key of a call of a task with ``lock_limit`` above 1 (``task_lock_key``'s) names a
    semaphore, whose holds are its permits: ``show`` and ``release`` of that key said "free, or
    never taken" while runs held them. They name the permits held instead, and free nothing."""
    task, x = setup.task("limited"), fresh()
    key = task_lock_key(task, (x,))
    client = setup.recorder.client
    runs = [
        RedisSemaphore(client, key, 3, ttl=30, holder=f"task={fresh()} try=0 state=running node=n pid=1")
        for _ in range(2)
    ]
    for permit in runs:
        assert permit.acquire(blocking=False)
    try:
        for command in ("show", "release"):
            result = setup.cli(command, key)
            assert result.exit_code == 1
            assert "free, or never taken" not in result.output
            held = ", ".join(companion_key(key, f"permit:{i}") for i in (1, 2))
            assert f"no lock at key {key!r}; its permits are held: {held}" in result.output
        assert all(permit.owned() for permit in runs)
    finally:
        for permit in runs:
            permit.release()


def test_releasing_a_permit_by_key_wakes_its_semaphores_waiter(setup: Setup) -> None:
    client = setup.recorder.client
    name = f"{setup.prefix}:sem-{fresh()}"
    holder, waiter = RedisSemaphore(client, name, 1, ttl=60), RedisSemaphore(client, name, 1, ttl=60)
    assert holder.acquire(blocking=False)
    took: list[bool] = []
    thread = threading.Thread(target=lambda: took.append(waiter.acquire(timeout=30)))
    thread.start()
    try:
        wait_for(lambda: client.zcard(companion_key(name, "queue")) == 1, what="the waiter to queue")
        [row] = [row for row in setup.listed() if name in row["key"]]
        assert (row["key"], row["permit"], row["waiters"], row["task"]) == (
            companion_key(name, "permit:1"),
            1,
            1,
            None,
        )
        shown = setup.cli("show", row["key"])
        assert shown.exit_code == 0 and "permit   1" in shown.stdout, shown.output
        assert setup.cli("release", row["key"]).exit_code == 0
        thread.join(timeout=30)  # woken by the release: the holder's lease had 60 s to run
        assert took == [True]
        assert waiter.fence is not None and waiter.fence > (holder.fence or 0)
    finally:
        thread.join(timeout=30)
        waiter.release()
        with pytest.raises(LockNotOwned):  # the CLI freed its permit: it stops renewing, and says so
            holder.release()


def test_a_permit_above_a_lowered_limit_is_deleted_never_handed_to_a_waiter(setup: Setup) -> None:
    """Permit 3 of a semaphore whose limit went from 3 to 2: freed, it is not handed to a fair
    waiter of limit 2 (which has no permit 3); that waiter gets permit 1 when it is released."""
    client = setup.recorder.client
    name = f"{setup.prefix}:lowered-{fresh()}"
    old = [RedisSemaphore(client, name, 3, ttl=60) for _ in range(3)]
    for holder in old:
        assert holder.acquire(blocking=False)
    waiter = RedisSemaphore(client, name, 2, ttl=60, fair=True)
    took: list[bool] = []
    thread = threading.Thread(target=lambda: took.append(waiter.acquire(timeout=30)))
    thread.start()
    try:
        wait_for(lambda: client.zcard(companion_key(name, "queue")) == 1, what="the waiter to queue")
        third = read_lock(client, companion_key(name, "permit:3"), setup.prefix)
        assert third is not None and third.permit == 3
        assert force_release(client, third, "a test", limit=2)
        assert not client.exists(companion_key(name, "permit:3"))
        assert client.zcard(companion_key(name, "queue")) == 1 and took == []  # still waiting
        old[0].release()  # permit 1: handed to the fair waiter
        thread.join(timeout=30)
        assert took == [True]
        assert stored(client, companion_key(name, "permit:1")).split(b":")[0] == str(waiter.token).encode()
    finally:
        thread.join(timeout=30)
        waiter.release()
        old[1].release()
        with pytest.raises(LockNotOwned):  # deleted above: it stops renewing, and says so
            old[2].release()


def test_purge_asks_first_and_frees_only_that_tasks_locks(setup: Setup) -> None:
    executed, refuse = setup.task("until_executed"), setup.task("refuse")
    xs = [fresh(), fresh()]
    sent = [executed.apply_async((x,), queue=setup.idle_queue) for x in xs]
    other = refuse.apply_async((xs[0],), queue=setup.idle_queue)

    def held(name: str) -> set[str]:
        return {row["task_id"] for row in setup.listed("--task", name)}

    declined = setup.cli("purge", "--task", "taskapp.until_executed", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert held("taskapp.until_executed") >= {result.id for result in sent}
    accepted = setup.cli("purge", "--task", "taskapp.until_executed", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "Release these" in accepted.output and "released 2 of 2 lock(s)" in accepted.stdout
    assert held("taskapp.until_executed") == set()
    assert held("taskapp.refuse") == {other.id}
    quiet = setup.cli("purge", "--task", "taskapp.refuse", "--yes")
    assert quiet.exit_code == 0 and "Release these" not in quiet.output
    assert held("taskapp.refuse") == set()


def test_purge_exits_1_when_a_lock_changed_hands_before_it_was_confirmed(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``purge`` frees the holds it showed once asked: one that changed hands meanwhile is left
    to its new holder and reported (``not released``), and the command exits 1, as ``release``
    does (docs/operations.md), not 0 with a lock of the task still held."""
    client = setup.recorder.client
    key = f"{setup.prefix}:old.handed_task:{'cd' * 32}"
    shown, later = (
        RedisLock(client, key, ttl=30, holder=f"task={task_id} try=0 state=running node=n pid=1")
        for task_id in ("t1", "t2")
    )
    assert shown.acquire(blocking=False)

    def confirmed(text: str, **options: Any) -> bool:  # the user says yes once it changed hands
        shown.release()
        assert later.acquire(blocking=False)
        return True

    monkeypatch.setattr(click, "confirm", confirmed)
    try:
        purged = setup.cli("purge", "--task", "old.handed_task")
        assert f"not released {key}: it changed hands" in purged.output
        assert "released 0 of 1 lock(s)" in purged.stdout
        assert purged.exit_code == 1, purged.output
        assert later.owned()
    finally:
        later.release()


def test_purge_takes_a_task_name_the_app_no_longer_has_if_it_has_locks(setup: Setup) -> None:
    key = f"{setup.prefix}:old.renamed_task:{'ab' * 32}"
    lock = RedisLock(setup.recorder.client, key, ttl=10, holder="task=t1 try=0 state=running node=n pid=1")
    lock.acquire()
    assert [row["task"] for row in setup.listed("--task", "old.renamed_task")] == ["old.renamed_task"]
    purged = setup.cli("purge", "--task", "old.renamed_task", "--yes")
    assert purged.exit_code == 0, purged.output
    assert not lock.owned()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["release"], "give a KEY or --task NAME"),
        (["release", "k", "--task", "taskapp.per_user"], "give a KEY or --task NAME"),
        (["release", "k", "--args", "[]"], "--args and --kwargs go with --task"),
        (["release", "--task", "taskapp.per_usr"], "unknown task 'taskapp.per_usr'"),
        (["release", "--task", "taskapp.collect"], "no such LockedTask"),
        (["release", "--task", "taskapp.per_user", "--args", "[5"], "--args: not valid JSON"),
        (["release", "--task", "taskapp.per_user", "--args", '{"a": 1}'], "--args: must be a JSON list"),
        (["release", "--task", "taskapp.per_user", "--kwargs", "[]"], "--kwargs: must be a JSON object"),
        # what kombu's envelopes decode to raises what its type raises, not only ValueError
        (
            [
                "release",
                "--task",
                "taskapp.per_user",
                "--args",
                '[{"__type__": "decimal", "__value__": "x"}]',
            ],
            "--args: not valid JSON",
        ),
        (
            ["release", "--task", "taskapp.per_user", "--args", '[{"__type__": "uuid", "__value__": "x"}]'],
            "--args: not valid JSON",
        ),
        (
            [
                "release",
                "--task",
                "taskapp.per_user",
                "--kwargs",
                '{"a": {"__type__": "bytes", "__value__": 5}}',
            ],
            "--kwargs: not valid JSON",
        ),
        (["release", "--task", "taskapp.per_user", "--args", "[" * 100_000], "--args: not valid JSON"),
        (["release", "--task", "taskapp.per_user", "--args", "[1, 2, 3, 4]"], "LockKeyError"),
        (
            ["release", "--task", "taskapp.per_user", "--args", '["nobody", 1]'],
            "no lock held for taskapp.per_user",
        ),
        (["release", "no-such-key"], "no lock at key 'no-such-key'"),
        (["show", "no-such-key"], "no lock at key 'no-such-key'"),
        (["purge"], "Missing option '--task'"),
        (["purge", "--task", "taskapp.nope"], "unknown task 'taskapp.nope'"),
        (["list", "--task", "taskapp.nope"], "unknown task 'taskapp.nope'"),
        (["list", "--task", ""], "unknown task ''"),  # not every lock, as no --task lists them
        # bytes a command line holds that are not UTF-8 (Python's argv has them as lone surrogates)
        (["show", "k\udcff"], "Invalid value for 'KEY': 'k\\udcff' is not UTF-8"),
        (["release", "k\udcff"], "Invalid value for '[KEY]': 'k\\udcff' is not UTF-8"),
        (["list", "--task", "t\udcff"], "Invalid value for '--task': 't\\udcff' is not UTF-8"),
        (["purge", "--task", "t\udcff"], "Invalid value for '--task': 't\\udcff' is not UTF-8"),
    ],
)
def test_bad_input_gets_an_error_naming_it(setup: Setup, args: list[str], message: str) -> None:
    result = setup.cli(*args)
    assert result.exit_code in (1, 2)
    assert message in result.output


def test_a_broker_url_redis_py_cannot_read_is_named(refused_port: int) -> None:
    """The locks' URL taken from ``broker_url`` (no ``redislock_url``), which the settings'
    check does not see: a URL redis-py refuses ended the command with a ``ValueError``
    traceback. It is named, its password masked."""
    app = make_app(f"redis://127.0.0.1:{refused_port}/0", f"p-{fresh()}", "q")
    app.conf.update(redislock_url=None, broker_url="redis://user:secret@localhost:abc/0")
    try:
        result = run(app, "list")
    finally:
        app.close()
    assert result.exit_code == 1
    assert "broker_url='redis://user:**@localhost:abc/0'" in result.output
    assert "Port could not be cast to integer" in result.output and "secret" not in result.output


def test_a_key_that_holds_no_lock_is_named(setup: Setup) -> None:
    setup.recorder.push(f"{setup.prefix}:events", "not a lock")
    for command in ("show", "release"):
        result = setup.cli(command, f"{setup.prefix}:events")
        assert result.exit_code == 1
        assert f"key '{setup.prefix}:events' holds no lock" in result.output
    assert setup.recorder.client.exists(f"{setup.prefix}:events")


def test_keys_that_are_not_utf8_are_passed_over(setup: Setup) -> None:
    """A key that is not UTF-8 text, as no key of the package is, is passed over by the commands
    that walk the prefix: it ended them with a ``UnicodeDecodeError`` traceback, also one of
    another app that holds the prefix further in (SCAN's pattern is ``*{prefix}:*``)."""
    client = setup.recorder.client
    key = f"{setup.prefix}:old.binary_task:{fresh() * 6}{'0' * 4}"  # a task's key: 64 hex digits
    others = [
        b"\xff" + key.encode(),
        key.encode() + b"\xff",
        f"{setup.prefix}:old.binary_task:".encode() + b"\xff",
    ]
    for other in others:
        client.set(other, b"not a lock", px=60_000)
    lock = RedisLock(client, key, ttl=30, holder="task=t1 try=0 state=running node=n pid=1")
    assert lock.acquire(blocking=False)
    try:
        assert [row["key"] for row in setup.listed() if "binary_task" in row["key"]] == [key]
        summary = setup.cli("stats", "--json", "--limit", "0")
        assert summary.exit_code == 0, summary.output
        assert key in [row["key"] for row in json.loads(summary.stdout)["oldest"]["locks"]]
        purged = setup.cli("purge", "--task", "old.binary_task", "--yes")
        assert purged.exit_code == 0 and "released 1 of 1 lock(s)" in purged.stdout, purged.output
        assert not lock.owned()
    finally:
        client.delete(*others, key)


def test_listing_scans_with_the_prefix_escaped_and_never_uses_keys(
    fresh_server: RedisServer, prefix: str
) -> None:
    client = fresh_server.client()
    mine, other = f"{prefix}[x]", f"{prefix}x"  # unescaped, the pattern "{prefix}[x]:*" matches both
    locks = [RedisLock(client, f"{name}:{i}", ttl=10) for name in (mine, other) for i in range(3)]
    for lock in locks:
        lock.acquire()
    app = make_app(fresh_server.url, mine, f"q-{prefix}")
    before = command_calls(client)
    result = run(app, "list", "--json")
    calls = calls_since(client, before)
    assert result.exit_code == 0, result.output
    assert sorted(row["key"] for row in json.loads(result.stdout)) == [f"{mine}:{i}" for i in range(3)]
    assert "scan" in calls and "keys" not in calls
    for lock in locks:
        lock.release()
    client.close()


def test_the_celery_command_shows_and_releases_a_lock_held_in_an_examples_worker(
    fresh_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", fresh_server.url)
    monkeypatch.setenv("EXAMPLES_QUEUE", QUEUE)

    def celery(*args: str) -> str:
        command = [sys.executable, "-m", "celery", "-A", "examples.tasks", *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with Worker(name="cli") as worker:
        # long enough for the `celery` commands below, each a process that imports Celery, to
        # find the lock still held on a loaded machine (8 s was not, once)
        task_id = celery("call", "examples.tasks.long_report", "--args", "[30]").strip()
        [held] = wait_for(
            lambda: json.loads(celery("redislock", "list", "--json")), what="the lock to be listed"
        )
        assert (held["task"], held["task_id"], held["state"]) == (
            "examples.tasks.long_report",
            task_id,
            "running",
        )
        assert held["node"] == f"{worker.name}@{socket.gethostname()}"
        released = celery("redislock", "release", held["key"])
        assert released.startswith(f"released {held['key']} (held by task={task_id} ")
        assert json.loads(celery("redislock", "list", "--json")) == []
        worker.wait_for_log(f"lock '{held['key']}' lost (not owned)", timeout=10)
        worker.wait_for_log(f"long_report[{task_id}] succeeded", "'lost': True", timeout=90)


def test_release_by_task_reads_the_arguments_as_a_worker_receives_them(setup: Setup) -> None:
    """``--args``/``--kwargs`` are read as Celery's JSON delivers a message's arguments: a value
    sent as a datetime (kombu's ``{"__type__": ..., "__value__": ...}``) keys as the worker keys
    it. Read as plain JSON, the envelope was refused as a look-alike, and no such lock could be
    freed by call."""
    task = setup.task("hold_skip")
    when = datetime(2026, 11, 28, 22, 30, tzinfo=timezone.utc) + timedelta(
        microseconds=uuid.uuid4().int % 10**6
    )
    key = task_lock_key(task, (when,), {"gate": True})
    lock = RedisLock(setup.recorder.client, key, ttl=60)
    assert lock.acquire(blocking=False)
    sent = kombu_json.dumps([when])  # as the message carries it
    released = setup.cli(
        "release", "--task", "taskapp.hold_skip", "--args", sent, "--kwargs", '{"gate": true}'
    )
    assert released.exit_code == 0, released.output
    assert released.stdout.startswith(f"released {key} ")
    with pytest.raises(LockNotOwned):
        lock.release()
