"""A worker's run sends its release and reads the reply later: at ``task_postrun``, or first thing
in the thread's next exchange on that connection (``run_lock.release_later``).

Each test runs a real in-process worker (threads pool, one thread, so that every run, its
signals and its receivers share the thread and its loaned connection) on the suite's Redis,
and watches, from receivers of Celery's and the package's signals, when the release's
outcome is reported: ``task_success`` comes after the result is stored and before
``task_postrun``, whose package receiver reads the reply.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import redis.cluster
from celery import Celery
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from celery.signals import task_postrun, task_prerun, task_success

import celery_redislock.lock
from celery_redislock import LockedTask, LockLost, RedisLock, install, run_lock, signals, task_lock_key
from celery_redislock import _redis as pooled
from celery_redislock._scripts import ACQUIRE, RENEW
from celery_redislock.connection import client_for
from celery_redislock.testing import RedisClusterServers, RedisServer
from tests.interrupts import define
from tests.invariants import Sampler, stored
from tests.taskapp import make_app
from tests.workers import runs_over, threads_worker, wait_for

RESULT_TIMEOUT = 30
#: The task options of runs that release before ``__call__`` returns.
SYNCHRONOUS_OPTIONS: dict[str, dict[str, Any]] = {
    "on_lost_raise": {"lock_on_lost": "raise"},
    "semaphore": {"lock_limit": 2},
}


def pending_reply(client: Any) -> bool:
    """Whether this thread's loaned connection of ``client``'s pool (a ``RedisCluster``: none) has
    a reply left to read."""
    pool = getattr(client, "connection_pool", None)
    loan = None if pool is None else pooled._LOANS.by_pool.get(pool)
    return loan is not None and loan.pending is not None


class Watch:
    """What happens around the runs of the task ``name``, in order: ``(event, details)`` from its
    body, ``task_success``, ``lock_released`` and ``task_postrun`` (a receiver connected after the
    package's), and the package's WARNINGs. ``on_success`` runs in ``task_success``."""

    def __init__(self, app: Celery, name: str, client: Any) -> None:
        self.app, self.name, self.client = app, name, client
        self.events: list[tuple[str, Any]] = []
        self.on_success: Callable[[], None] | None = None

    def of(self, kind: str) -> list[Any]:
        return [details for event, details in self.events if event == kind]

    def kinds(self) -> list[str]:
        return [event for event, _ in self.events]

    def prerun(self, sender: Any = None, **_: Any) -> None:
        if sender.name == self.name:
            self.events.append(("prerun", time.monotonic()))

    def success(self, sender: Any = None, **_: Any) -> None:
        if sender.name == self.name:
            key = sender.request.lock_key
            self.events.append(("success", (time.monotonic(), pending_reply(self.client), key)))
            if self.on_success is not None:
                self.on_success()

    def released(self, sender: Any = None, **kwargs: Any) -> None:
        if sender.name == self.name:
            self.events.append(("released", kwargs))

    def postrun(self, sender: Any = None, **_: Any) -> None:
        if sender.name == self.name:
            self.events.append(("postrun", pending_reply(self.client)))


class WarningsOf(logging.Handler):
    """The package's WARNINGs, appended to ``watch``'s events as ``("warning", record)``."""

    def __init__(self, watch: Watch) -> None:
        super().__init__(logging.WARNING)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        self.watch.events.append(("warning", record))


@contextmanager
def watching(app: Celery, task: Any, kind: type[Any] = redis.Redis) -> Iterator[Watch]:
    """A ``Watch`` of ``task`` (the package's ``task_postrun`` receiver was connected when it was
    bound), whose app's lock client is a ``kind``."""
    client, _ = client_for(app)
    assert isinstance(client, kind)
    watch = Watch(app, task.name, client)
    handler = WarningsOf(watch)
    package = logging.getLogger("celery_redislock")
    connected = [
        (task_prerun, watch.prerun),
        (task_success, watch.success),
        (signals.lock_released, watch.released),
        (task_postrun, watch.postrun),
    ]
    for signal, receiver in connected:
        signal.connect(receiver, weak=False)
    package.addHandler(handler)
    level = package.level
    package.setLevel(logging.WARNING)  # the in-process worker sets the root logger's to ERROR
    try:
        yield watch
    finally:
        package.setLevel(level)
        package.removeHandler(handler)
        for signal, receiver in connected:
            signal.disconnect(receiver)


def test_the_reply_is_read_at_task_postrun_after_the_result_is_stored(
    fresh_server: RedisServer, prefix: str
) -> None:
    """The run waits for no release reply: at ``task_success`` (the result stored) the release was
    sent and processed (the key is gone) and its reply is still unread (no ``lock_released``
    yet, a reply pending on the connection); the package's ``task_postrun`` receiver read it
    and reported it once, with the run's fence and ``held`` up to the send (not the read, after
    a gap here). On a server with no script loaded yet (a new or restarted one): the acquire's
    NOSCRIPT loads the release's script too, which then runs when it arrives."""
    app = make_app(fresh_server.url, prefix, f"q-{prefix}")
    fences: list[int] = []
    task = define(app, "plain", lambda self, x: fences.append(self.request.lock_fence))
    key = task_lock_key(task, (1,))
    recorder = fresh_server.client()
    held_at_success: list[int] = []

    def look_then_pause() -> None:
        held_at_success.append(recorder.exists(key))
        gap()

    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        watch.on_success = look_then_pause
        assert task.delay(1).get(timeout=RESULT_TIMEOUT) == 1
        _wait_for_postrun(watch)
    assert held_at_success == [0]  # sent before store_result, on one connection: processed by then
    assert watch.kinds() == ["prerun", "success", "released", "postrun"]
    succeeded_at, pending_at_success, _ = watch.of("success")[0]
    assert pending_at_success
    assert watch.of("postrun") == [False]
    [released] = watch.of("released")
    assert (released["key"], released["fence"]) == (key, fences[0])
    assert (
        0 < released["held"] <= succeeded_at - watch.of("prerun")[0]
    )  # taken after prerun, sent before success
    recorder.close()


def test_a_lock_lost_before_the_release_is_reported_lost_from_the_deferred_read(
    app: Celery, prefix: str
) -> None:
    """The body's own key is deleted (the lock lost, the watchdog not told yet): the release's
    reply, read at ``task_postrun``, reports it "lost" (a WARNING with its fields), and no
    ``lock_released``; the task still succeeds (``lock_on_lost="log"``)."""
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    task = define(app, "lost", lambda self, x: recorder.delete(self.request.lock_key))
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        assert task.delay(2).get(timeout=RESULT_TIMEOUT) == 2
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "success", "warning", "postrun"]
    [record] = watch.of("warning")
    assert (record.outcome, record.lock_key) == ("lost", task_lock_key(task, (2,)))
    assert "no longer held" in record.getMessage()
    recorder.close()


