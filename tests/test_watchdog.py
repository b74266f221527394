"""The watchdog: renewal in batches, loss detection, fork, and a killed holder."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock import LockedTask, LockNotOwned, RedisLock, task_lock_key
from celery_redislock import watchdog as watchdog_module
from celery_redislock._scripts import RENEW
from celery_redislock.signals import lock_lost
from celery_redislock.testing import RedisServer
from celery_redislock.watchdog import Lease, get_watchdog
from tests.conftest import Topology, calls_in, calls_since, command_calls
from tests.interrupts import Interrupt
from tests.taskapp import LEASE, make_app
from tests.workers import renewed, threads_worker, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def lost_reports(prefix: str) -> Iterator[list[dict[str, Any]]]:
    """The ``lock_lost`` reports of the test's own locks: the process's one reporting thread may
    still deliver another test's, lost as it ended, while this one runs."""
    reports: list[dict[str, Any]] = []

    def receiver(sender: RedisLock, **kwargs: Any) -> None:
        if kwargs["key"].startswith(f"{prefix}:"):
            reports.append({"sender": sender, **kwargs})

    lock_lost.connect(receiver, weak=False)
    yield reports
    lock_lost.disconnect(receiver)


def test_a_deleted_key_is_reported_lost_within_one_interval(
    fresh_server: RedisServer,
    prefix: str,
    lost_reports: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = fresh_server.client()
    client.script_load(RENEW.source)  # so that the count below is of renewals only
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    with client.pipeline(transaction=True) as deletion:  # counted from the deletion on, atomically
        deletion.delete(f"{prefix}:k")
        deletion.info("commandstats")
        before = calls_in(deletion.execute()[1])
    assert lock.lost.wait(5)
    # The very next renewal (they run every ttl/3) found the key gone: one script call.
    assert calls_since(client, before).get("evalsha") == 1
    wait_for(lambda: lost_reports, 10, "the report")  # made by the reporting thread, after `lost`
    assert [(r["sender"], r["key"], r["reason"]) for r in lost_reports] == [
        (lock, f"{prefix}:k", "not owned")
    ]
    assert any(
        record.levelname == "ERROR" and f"{prefix}:k" in record.getMessage() for record in caplog.records
    )
    with pytest.raises(LockNotOwned):
        lock.release()
    assert client.exists(f"{prefix}:k") == 0


def test_a_lock_taken_by_another_token_is_reported_lost_and_left_alone(
    topology: Topology, prefix: str, lost_reports: list[dict[str, Any]]
) -> None:
    """On every topology (one server, Redlock, Cluster, Sentinel)."""
    lock = RedisLock(topology.lock_client(), f"{prefix}:k", ttl=0.6)
    lock.acquire()
    stale_fence = lock.fence
    topology.delete(f"{prefix}:k")
    thief = RedisLock(topology.lock_client(), f"{prefix}:k", ttl=5, watchdog=False)
    thief.acquire()
    assert lock.lost.wait(5)
    with pytest.raises(LockNotOwned):
        lock.extend()
    with pytest.raises(LockNotOwned):
        lock.release()
    assert thief.owned()
    assert thief.fence is not None and stale_fence is not None and thief.fence > stale_fence
    thief.release()


def test_renewal_stops_when_released(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    lock.release()
    assert len(get_watchdog()) == 0
    before = command_calls(client)
    threading.Event().wait(0.5)  # longer than two renewal intervals
    assert calls_since(client, before) == {}
    assert client.keys("*") == []


def test_renewal_batches_many_locks_into_few_round_trips(fresh_server: RedisServer, prefix: str) -> None:
    client = fresh_server.client()
    locks = [RedisLock(client, f"{prefix}:{i}", ttl=3) for i in range(3000)]
    for lock in locks:
        lock.acquire()
    before = command_calls(client)
    threading.Event().wait(2.0)  # two renewal intervals of 1 s
    renew_calls = calls_since(client, before).get("evalsha", 0)
    for lock in locks:
        lock.release()
    assert all(not lock.lost.is_set() for lock in locks)
    # Unbatched, 3000 leases would take 6000 calls in two intervals. Batched (2000 leases a call),
    # leases acquired over more than one interval on a loaded machine fall due in a few waves: the
    # contract is at most 10 round trips per interval, whatever the number of locks.
    assert 1 <= renew_calls <= 20


def test_garbage_collected_lock_is_not_renewed(client: redis.Redis, prefix: str) -> None:
    lock = RedisLock(client, f"{prefix}:k", ttl=0.6)
    lock.acquire()
    del lock
    deadline = time.monotonic() + 10
    while client.exists(f"{prefix}:k"):  # expires: nobody renews a lock nobody holds
        assert time.monotonic() < deadline


def test_holder_sigkilled_frees_the_lock_within_one_ttl(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    key = f"{prefix}:k"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.holder", redis_server.url, key, str(LEASE)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("acquired")
        waiter = RedisLock(client, key, ttl=5)
        # Held past its lease while the holder lives: its watchdog renews it.
        assert not waiter.acquire(timeout=1.5 * LEASE)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert 0 < client.pttl(key) <= LEASE * 1000  # nobody renews it now: gone within one TTL
        assert waiter.acquire(timeout=10 * LEASE)
        waiter.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()


def _child(url: str, prefix: str, inherited: RedisLock, results: Any) -> None:
    """In a forked child: the inherited hold is not ours; our own lock is renewed by our watchdog."""
    try:
        try:
            inherited.release()
            released_inherited = True
        except LockNotOwned:
            released_inherited = False
        client = redis.Redis.from_url(url)
        lock = RedisLock(client, f"{prefix}:child", ttl=LEASE)
        lock.acquire()
        kept = not lock.lost.wait(1.5 * LEASE)  # four renewals or more
        results.put((released_inherited, kept and lock.owned(), get_watchdog().pid == os.getpid()))
        lock.release()
    except BaseException as exc:
        results.put(repr(exc))
        raise


def test_fork_child_renews_its_own_locks_and_not_the_parents(redis_server: RedisServer, prefix: str) -> None:
    import multiprocessing

    client = redis_server.client()
    parent_lock = RedisLock(client, f"{prefix}:parent", ttl=LEASE)
    parent_lock.acquire()  # the parent's watchdog thread is running
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child, args=(redis_server.url, prefix, parent_lock, results))
    child.start()
    try:
        outcome = results.get(timeout=30)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert outcome == (False, True, True)
    assert child.exitcode == 0
    # The parent's watchdog never held the child's lease, and its own hold survived the child.
    assert {lease.key for lease in get_watchdog().leases} == {f"{prefix}:parent"}
    assert parent_lock.owned()
    parent_lock.release()
    assert client.exists(f"{prefix}:child") == 0


class HeldRenewal:
    """A seam in the process's watchdog: the first renewal that carries a lease of one key is held
    between its pick and its send until ``go`` is set.

    ``picked`` is set once it is held, ``landed`` once it was sent and answered, and
    ``owner_waits`` when an owner waits for a renewal in flight to land.
    """

    def __init__(self) -> None:
        self.picked, self.go, self.landed, self.owner_waits = (threading.Event() for _ in range(4))


@pytest.fixture
def held_renewal(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], HeldRenewal]:
    def hold(key: str) -> HeldRenewal:
        held, watchdog = HeldRenewal(), get_watchdog()
        renew_node, await_landing = watchdog._renew_node, getattr(watchdog, "_await_landing", None)

        def held_renew_node(node: Any, batches: list[list[Lease]], ttl_ms: int) -> Any:
            keys = {lease.key for batch in batches for lease in batch}
            if held.picked.is_set() or key not in keys:
                return renew_node(node, batches, ttl_ms)
            held.picked.set()
            held.go.wait(60)
            try:
                return renew_node(node, batches, ttl_ms)
            finally:
                held.landed.set()

        def waits(*args: Any) -> Any:
            held.owner_waits.set()
            assert await_landing is not None
            return await_landing(*args)

        monkeypatch.setattr(watchdog, "_renew_node", held_renew_node)
        monkeypatch.setattr(watchdog, "_await_landing", waits, raising=False)
        return held

    return hold


def test_an_extend_is_not_undone_by_a_renewal_in_flight(
    redis_server: RedisServer, prefix: str, held_renewal: Callable[[str], HeldRenewal]
) -> None:
    """The watchdog has picked a lease for renewal (6 s) and not sent it yet when its owner
    extends the lock to 60 s: the renewal, sent afterwards, must not bring the TTL back to 6 s.
    (extend() waits for the renewal in flight to land, and keeps the lease from being picked.)"""
    client, key = redis_server.client(), f"{prefix}:k"
    held = held_renewal(key)
    lock = RedisLock(client, key, ttl=6)
    assert lock.acquire()
    assert held.picked.wait(30)
    extend = threading.Thread(target=lock.extend, args=(60,))
    extend.start()
    wait_for(lambda: held.owner_waits.is_set() or not extend.is_alive(), what="the extend")
    held.go.set()
    extend.join(30)
    assert held.landed.wait(30)
    assert client.pttl(key) > 50_000
    lock.release()


def test_a_period_kept_after_the_run_is_not_undone_by_a_renewal_in_flight(
    redis_server: RedisServer, prefix: str, held_renewal: Callable[[str], HeldRenewal]
) -> None:
    """An ``until_expired`` task (lock_ttl 6 s, lock_period 60 s) ends while the watchdog holds a
    renewal of its lock between pick and send: the lock must stay for the period's rest, not be
    renewed back to lock_ttl by that renewal (SETTLE waits for it to land)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    body_ends = threading.Event()

    @app.task(base=LockedTask, bind=True, shared=False, lock_mode="until_expired", lock_ttl=6, lock_period=60)
    def periodic(self: Any, x: str) -> str:
        body_ends.wait(60)
        return x

    key = task_lock_key(periodic, ("x",))
    held = held_renewal(key)
    try:
        with threads_worker(app, concurrency=1):
            result = periodic.delay("x")
            assert held.picked.wait(30)
            body_ends.set()
            wait_for(lambda: held.owner_waits.is_set() or client_pttl(app, key) > 6_000, what="the run's end")
            held.go.set()
            assert result.get(timeout=30) == "x"
            assert held.landed.wait(30)
        assert client_pttl(app, key) > 40_000
    finally:
        app.recorder.client.delete(key)  # type: ignore[attr-defined]
        app.close()


def test_a_lock_parked_for_a_retry_is_not_undone_by_a_renewal_in_flight(
    redis_server: RedisServer, prefix: str, held_renewal: Callable[[str], HeldRenewal]
) -> None:
    """An ``until_executed`` task (lock_ttl 6 s) retries in 30 s while the watchdog holds a renewal
    of its lock between pick and send: the lock parked for the retry must keep lock_queue_ttl (60 s)
    plus the countdown, not be renewed back to lock_ttl by that renewal (PARK waits for it)."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    body_ends = threading.Event()

    @app.task(
        base=LockedTask, bind=True, shared=False, lock_mode="until_executed", lock_ttl=6, lock_queue_ttl=60
    )
    def retrying(self: Any, x: str) -> str:
        body_ends.wait(60)
        raise self.retry(countdown=30)

    key = task_lock_key(retrying, ("x",))
    held = held_renewal(key)
    try:
        with threads_worker(app, concurrency=1):
            retrying.delay("x")
            assert held.picked.wait(30)
            body_ends.set()
            wait_for(lambda: held.owner_waits.is_set() or client_pttl(app, key) > 6_000, what="the retry")
            held.go.set()
            assert held.landed.wait(30)
            wait_for(lambda: b"state=queued" in (app.recorder.client.get(key) or b""), what="the parking")  # type: ignore[attr-defined]
            assert client_pttl(app, key) > 60_000
    finally:
        app.recorder.client.delete(key)  # type: ignore[attr-defined]
        app.close()


def client_pttl(app: Any, key: str) -> int:
    return int(app.recorder.client.pttl(key))


def test_a_loss_receiver_that_exits_does_not_stop_later_reports(
    redis_server: RedisServer, prefix: str, lost_reports: list[dict[str, Any]]
) -> None:
    """A ``lock_lost`` receiver calls ``sys.exit()`` (to stop a process that lost a lock, say):
    in the reporting thread ``SystemExit`` would end that thread, not the process. The report is
    logged as failed and the thread carries on: a later loss is still reported."""

    def exits(sender: RedisLock, **kwargs: Any) -> None:
        if kwargs["key"] == f"{prefix}:first":
            sys.exit(1)

    lock_lost.connect(exits, weak=False)
    client = redis_server.client()
    first, later = (RedisLock(client, f"{prefix}:{name}", ttl=0.6) for name in ("first", "later"))
    try:
        assert first.acquire()
        client.delete(f"{prefix}:first")
        wait_for(lambda: [r for r in lost_reports if r["key"] == f"{prefix}:first"], what="the first loss")
        assert later.acquire()
        client.delete(f"{prefix}:later")
        wait_for(
            lambda: [r for r in lost_reports if r["key"] == f"{prefix}:later"],
            timeout=30,
            what="the report of the later loss",
        )
    finally:
        lock_lost.disconnect(exits)
        client.close()


def test_a_slow_loss_report_does_not_hold_up_the_renewal_of_other_locks(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``lock_lost`` receiver blocks (an alert sent over a slow network, a stuck log handler)
    while reporting one lock's loss: the process's other locks are still renewed meanwhile, and
    their owners still learn of their own losses."""
    client = redis_server.client()
    reporting, done = threading.Event(), threading.Event()
    reported: list[str] = []

    def receiver(sender: RedisLock, **kwargs: Any) -> None:
        reported.append(kwargs["key"])
        if kwargs["key"] == f"{prefix}:gone":
            reporting.set()
            done.wait(60)

    lock_lost.connect(receiver, weak=False)
    renewals: list[str] = []
    renew_node = get_watchdog()._renew_node

    def counted(node: Any, batches: list[list[Lease]], ttl_ms: int) -> Any:
        renewals.extend(lease.key for batch in batches for lease in batch)
        return renew_node(node, batches, ttl_ms)

    monkeypatch.setattr(get_watchdog(), "_renew_node", counted)
    gone, kept, later = (RedisLock(client, f"{prefix}:{name}", ttl=1.5) for name in ("gone", "kept", "later"))
    try:
        for lock in (gone, kept, later):
            assert lock.acquire()
        client.delete(f"{prefix}:gone")
        assert reporting.wait(30)
        seen = renewals.count(f"{prefix}:kept")
        wait_for(lambda: renewals.count(f"{prefix}:kept") >= seen + 3, 30, "renewals while the report blocks")
        client.delete(f"{prefix}:later")
        assert later.lost.wait(30)
        assert not kept.lost.is_set() and kept.owned()
        done.set()
        # reported once the blocked report returns: delivered here, not to a later test's receivers
        wait_for(lambda: f"{prefix}:later" in reported, what="the report of the later loss")
    finally:
        done.set()
        lock_lost.disconnect(receiver)
    kept.release()


class _RefusedConnection(redis.Connection):
    """A connection class that cannot make a connection (a custom class, a bad certificate path)."""

    def __init__(self, **kwargs: Any) -> None:
        raise ValueError("no connection for this client")


@pytest.fixture
def unanswered_port() -> Iterator[int]:
    """A port on 127.0.0.1 whose connects are never answered (a server behind a network that
    drops its packets): its listen backlog is full, so its SYNs are dropped."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        while True:  # fill the backlog until a connect times out
            probe = stack.enter_context(socket.socket())
            probe.settimeout(0.2)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        yield port


def _refuse_connections(how: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """From now on, the watchdog can make no connection of its own for ``client`` (``how``)."""
    pool = client.connection_pool
    if how == "unanswered":  # its server's host drops the packets of new connections (``port``)
        monkeypatch.setitem(pool.connection_kwargs, "port", port)
    elif how == "class":  # its connection class raises
        monkeypatch.setattr(pool, "connection_class", _RefusedConnection)
    elif how == "kwargs":  # its pool's connection_kwargs hold one the class refuses (TypeError)
        monkeypatch.setitem(pool.connection_kwargs, "not_an_option", 1)
    else:  # a Cluster node with no client yet (redis-py makes one after a MOVED to a new node lazily)
        node = watchdog_module._node
        monkeypatch.setattr(
            watchdog_module, "_node", lambda of, slot: None if of is client else node(of, slot)
        )


@pytest.mark.parametrize("how", ["class", "kwargs", "node", "unanswered"])
def test_a_server_whose_connection_cannot_be_made_starves_no_other_and_its_locks_are_lost_in_time(
    redis_server: RedisServer,
    prefix: str,
    lost_reports: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    unanswered_port: int,
    how: str,
) -> None:
    """Two locks renewed in one tick, through two clients: the watchdog cannot make its connection
    for one of them (``how``). That is a failed renewal of that client's lease only, as Redis
    unreachable is: the other lock is still renewed, and the first is found lost (``expired``,
    its ``lost`` set, ``lock_lost`` sent) once its lease runs out, not left unrenewed and held
    as far as its owner knows while the tick is given up, round after round. A connect never
    answered gives up after its timeout (half an interval), not after the client's retry
    policy's tries and backoffs (redis-py 8.1's default: 11 tries, 10 s with this lease), which
    held up the tick, and with it the renewal of the other lock, for longer than its lease."""
    healthy, refused = redis_server.client(), redis_server.client()
    refused.ping()  # the lock's own commands use this pooled connection; only new ones are refused
    _refuse_connections(how, refused, monkeypatch, unanswered_port)
    kept = RedisLock(healthy, f"{prefix}:kept", ttl=1.5)
    doomed = RedisLock(refused, f"{prefix}:doomed", ttl=1.5)
    try:
        assert kept.acquire(blocking=False) and doomed.acquire(blocking=False)
        for _ in range(3):  # renewed round after round, past its TTL
            renewed(healthy, kept.name, timeout=5)
        assert doomed.lost.wait(10), "the lock whose renewals all fail is not found lost"
        wait_for(lambda: lost_reports, 10, "the report")
        assert [(r["sender"], r["reason"]) for r in lost_reports] == [(doomed, "expired")]
        assert not kept.lost.is_set() and kept.owned()
    finally:
        for lock in (kept, doomed):
            with contextlib.suppress(LockNotOwned):
                lock.release()


#: A process whose non-daemon thread holds two locks (ttl 1 s) for three leases, ``clients``
#: clients of one server between them, while its main thread has returned: the interpreter
#: shuts down meanwhile (``concurrent.futures`` refuses new work from then on, and Python 3.12+
#: starts no thread: the locks are taken, starting the watchdog, before the main thread returns).
_HELD_AT_SHUTDOWN = """
import sys, threading, time
import redis
from celery_redislock import RedisLock

url, prefix, clients = sys.argv[1], sys.argv[2], int(sys.argv[3])
made = [redis.Redis.from_url(url) for _ in range(clients)]
locks = [RedisLock(made[i % clients], f"{prefix}:{i}", ttl=1.0) for i in range(2)]

acquired = threading.Event()

def job():
    for lock in locks:
        lock.acquire()
    acquired.set()
    for i in range(2):  # held through three renewals of each (ttl 1 s: one every 1/3 s), 10 s at most
        key, rises, deadline = f"{prefix}:{i}", 0, time.monotonic() + 10
        lowest = made[0].pttl(key)
        while rises < 3 and time.monotonic() < deadline:
            now = made[0].pttl(key)
            rises, lowest = rises + (now > lowest), min(lowest, now)
            threading.Event().wait(0.01)  # a polling step with a deadline
    print("lost", [lock.lost.is_set() for lock in locks], flush=True)
    print("held", [made[0].pttl(f"{prefix}:{i}") > 0 for i in range(2)], flush=True)
    for lock in locks:
        lock.release()

threading.Thread(target=job).start()
acquired.wait(30)
"""


@pytest.mark.parametrize("clients", [1, 2], ids=["one client", "two clients of one server"])
def test_the_watchdog_renews_for_a_thread_still_running_as_the_interpreter_shuts_down(
    redis_server: RedisServer, prefix: str, clients: int
) -> None:
    """Two clients make two exchanges a tick, which the watchdog runs side by side: they are
    still renewed after the main thread returned (no thread pool, which refuses work then)."""
    done = subprocess.run(
        [sys.executable, "-c", _HELD_AT_SHUTDOWN, redis_server.url, prefix, str(clients)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "held [True, True]" in done.stdout, (done.stdout, done.stderr[-1500:])


def test_an_exception_no_loop_catches_does_not_end_the_renewals(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``BaseException`` that is not an ``Exception`` (a ``SystemExit`` from a renewal's thread,
    re-raised on the watchdog's; ``GreenletExit`` under gevent) ends the watchdog's thread, which
    the loop's ``except Exception`` does not catch. Its locks are still renewed: another thread
    takes over at once. Before, the dead thread stayed recorded as the watchdog's, so no ``add``
    started another, and every lock of the process went unrenewed until it expired."""
    renew = watchdog_module.Watchdog._renew
    fired: list[int] = []

    def exits_once(self: Any, leases: list[Lease]) -> None:
        if not fired:
            fired.append(1)
            raise SystemExit("a renewal's thread exited")
        renew(self, leases)

    monkeypatch.setattr(watchdog_module.Watchdog, "_renew", exits_once)
    client = redis_server.client()
    lock = RedisLock(client, f"{prefix}:kept", ttl=0.9)
    try:
        assert lock.acquire(blocking=False)
        wait_for(lambda: fired, 5, "the renewal that exits")
        for _ in range(3):  # renewed round after round, past its TTL
            renewed(client, lock.name, timeout=5)
        assert lock.owned() and not lock.lost.is_set()
    finally:
        with contextlib.suppress(LockNotOwned):
            lock.release()
        client.close()


def renewed_before_it_expires(client: redis.Redis, key: str) -> None:
    """Wait until a watchdog renews ``key`` (its PTTL goes up); fail at once if it expires first."""
    lowest = client.pttl(key)
    assert lowest > 0, f"{key} is not held (PTTL {lowest})"

    def renewed_or_gone() -> bool:
        nonlocal lowest
        now = client.pttl(key)
        assert now > 0, f"{key} expired under its owner: the watchdog no longer renewed it"
        lowest, rose = min(lowest, now), now > lowest
        return rose

    wait_for(renewed_or_gone, what=f"a renewal of {key}")


def interrupt_the_wait_for_landing(monkeypatch: pytest.MonkeyPatch, held: HeldRenewal) -> None:
    """The owner's next wait for a renewal in flight to land is cut short by an ``Interrupt`` (a
    soft time limit landing as it waits), once; ``held.owner_waits`` is set then."""
    watchdog = get_watchdog()
    waits = watchdog._await_landing

    def interrupted(lease: Lease) -> None:
        monkeypatch.setattr(watchdog, "_await_landing", waits)
        held.owner_waits.set()
        raise Interrupt

    monkeypatch.setattr(watchdog, "_await_landing", interrupted)


@pytest.mark.parametrize("call", ["extend", "release"])
def test_a_call_interrupted_as_it_waits_for_a_renewal_in_flight_keeps_the_hold(
    redis_server: RedisServer,
    prefix: str,
    held_renewal: Callable[[str], HeldRenewal],
    monkeypatch: pytest.MonkeyPatch,
    call: str,
) -> None:
    """A soft time limit lands in ``extend()`` or ``release()`` while it waits for a renewal in
    flight to land (before anything is sent): the hold is unchanged. After the extend the
    watchdog goes on renewing it (before: the lease stayed marked as being changed, which the
    watchdog never picks: the key expired under its owner, ``lost`` never set, a second holder
    unreported); after the release, as after any interrupted release, ``release()`` can be tried
    again (by the run's end, for a task) and frees the key (before: the object held nothing any
    more, the retry raised ``LockNotOwned`` and the key stayed, unrenewed, for its lease)."""
    client, key = redis_server.client(), f"{prefix}:k"
    held = held_renewal(key)
    lock = RedisLock(client, key, ttl=6)
    assert lock.acquire()
    try:
        assert held.picked.wait(30)
        interrupt_the_wait_for_landing(monkeypatch, held)
        with pytest.raises(Interrupt):
            lock.extend(60) if call == "extend" else lock.release()
        held.go.set()
        assert held.landed.wait(30)
        if call == "extend":
            renewed_before_it_expires(client, key)
            assert lock.owned() and not lock.found_lost()
        else:
            lock.release()
            assert client.exists(key) == 0
    finally:
        held.go.set()
        with contextlib.suppress(LockNotOwned):
            lock.release()
        client.delete(key)


def test_an_extend_interrupted_after_its_reply_renews_in_time_for_the_ttl_it_set(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit lands in ``extend(6)`` of a 60 s lease once Redis answered, before the
    watchdog is told of the new TTL: the watchdog renews the hold in time for the 6 s, as after
    an interrupt before the reply. Before, it stayed on the 60 s schedule (next renewal 20 s
    on) and the key expired under its owner after 6 s."""
    client, key = redis_server.client(), f"{prefix}:k"
    watchdog = get_watchdog()
    reschedule = watchdog.reschedule
    fired: list[int] = []

    def interrupted_once(*args: Any, **kwargs: Any) -> None:
        if not fired:
            fired.append(1)
            raise Interrupt
        reschedule(*args, **kwargs)

    lock = RedisLock(client, key, ttl=60)
    assert lock.acquire()
    try:
        monkeypatch.setattr(watchdog, "reschedule", interrupted_once)
        with pytest.raises(Interrupt):
            lock.extend(6)
        assert fired and 0 < client.pttl(key) <= 6000  # Redis set it
        renewed_before_it_expires(client, key)
        assert lock.owned() and not lock.found_lost()
    finally:
        with contextlib.suppress(LockNotOwned):
            lock.release()
