"""Redlock: RedisLock over 3 and 5 independent primaries; quorum, validity, servers down, loss."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import redis

from celery_redislock import LockConfigurationError, LockNotAcquired, LockNotOwned, RedisLock
from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW, Script
from celery_redislock.redlock import Redlock
from celery_redislock.testing import RedisServer
from tests.conftest import independent_servers
from tests.invariants import keys_without_ttl
from tests.ports import held_port
from tests.taskapp import LEASE
from tests.workers import renewed, wait_for


@pytest.fixture(scope="module")
def five() -> Iterator[list[RedisServer]]:
    """Five independent servers for the module."""
    with independent_servers(5) as servers:
        yield servers


@pytest.fixture(params=[3, 5], ids=["3 servers", "5 servers"])
def servers(
    request: pytest.FixtureRequest, five: list[RedisServer], prefix: str
) -> Iterator[list[RedisServer]]:
    chosen = five[: request.param]
    yield chosen
    for server in chosen:
        with server.client() as client:
            assert keys_without_ttl(client, prefix) == []


@contextmanager
def down(servers: list[RedisServer], count: int) -> Iterator[list[str]]:
    """The URLs of ``servers``, the first ``count`` of them down for the block: each replaced by a
    port of 127.0.0.1 that refuses connections, as a stopped server's, and that no other test
    process can start a server on meanwhile (held: ``tests/ports.py``), where a stopped server's
    port is free again."""
    with ExitStack() as stack:
        refused = [stack.enter_context(held_port()).getsockname()[1] for _ in range(count)]
        yield [f"redis://127.0.0.1:{port}/0" for port in refused] + [server.url for server in servers[count:]]


def clients(servers: list[RedisServer]) -> list[redis.Redis]:
    return [server.client() for server in servers]


def holders_of(servers: list[RedisServer], name: str) -> list[bytes | None]:
    values = []
    for server in servers:
        with server.client() as client:
            values.append(client.get(name))
    return values


def test_a_list_makes_a_redlock_holding_every_server(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    lock = RedisLock([server.url for server in servers], name, ttl=10)
    assert isinstance(lock, Redlock) and isinstance(lock, RedisLock) and lock.quorum == len(servers) // 2 + 1
    assert lock.acquire(blocking=False)
    assert lock.validity is not None and 0 < lock.validity < 10 - 0.1  # ttl - elapsed - drift
    assert isinstance(lock.fence, int)
    assert all(value is not None and value.decode()[:32] == lock.token for value in holders_of(servers, name))
    assert lock.locked() and lock.owned()
    other = RedisLock(clients(servers), name, ttl=10)
    assert not other.acquire(blocking=False)
    assert not other.owned() and other.locked()
    lock.extend(5)
    for server in servers:
        with server.client() as client:
            assert 4000 < client.pttl(name) <= 5000  # replaced, never added
    lock.release()
    assert holders_of(servers, name) == [None] * len(servers)
    with pytest.raises(LockNotOwned):
        lock.release()
    assert other.acquire(timeout=1)
    assert other.fence is not None and other.fence > 0
    other.release()


def test_a_waiter_gets_the_lock_when_it_is_released(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    holder = RedisLock(clients(servers), name, ttl=30)
    waiter = RedisLock(clients(servers), name, ttl=30)
    holder.acquire()
    first_fence = holder.fence
    thread = threading.Thread(target=waiter.acquire, kwargs={"timeout": 10})
    thread.start()
    holder.release()
    thread.join()
    assert waiter.owned()
    assert waiter.fence is not None and first_fence is not None and waiter.fence > first_fence
    waiter.release()


def test_a_minority_down_still_locks_renews_and_releases(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    minority = (len(servers) - 1) // 2  # 1 of 3, 2 of 5
    with down(servers, minority) as urls:
        lock = RedisLock(urls, name, ttl=LEASE)
        assert lock.acquire(blocking=False)
        with servers[-1].client() as live:
            renewed(live, name)  # on the live servers all along
        assert not lock.lost.is_set()
        assert lock.owned()
        assert not RedisLock(urls, name, ttl=LEASE).acquire(blocking=False)
        lock.release()
    assert holders_of(servers[minority:], name) == [None] * (len(servers) - minority)


def test_a_majority_down_fails_with_lock_not_acquired(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    majority = len(servers) // 2 + 1  # 2 of 3, 3 of 5
    with down(servers, majority) as urls:
        assert not RedisLock(urls, name, ttl=5).acquire(blocking=False)
        with (
            pytest.raises(LockNotAcquired, match="servers failed"),
            RedisLock(urls, name, ttl=5, timeout=0.2),
        ):
            pass
    assert holders_of(servers[majority:], name) == [None] * (len(servers) - majority)  # grants undone


def test_a_minority_grant_is_given_back(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    majority = servers[: len(servers) // 2 + 1]
    squatter = RedisLock(clients(majority), name, ttl=10, holder="squatter")  # holds a majority
    squatter.acquire()
    lock = RedisLock(clients(servers), name, ttl=10)
    assert not lock.acquire(blocking=False)
    assert lock.busy[0] == "squatter"
    assert holders_of(servers[len(majority) :], name) == [None] * (len(servers) - len(majority))
    squatter.release()


def test_lost_only_when_a_majority_lost_it(servers: list[RedisServer], prefix: str) -> None:
    name = f"{prefix}:k"
    lock = RedisLock(clients(servers), name, ttl=LEASE)
    lock.acquire()
    minority = servers[: (len(servers) - 1) // 2]
    for server in minority:
        with server.client() as client:
            client.delete(name)
    with servers[-1].client() as client:
        renewed(client, name)  # still held on a majority
    assert not lock.lost.is_set()
    with servers[-1].client() as client:
        client.delete(name)  # now a majority lost it
    assert lock.lost.wait(5)
    with pytest.raises(LockNotOwned):
        lock.release()
    for server in servers:
        with server.client() as client:
            client.delete(name)


def test_bad_input_names_the_argument(redis_server: RedisServer, prefix: str) -> None:
    name = f"{prefix}:k"
    with pytest.raises(LockConfigurationError, match="non-empty list"):
        RedisLock([], name)
    with pytest.raises(LockConfigurationError, match="distinct"):
        RedisLock([redis_server.url, redis_server.url], name)
    with pytest.raises(LockConfigurationError, match=r"each server must be a redis\.Redis"):
        RedisLock([redis_server.url, 42], name)  # type: ignore[list-item]
    with pytest.raises(LockConfigurationError, match="bad Redis URL"):
        RedisLock([redis_server.url, "http://example"], name)
    with pytest.raises(LockConfigurationError, match="fair=True"):
        RedisLock([redis_server.url], name, fair=True)
    with pytest.raises(LockConfigurationError, match="ttl"):
        RedisLock([redis_server.url], name, ttl=0)
    with pytest.raises(LockConfigurationError, match=r"replicas needs a redis\.Redis client"):
        RedisLock([redis_server.url], name, replicas=1)  # was a TypeError from Redlock.__init__
    lock = RedisLock([redis_server.url], name, replicas=0)  # the default, said
    assert lock.acquire(blocking=False)
    lock.release()


def test_one_server_given_twice_in_other_spellings_is_refused(redis_server: RedisServer, prefix: str) -> None:
    """A server listed twice was refused only when both spellings read the same: a URL without
    its db (``/0``, or ``:6379``) and a client made with ``Redis(host=..., port=...)`` passed for
    distinct servers, so that one server counted as two (holding the quorum alone), and the lock
    over it could not be taken: ``acquire()`` answered ``False``, or tried forever without a
    timeout. A URL whose db is no number (redis-py quietly uses db 0) is refused too."""
    url, port = redis_server.url, redis_server.port
    aliases: list[list[Any]] = [
        [url, url.removesuffix("/0")],
        [f"redis://127.0.0.1:{port}", redis.Redis(host="127.0.0.1", port=port, db=0)],
        [f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0?db=0"],
        ["redis://LOCALHOST/0", "redis://localhost:6379", redis.Redis()],
    ]
    for servers in aliases:
        with pytest.raises(LockConfigurationError, match="the servers must be distinct"):
            RedisLock(servers, f"{prefix}:k")
    with pytest.raises(LockConfigurationError, match="the database 'locks' is not a number"):
        RedisLock([f"redis://127.0.0.1:{port}/locks", url], f"{prefix}:k")


def test_bad_servers_are_shown_without_their_passwords(redis_server: RedisServer, prefix: str) -> None:
    """The errors showed the URLs as given, passwords in them."""
    url = f"redis://user:s3cret@127.0.0.1:{redis_server.port}/0"
    cases: list[tuple[Any, str]] = [
        ([url, url], "distinct"),
        ([url, "http://:s3cret@example"], "bad Redis URL"),
        (url, "a non-empty list"),  # a Redlock given one URL, not a list of them
    ]
    for servers, problem in cases:
        with pytest.raises(LockConfigurationError, match=problem) as raised:
            Redlock(servers, f"{prefix}:k")
        assert "s3cret" not in str(raised.value) and ":**@" in str(raised.value)


@pytest.mark.parametrize("given", ["urls", "clients"])
def test_a_stalled_server_does_not_starve_the_renewals_on_the_others(prefix: str, given: str) -> None:
    """Six Redlocks over three servers of this test's own, each lock given the servers' URLs (as the
    docs show) or clients of its own; one server stalls (SIGSTOP). Every lock is still held on two
    of three, and stays held: the watchdog renews the live servers in time, however many clients
    of the stalled one it waits on (half an interval each)."""
    with independent_servers(3) as three:
        servers: list[list[str] | list[redis.Redis]] = [
            [server.url for server in three] if given == "urls" else clients(three) for _ in range(6)
        ]
        locks = [RedisLock(each, f"{prefix}:k{i}", ttl=LEASE) for i, each in enumerate(servers)]
        for lock in locks:
            assert lock.acquire(blocking=False)
        live = three[0].client()
        os.kill(three[2].pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # renewed on a live server, round after round
                for lock in locks:
                    renewed(live, lock.name, timeout=3 * LEASE)
            assert not [lock.name for lock in locks if lock.lost.is_set()]
        finally:
            os.kill(three[2].pid, signal.SIGCONT)
        for lock in locks:
            lock.release()
        live.close()


def test_renewals_failing_on_a_majority_lose_the_lock_only_when_their_leases_could_have_run_out(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three servers stall (SIGSTOP): the watchdog's renewals there time out, a majority
    failing by errors. As with one server, that is no loss until the leases could have run out
    (last success + ttl): the servers come back before, and the lock is renewed there and
    still held, ``lost`` never set."""
    caplog.set_level(logging.WARNING, logger="celery_redislock.watchdog")
    with independent_servers(3) as three:
        name = f"{prefix}:k"
        lock = RedisLock([server.url for server in three], name, ttl=12)  # due every 4 s, lost at 12
        assert lock.acquire(blocking=False)
        for server in three[1:]:
            os.kill(server.pid, signal.SIGSTOP)
        try:

            def failed_on_both() -> bool:  # this lock's leases there, the process's only ones failing
                return sum("lock(s) failed" in record.getMessage() for record in caplog.records) >= 2

            wait_for(failed_on_both, what="the renewals on the stalled servers to fail")
        finally:
            for server in three[1:]:
                os.kill(server.pid, signal.SIGCONT)
        with three[1].client() as client:
            renewed(client, name)
        assert not lock.lost.is_set() and lock.owned()
        lock.release()