def test_an_exchange_before_task_postrun_reads_the_pending_reply_first_and_gets_its_own(
    app: Celery, prefix: str
) -> None:
    """In ``task_success`` (before ``task_postrun``), the same thread takes locks through the same
    client (so the same connection): one held by another owner, one free. The release's reply
    (1) is read and reported first; each acquire gets its own answer (refused; granted with the
    fence Redis stored), where a mix-up would have read the release's 1 as "granted, fence 1"."""
    client, _ = client_for(app)
    other = redis.Redis.from_url(app.conf.redislock_url)
    theirs = RedisLock(other, f"{prefix}:theirs", ttl=10)
    assert theirs.acquire(blocking=False)
    task = define(app, "exchange")
    seen: list[object] = []

    def exchange() -> None:
        busy, free = (
            RedisLock(client, f"{prefix}:theirs", ttl=10),
            RedisLock(client, f"{prefix}:free", ttl=10),
        )
        seen.append(busy.acquire(blocking=False))
        seen.append(len(watch.of("released")))  # reported before the acquire was sent
        assert free.acquire(blocking=False)
        seen.append(free.fence == int(stored(other, f"{prefix}:free").split(b":")[1]))
        free.release()

    with Sampler(other, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        watch.on_success = exchange
        assert task.delay(3).get(timeout=RESULT_TIMEOUT) == 3
        _wait_for_postrun(watch)
    assert seen == [False, 1, True]
    assert watch.kinds() == ["prerun", "success", "released", "postrun"]
    assert stored(other, f"{prefix}:theirs").startswith((theirs.token or "-").encode())
    theirs.release()
    other.close()


def test_an_interrupted_deferred_read_drops_the_connection_and_the_next_run_gets_its_own_answers(
    app: Celery, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit lands in the read of the release's reply (at ``task_postrun``): the
    connection is dropped (no late reply for its next user), the outcome logged as unknown
    ("error"; the key expires within its lease), and the thread's next run takes and releases
    its own lock, with the right answers."""
    task = define(app, "interrupted")
    interrupted: list[int] = []
    read_response = redis.connection.AbstractConnection.read_response

    def interrupting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if armed and not interrupted:
            interrupted.append(1)
            raise SoftTimeLimitExceeded()
        return read_response(self, *args, **kwargs)

    armed = False

    def arm() -> None:
        nonlocal armed
        armed = True  # the next read on this thread is the release's, at task_postrun

    dropped: list[bool] = []

    def dropped_at_postrun(sender: Any = None, **_: Any) -> None:
        if sender.name == task.name and interrupted and not dropped:
            loan = pooled._LOANS.by_pool[watch.client.connection_pool]
            dropped.append(loan.connection._sock is None)

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", interrupting)
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    task_postrun.connect(dropped_at_postrun, weak=False)
    try:
        with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
            watch.on_success = arm
            assert task.delay(4).get(timeout=RESULT_TIMEOUT) == 4
            _wait_for_postrun(watch)
            watch.on_success = None
            assert task.delay(5).get(timeout=RESULT_TIMEOUT) == 5
            _wait_for_postrun(watch, runs=2)
    finally:
        task_postrun.disconnect(dropped_at_postrun)
    assert interrupted == [1] and dropped == [True]
    [record] = watch.of("warning")
    assert record.outcome == "error" and "interrupted" in record.getMessage()
    assert watch.kinds() == [
        "prerun",
        "success",
        "warning",
        "postrun",
        "prerun",
        "success",
        "released",
        "postrun",
    ]
    [released] = watch.of("released")
    assert released["key"] == task_lock_key(task, (5,))
    recorder.delete(task_lock_key(task, (4,)))  # the interrupted release's outcome is unknown here
    recorder.close()


def pausing_writes(locks: redis.Redis) -> Callable[[Any, int], None]:
    """A body that pauses the lock server for writes: the release sent after it waits there."""
    return lambda self, x: locks.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # type: ignore[no-untyped-call]


def cutter(watch: Watch, locks: redis.Redis, killed: list[int]) -> Callable[[], None]:
    """For ``task_success``: kill this thread's loaned connection, the release's (which Redis has not
    run: writes are paused), then let the server go on."""

    def cut() -> None:
        assert locks.exists(watch.of("success")[-1][2]) == 1  # the release sent, not run: paused
        loan = pooled._LOANS.by_pool[watch.client.connection_pool]
        host, port = loan.connection._sock.getsockname()
        killed.append(locks.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}"))  # type: ignore[no-untyped-call]
        locks.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]

    return cut


def test_a_deferred_release_lost_with_its_connection_is_sent_again_and_frees_the_lock_at_once(
    redis_server: RedisServer, fresh_server: RedisServer, prefix: str
) -> None:
    """The release was sent, and its connection broke before Redis ran it (as a restart or a
    network cut would): reading its reply fails with a ``ConnectionError``, not an interrupt, so
    the run sends the release again, once, and the lock is free once the run is over, reported
    released once, instead of being left to its lease."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_url=fresh_server.url)
    locks = fresh_server.client()
    task = define(app, "cut", pausing_writes(locks))
    killed: list[int] = []
    with watching(app, task) as watch, threads_worker(app, concurrency=1):
        watch.on_success = cutter(watch, locks, killed)
        assert task.delay(7).get(timeout=RESULT_TIMEOUT) == 7
        _wait_for_postrun(watch)
    assert killed == [1]
    assert locks.exists(task_lock_key(task, (7,))) == 0
    assert watch.kinds() == ["prerun", "success", "released", "postrun"]
    locks.close()


def test_an_interrupt_while_the_release_is_sent_again_reports_its_outcome_unknown_once(
    redis_server: RedisServer, fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, and a soft time limit lands while the release is sent again: the outcome is
    reported once, unknown ("error", the connection's error: the key expires within its lease),
    and the interrupt goes on up (the trace logs it; the result stays the body's)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_url=fresh_server.url)
    locks = fresh_server.client()
    task = define(app, "cut-interrupted", pausing_writes(locks))
    resent: list[bool] = []

    def interrupted_again(self: Any, token: str) -> bool:
        resent.append(True)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(celery_redislock.lock.OneServer, "free_once", interrupted_again)
    killed: list[int] = []
    with watching(app, task) as watch, threads_worker(app, concurrency=1):
        watch.on_success = cutter(watch, locks, killed)
        assert task.delay(8).get(timeout=RESULT_TIMEOUT) == 8
        _wait_for_postrun(watch)
    assert killed == [1] and resent == [True]
    assert watch.kinds() == ["prerun", "success", "warning", "postrun"]
    [record] = watch.of("warning")
    assert record.outcome == "error" and "Connection closed by server" in record.getMessage()
    assert 0 < locks.pttl(task_lock_key(task, (8,))) <= 30_000  # left to its lease
    locks.delete(task_lock_key(task, (8,)))
    locks.close()


def test_a_deferred_release_whose_reply_times_out_is_not_sent_again(
    redis_server: RedisServer, fresh_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that times out (the lock client's ``socket_timeout``, 0.5 s here; the server has the
    release and is slow: paused) is not a broken connection: Redis most likely ran the release,
    or will, and would be as slow to answer another, so none is sent; the outcome is reported
    unknown once ("error"), the key left to its lease."""
    lock_url = f"{fresh_server.url}?socket_timeout=0.5"
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_url=lock_url)
    locks = fresh_server.client()
    task = define(app, "slow", pausing_writes(locks))
    resent: list[str] = []
    monkeypatch.setattr(
        celery_redislock.lock.OneServer, "free_once", lambda self, token: resent.append(token)
    )
    try:
        with watching(app, task) as watch, threads_worker(app, concurrency=1):
            assert task.delay(9).get(timeout=RESULT_TIMEOUT) == 9
            _wait_for_postrun(watch)
    finally:
        locks.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
    assert resent == []
    assert watch.kinds() == ["prerun", "success", "warning", "postrun"]
    [record] = watch.of("warning")
    assert record.outcome == "error" and "Timeout" in record.getMessage()
    locks.delete(task_lock_key(task, (9,)))  # its outcome is unknown here
    locks.close()


def test_a_direct_call_releases_before_returning(app: Celery) -> None:
    """A direct call (``task(...)``: no trace, no ``task_postrun`` follows) knows its release's
    outcome when it returns, and leaves nothing to read."""
    task = define(app, "direct")
    with watching(app, task) as watch:
        assert task(6) == 6
        assert watch.kinds() == ["released"]
        assert not pending_reply(watch.client)
        assert not watch.client.exists(task_lock_key(task, (6,)))


@pytest.mark.parametrize("how", ["on_lost_raise", "semaphore", "pool_lends_per_exchange"])
def test_where_the_outcome_is_needed_or_cannot_wait_a_run_releases_before_returning(
    redis_server: RedisServer, prefix: str, how: str
) -> None:
    """``lock_on_lost="raise"`` (a loss found at release fails the run), a semaphore (its permits
    release with a script of their own), and a client whose pool lends a connection per
    exchange (``max_connections`` of the user's: the connection goes back to the pool) release
    before ``__call__`` returns: reported before ``task_success``, nothing left to read."""
    conf: dict[str, Any] = {}
    if how == "pool_lends_per_exchange":
        conf["redislock_url"] = None
        conf["redislock_client"] = redis.Redis.from_url(redis_server.url, max_connections=8)
    app = make_app(redis_server.url, prefix, f"q-{prefix}", **conf)
    options = SYNCHRONOUS_OPTIONS.get(how, {})
    task = define(app, how, **options)
    recorder = redis_server.client()
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        assert task.delay(7).get(timeout=RESULT_TIMEOUT) == 7
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "released", "success", "postrun"]
    assert watch.of("success")[0][1] is False  # no reply pending at task_success
    recorder.close()
    app.close()
    if how == "pool_lends_per_exchange":
        conf["redislock_client"].close()


def test_a_loss_at_release_with_raise_fails_the_run(app: Celery, prefix: str) -> None:
    """``lock_on_lost="raise"``: a lock lost before its release turns the run into a ``LockLost``
    failure, which needs the release's reply before ``__call__`` returns."""
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    task = define(
        app, "raise_lost", lambda self, x: recorder.delete(self.request.lock_key), lock_on_lost="raise"
    )
    with Sampler(recorder, prefix), threads_worker(app, concurrency=1), pytest.raises(LockLost):
        task.delay(8).get(timeout=RESULT_TIMEOUT)
    recorder.close()


def test_once_a_result_is_in_its_lock_can_be_taken_at_once(app: Celery, prefix: str) -> None:
    """The release is sent before the result is stored: once ``result.get()`` returns, a lock on
    the run's key is taken at once, every time, however long the worker takes to get to
    ``task_postrun`` (here a ``task_success`` receiver leaves a gap)."""
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    task = define(app, "visible")
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        watch.on_success = gap
        for x in range(5):
            assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
            after = RedisLock(recorder, task_lock_key(task, (x,)), ttl=10)
            assert after.acquire(blocking=False), f"run {x}: its lock was still held after its result"
            after.release()
            _wait_for_postrun(watch, runs=x + 1)
    recorder.close()


def gap(*_: object) -> None:
    """A pause of the worker's thread between the release's send and ``task_postrun`` (a gap to
    cross, not a synchronisation)."""
    threading.Event().wait(0.3)


def _wait_for_postrun(watch: Watch, runs: int = 1) -> None:
    """``task_postrun`` of ``runs`` runs was sent (the result is stored before it), and the
    package finished them (a run ``after_return`` did not finish is finished after
    ``task_postrun``, as its trace ends)."""
    wait_for(
        lambda: watch.kinds().count("postrun") >= runs and runs_over(watch.name),
        what=lambda: f"task_postrun and the runs' end: {watch.kinds()}",
    )


def test_a_cluster_run_waits_for_its_release_and_task_postrun_finishes_an_interrupted_one(
    cluster: RedisClusterServers, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``RedisCluster`` client (no pool of its own) waits for its release's reply; a release
    interrupted there (a soft time limit) is finished by ``task_postrun``, which finds no reply
    to read on a Cluster client and releases the lock."""
    app = Celery("cluster-defer", set_as_current=False)
    app.conf.update(redislock_url=cluster.url, redislock_prefix=prefix, task_always_eager=True)
    task = define(app, "cluster")
    free = celery_redislock.lock.RedisLock._free
    interrupted: list[int] = []

    def interrupting(self: Any, token: str) -> bool:
        if not interrupted:
            interrupted.append(1)
            raise SoftTimeLimitExceeded()
        return free(self, token)

    with watching(app, task, redis.cluster.RedisCluster) as watch:
        assert task.delay(9).get() == 9
        monkeypatch.setattr(celery_redislock.lock.RedisLock, "_free", interrupting)
        result = task.delay(10)
    assert isinstance(result.result, SoftTimeLimitExceeded)
    assert interrupted == [1]
    assert watch.kinds() == ["prerun", "released", "success", "postrun", "prerun", "released", "postrun"]
    assert not watch.client.exists(task_lock_key(task, (10,)))


def test_a_forked_child_never_reads_its_parents_pending_reply(redis_server: RedisServer, prefix: str) -> None:
    """A release's reply is pending on the parent's connection when it forks: the child reads
    nothing of it (``settle_later`` and a lock of its own through the same client get their own
    answers), and the parent then reads it, its own."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=10)
    other = redis_server.client()
    theirs = RedisLock(other, f"{prefix}:theirs", ttl=10)
    assert theirs.acquire(blocking=False)
    mine = RedisLock(client, f"{prefix}:mine", ttl=10)
    assert mine.acquire(blocking=False)
    outcomes: list[object] = []
    assert run_lock._release_sent(mine, outcomes.append)
    pid = os.fork()
    if pid == 0:  # the child: exits with 0 only if it read nothing of its parent's
        code = 1
        try:
            pooled.settle_later(client)
            busy = RedisLock(client, f"{prefix}:theirs", ttl=10).acquire(blocking=False)
            code = 0 if outcomes == [] and busy is False else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    pooled.settle_later(client)
    assert outcomes == [True]
    assert not other.exists(f"{prefix}:mine")
    theirs.release()
    client.close()
    other.close()


def test_an_interrupt_right_after_the_send_leaves_the_reply_to_task_postrun_reported_once(
    app: Celery, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit lands just after the release was sent, before the run forgot its hold:
    the run fails with it, and ``task_postrun`` reads the reply and reports it once
    (``lock_released``), without releasing again (which would find the lock gone: "lost")."""
    task = define(app, "sent_then_interrupted")

    def interrupted_after_sending(*args: Any) -> bool:
        assert pooled.send_later(*args)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(celery_redislock.lock, "send_later", interrupted_after_sending)
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        result = task.delay(11)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=RESULT_TIMEOUT)
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "released", "postrun"]
    assert watch.of("released")[0]["key"] == task_lock_key(task, (11,))
    assert not recorder.exists(task_lock_key(task, (11,)))
    recorder.close()


def test_a_refused_script_load_leaves_no_reply_for_the_next_exchange(prefix: str) -> None:
    """NOSCRIPT loads the script and RELEASE in one write; a user that may not load scripts (ACL
    ``-script|load``, the scripts preloaded) gets every load's reply read before the refusal
    raises: the connection's next exchange reads its own reply (a held lock stays busy)."""
    with RedisServer() as server:
        admin = server.client()
        if int(admin.info("server")["redis_version"].split(".")[0]) < 7:
            pytest.skip("ACL rules on subcommands (-script|load) need Redis 7")
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "-script|load")  # type: ignore[no-untyped-call]
        admin.script_load(ACQUIRE.source)
        admin.set(f"{prefix}:held", "x" * 32 + ":5:someone", px=600_000)
        kwargs = admin.connection_pool.connection_kwargs
        client = redis.Redis(host=kwargs["host"], port=kwargs["port"], username="app", password="pw")
        with pytest.raises(redis.exceptions.NoPermissionError):
            RENEW(client, [f"{prefix}:nothing"], [1000, "t" * 32])  # NOSCRIPT: both loads refused
        theirs = RedisLock(client, f"{prefix}:held", ttl=10, watchdog=False)
        assert not theirs.acquire(blocking=False)
        assert admin.get(f"{prefix}:held") == b"x" * 32 + b":5:someone"
        client.close()
        admin.close()


@pytest.mark.parametrize("where", ["body-plain", "body-locked", "success-plain"])
def test_a_run_started_inside_a_run_leaves_it_its_own_task_postrun(app: Celery, where: str) -> None:
    """A run applied eagerly in the thread of another (in its body, or in ``task_success`` once
    its release is sent), a plain task or a locked one, ends with its own ``task_postrun``: the
    outer run's reply is still read and reported at the outer run's ``task_postrun``."""

    def plain(x: int) -> int:
        return x

    inner = (
        define(app, "inner-locked")
        if where == "body-locked"
        else app.task(shared=False, name="defer.inner")(plain)
    )

    def nested(*_: Any) -> None:
        assert inner.apply((7,)).get() == 7

    task = define(app, f"outer-{where}", nested if where.startswith("body") else None)
    with watching(app, task) as watch, threads_worker(app, concurrency=1):
        if where == "success-plain":
            watch.on_success = nested
        assert task.delay(4).get(timeout=RESULT_TIMEOUT) == 4
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "success", "released", "postrun"]
    assert watch.of("postrun") == [False]  # nothing left to read once it is over


@pytest.mark.parametrize(
    "on_lost", ["log", "raise"]
)  # the replacement's release: read after its result, or before
def test_an_eager_run_replaced_by_a_call_of_other_arguments_reports_both_releases(
    app: Celery, on_lost: str
) -> None:
    """``apply()`` of a run that replaces itself (``task.replace()``) with a call of other
    arguments: Celery runs the replacement at once, in the run's thread under the same task id,
    before the run ends. The run still holds its lock once the replacement ended, and each
    run's release is read and reported (``lock_released``) as its own trace ends, the
    replacement's first, before ``apply()`` returns, nothing left to read."""
    held_after: list[int] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=f"defer.replaced_eagerly_{on_lost}",
        lock_on_lost=on_lost,
    )
    def task(self: Any, x: int) -> Any:
        if x != 1:
            return x
        replaced = self.replace(task.s(x + 1))
        held_after.append(watch.client.exists(self.request.lock_key))
        return replaced

    with watching(app, task) as watch:
        assert task.apply((1,)).get() == 2
        assert held_after == [1]
        assert [event["key"] for event in watch.of("released")] == [
            task_lock_key(task, (2,)),
            task_lock_key(task, (1,)),
        ]
        assert not pending_reply(watch.client)
        assert runs_over(task.name)


def test_an_interrupt_right_after_the_send_inside_send_later_is_reported_once_as_unknown(
    app: Celery, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit lands as the release's bytes are written (``send_later``, before it
    returns): the release may have run, so the outcome is unknown, reported once ("error"),
    never "lost" (``task_postrun`` does not release again); the release ran, the key is gone."""
    task = define(app, "interrupted_in_send")
    send = redis.connection.AbstractConnection.send_packed_command

    def sent_then_interrupted(self: Any, command: Any, check_health: bool = True) -> None:
        send(self, command, check_health)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        if sys._getframe(1).f_code.co_name == "send_later":
            raise SoftTimeLimitExceeded()

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", sent_then_interrupted)
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    with watching(app, task) as watch, threads_worker(app, concurrency=1):
        result = task.delay(12)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=RESULT_TIMEOUT)
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "warning", "postrun"]
    [record] = watch.of("warning")
    assert record.outcome == "error" and "interrupted" in record.getMessage()
    wait_for(lambda: not recorder.exists(task_lock_key(task, (12,))), what="the release sent to have run")
    recorder.close()


def test_a_connection_killed_while_the_body_runs_is_made_afresh_for_the_release(app: Celery) -> None:
    """The server closes the thread's connection while the body runs (``CLIENT KILL``): the
    release is sent on a new one (the closed one is found before the send), and frees the key.
    Only the lock's connections are killed (their last command a script's: the acquire's, the
    watchdog's), not the broker's or the result backend's, which the worker and ``get()`` use."""
    recorder = redis.Redis.from_url(app.conf.redislock_url)

    killed: list[str] = []

    def kill_the_others(self: Any, x: int) -> None:
        for client in recorder.client_list():
            if client["cmd"] in ("evalsha", "eval"):
                recorder.client_kill_filter(_id=client["id"])
                killed.append(client["id"])

    task = define(app, "killed", kill_the_others)
    with watching(app, task) as watch, threads_worker(app, concurrency=1):
        assert task.delay(1).get(timeout=RESULT_TIMEOUT) == 1
        _wait_for_postrun(watch)
    assert killed, "no lock connection was killed"
    assert watch.kinds() == ["prerun", "success", "released", "postrun"]
    assert not recorder.exists(task_lock_key(task, (1,)))
    recorder.close()


def test_an_exchange_during_the_deferred_read_or_in_its_receivers_gets_its_own_reply(
    redis_server: RedisServer,
) -> None:
    """While a reply left pending is read (an exchange a signal handler starts meanwhile) and
    handed over (``then``: ``lock_released`` receivers, user code, which may release a lock of its
    own), the connection stays in use: such an exchange lends a connection of its own and gets
    its own reply, a nested ``send_later`` sends nothing, and the exchange the read came first
    in gets its own reply too."""
    client = redis_server.client()
    seen: list[object] = []

    def echo(word: bytes) -> bytes:
        with pooled.PooledConnection(client) as connection:
            connection.send_command("ECHO", word)
            reply: bytes = connection.read_response()
            return reply

    def read(connection: Any) -> Any:
        seen.append(echo(b"handler"))  # as a signal handler's exchange during the read would
        return connection.read_response()

    def then(reply: Any) -> None:
        seen.append(reply)
        seen.append(pooled.send_later(client, b"*1\r\n$4\r\nPING\r\n", read, seen.append))
        seen.append(echo(b"receiver"))

    assert pooled.send_later(client, b"*1\r\n$4\r\nPING\r\n", read, then)
    assert echo(b"own") == b"own"
    assert seen == [b"handler", b"PONG", False, b"receiver"]
    assert not pending_reply(client)
    client.close()


@pytest.mark.parametrize("ending", ["ignored", "rejected"])
def test_a_body_that_ends_with_no_after_return_has_its_release_read_at_once(
    app: Celery, prefix: str, ending: str
) -> None:
    """A body that raises ``Ignore`` or ``Reject``: Celery calls no ``after_return`` for it, so
    the run waits for its release's reply (in the task's span, before ``task_postrun``) instead
    of sending it to be read later: ``lock_released`` once, the key free, the run over."""

    def body(self: Any, x: int) -> None:
        raise Ignore() if ending == "ignored" else Reject("refused", requeue=False)

    task = define(app, ending, body)
    key = task_lock_key(task, (4,))
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        result = task.delay(4)
        _wait_for_postrun(watch)
    assert watch.kinds() == ["prerun", "released", "postrun"]
    assert [released["key"] for released in watch.of("released")] == [key]
    assert not recorder.exists(key)
    assert runs_over(task.name, result.id)
    recorder.close()


class _NoSuperAfterReturn(LockedTask):
    """A ``LockedTask`` whose ``after_return`` does not call ``super()``."""

    def after_return(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize("ending", ["after_return not calling super()", "storing the result interrupted"])
def test_a_run_after_return_did_not_finish_is_finished_as_its_trace_ends(
    app: Celery, prefix: str, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release is sent as the body ends, its reply left for ``after_return``; here nothing
    calls the package's (an override that does not call ``super()``, or a soft time limit landing
    as the result is stored: Celery skips ``after_return``). The reply is read and reported as
    the run's trace ends (its request popped, after ``task_postrun``): ``lock_released`` once,
    the key free, the run over. Nothing read it when the package's finishing step was disabled:
    no ``lock_released``, and the run stayed in the package's registry."""
    task = define(app, "unfinished", **({"base": _NoSuperAfterReturn} if "super" in ending else {}))
    if "interrupted" in ending:
        mark_as_done = type(app.backend).mark_as_done

        def interrupted(backend: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
            request = kwargs.get("request", args[1] if len(args) > 1 else None)
            if getattr(request, "task", None) == task.name:
                raise SoftTimeLimitExceeded()
            return mark_as_done(backend, task_id, *args, **kwargs)

        monkeypatch.setattr(type(app.backend), "mark_as_done", interrupted)
    key = task_lock_key(task, (5,))
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    with Sampler(recorder, prefix), watching(app, task) as watch, threads_worker(app, concurrency=1):
        result = task.delay(5)
        _wait_for_postrun(watch)
    assert watch.kinds()[-2:] == ["postrun", "released"]  # after task_postrun, as the trace ends
    assert [released["key"] for released in watch.of("released")] == [key]
    assert not recorder.exists(key)
    assert runs_over(task.name, result.id)
    recorder.close()


def test_the_package_connects_no_task_postrun_receiver(app: Celery) -> None:
    """With any ``task_postrun`` receiver connected, Celery's tracer sends that signal after every
    task the worker runs, locked or not (about 30,000 instructions each: docs/benchmarks.md). A
    ``LockedTask`` finishes a run that ``after_return`` did not at the end of its trace instead
    (``receivers.RunRequests``)."""
    define(app, "bound")
    install(app)
    receivers = [r() if isinstance(r, weakref.ReferenceType) else r for _, r in task_postrun.receivers]
    assert [r for r in receivers if getattr(r, "__module__", "").startswith("celery_redislock")] == []


def test_a_locked_tasks_request_stack_is_still_callable_as_celerys(app: Celery) -> None:
    """Celery's request stack (``celery.utils.threads.LocalStack``), called, gives a proxy to
    the request on top, as its docstring says: ``task.request_stack().id`` is the run's id. The
    stack ``LockedTask`` puts in its place (``receivers.RunRequests``) forwarded ``push``,
    ``pop``, ``top``, ``stack`` and ``len()``, but not the call (a special method, which
    ``__getattr__`` never sees): the body failed with ``TypeError: 'RunRequests' object is
    not callable``."""
    seen: list[str] = []

    def body(self: Any, x: int) -> None:
        seen.append(self.request_stack().id)

    task = define(app, "called_stack", body)
    result = task.apply((6,))
    assert result.state == "SUCCESS", result.result
    assert seen == [result.id]
    with pytest.raises(RuntimeError, match="object unbound"):  # no run: nothing on top, as Celery's
        _ = task.request_stack().id


def test_a_run_is_finished_as_its_trace_ends_after_its_task_was_bound_to_another_app(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    """A task class also bound to a second app (which registers the same task object, as a
    process building apps on demand does), its ``after_return`` not calling ``super()``: a run
    traced by Celery (``apply()``) is still finished as its trace ends (its release's reply
    read, ``lock_released`` sent, the run over). The package kept its runs per app: the run was
    put under the task's ``app`` (a function task's stays the first), and its request stack,
    wrapped anew for the second app, looked under that one. The run was never finished: no
    ``lock_released``, and a lock an interrupt kept from being released stayed held, renewed,
    for as long as the process lived."""
    task = define(app, "rebound", base=_NoSuperAfterReturn)
    other = make_app(redis_server.url, prefix, f"q-{prefix}-other")
    other.register_task(task._get_current_object())
    key = task_lock_key(task, (7,))
    recorder = redis.Redis.from_url(app.conf.redislock_url)
    try:
        with Sampler(recorder, prefix), watching(app, task) as watch:
            result = task.apply((7,))
            assert result.get() == 7
        assert [released["key"] for released in watch.of("released")] == [key]
        assert not recorder.exists(key)
        assert runs_over(task.name, result.id)
    finally:
        recorder.close()
        other.close()