def late_replies(monkeypatch: pytest.MonkeyPatch, script: Script, servers: list[RedisServer]) -> list[int]:
    """From now on, ``script``'s next call on each of ``servers`` runs there, but its reply counts as
    come after the Redlock's per-server deadline (a slow server or network). Returns the ports
    whose reply came late."""
    for server in servers:
        with server.client() as client:
            client.script_load(script.source)  # the late reply is the script's, not NOSCRIPT
    ports, sha = {server.port for server in servers}, script.sha.encode()
    sent: set[Any] = set()
    late: list[int] = []
    connection = redis.connection.AbstractConnection
    send, can_read = connection.send_packed_command, connection.can_read

    def send_packed_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> None:
        if self.port in ports and self.port not in late and any(sha in part for part in command):
            sent.add(self)
        send(self, command, *args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def late_can_read(self: Any, timeout: float = 0) -> bool:
        if self in sent:  # the script's reply: it comes (the script ran)...
            sent.discard(self)
            assert can_read(self, 60)
            late.append(self.port)
            return False  # ...after the deadline
        return bool(can_read(self, timeout))

    monkeypatch.setattr(connection, "send_packed_command", send_packed_command)
    monkeypatch.setattr(connection, "can_read", late_can_read)
    return late


def test_a_grant_whose_reply_came_too_late_is_given_back(
    servers: list[RedisServer], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-blocking acquire: the first server refuses (a squatter holds the key there), every
    other server grants it but its reply comes after the per-server deadline. No server
    answered "granted" in time, so ``acquire()`` says False, and must give back what the late
    servers granted, as the Redlock algorithm prescribes (release on every server, even those
    it believed it was not able to lock): else a majority holds the lock for a token nobody
    owns, until its TTL."""
    name = f"{prefix}:k"
    squatter = RedisLock(servers[0].client(), name, ttl=10, holder="squatter")
    assert squatter.acquire(blocking=False)
    late = late_replies(monkeypatch, ACQUIRE, servers[1:])
    lock = RedisLock([server.url for server in servers], name, ttl=10)
    assert not lock.acquire(blocking=False)
    monkeypatch.undo()
    assert sorted(late) == sorted(server.port for server in servers[1:])
    left = holders_of(servers[1:], name)
    squatter.release()
    for server in servers[1:]:
        with server.client() as client:
            client.delete(name)
    assert left == [None] * len(left), f"the late grants were kept: {left}"


@pytest.mark.parametrize("call", ["release", "extend"])
def test_a_call_that_cannot_have_reached_a_majority_raises_lock_not_owned(
    servers: list[RedisServer], prefix: str, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """The hold is gone from a majority of the servers (expired while its owner was paused, say),
    and the last server's reply to the ``release()`` or ``extend()`` comes too late. Whatever
    that server did, no majority held the lock: ``LockNotOwned``, as with every reply in, rather
    than the timeout (the hold kept, for a retry of the release that then counts the key found
    gone as released: the loss never told); ``extend()`` sets ``lost``, and the release after it
    raises ``LockNotOwned`` too."""
    name = f"{prefix}:k"
    lock = RedisLock([server.url for server in servers], name, ttl=10, watchdog=False)
    assert lock.acquire(blocking=False)
    for server in servers[: len(servers) // 2 + 1]:
        with server.client() as client:
            client.delete(name)
    late = late_replies(monkeypatch, RELEASE if call == "release" else RENEW, servers[-1:])
    with pytest.raises(LockNotOwned):
        lock.release() if call == "release" else lock.extend(5)
    monkeypatch.undo()
    assert late == [servers[-1].port]
    if call == "extend":
        assert lock.lost.is_set()
        with pytest.raises(LockNotOwned):
            lock.release()
    assert not lock.held()


def test_an_extend_whose_outcome_errors_made_unknown_raises_the_error_and_keeps_the_hold(
    servers: list[RedisServer], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every server applies an ``extend()`` to a shorter TTL, but only the first one's reply comes
    in time. A majority may hold the lock (they all do): ``extend()`` raises the error, as a
    single server's does when its outcome is unknown, not ``LockNotOwned`` with ``lost`` set (a
    false loss, which stops a task with a ``lock_on_lost`` policy); and the watchdog renews the
    hold in time for the shorter TTL the servers may have applied (before: not rescheduled,
    so it expired on every server before the next renewal)."""
    name = f"{prefix}:k"
    lock = RedisLock([server.url for server in servers], name, ttl=60)
    assert lock.acquire(blocking=False)
    late = late_replies(monkeypatch, RENEW, servers[1:])
    with pytest.raises(redis.exceptions.TimeoutError, match="no reply within"):
        lock.extend(15)
    monkeypatch.undo()
    assert sorted(late) == sorted(server.port for server in servers[1:])
    assert not lock.lost.is_set() and lock.held()
    with servers[0].client() as client:
        assert client.pttl(name) <= 15000  # applied
        renewed(client, name)  # renewed before the 15 s ran out (every ttl/3 would be 20 s on)
    assert lock.owned()
    lock.release()


@contextmanager
def hanging_port() -> Iterator[int]:
    """A port of 127.0.0.1 whose connects hang until their timeout, as a blackholed server's: it
    listens, with its accept queue full (Linux drops further SYNs), and never accepts."""
    with ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(4):  # fill the queue; the later ones hang too
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        yield port


def test_a_server_whose_connects_hang_does_not_fail_the_others_replies(
    redlock_servers: list[RedisServer], prefix: str
) -> None:
    """The first of three servers is blackholed: each connect to it hangs until the connect timeout
    (the per-server deadline). The two live servers still answer every call: the replies are
    awaited for the deadline after they were sent, not for what the hung connect left of it
    (before: the release found its deadline past as it sent to the live servers, and raised
    the timeout, keeping the hold, on every try)."""
    with hanging_port() as port:
        lock = RedisLock(
            [f"redis://127.0.0.1:{port}/0"] + [s.url for s in redlock_servers[1:]], f"{prefix}:k", ttl=10
        )
        assert lock.acquire(timeout=30)
        lock.release()
    assert holders_of(redlock_servers, f"{prefix}:k") == [None] * 3
