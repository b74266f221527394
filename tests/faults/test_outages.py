"""Redis going away leaves no lock held past ``lock_ttl`` and no duplicate running: restarted
without persistence mid-task, unreachable at enqueue and at execution, gone when a task releases.

The locks live on a server of their own here (``locks``), so that it can be
stopped and restarted while the broker, on the stage's server, stays up.
``tests/test_task_config.py`` checks the ``redislock_on_error`` messages with an
in-process worker and a direct call; these run real worker subprocesses and
check what is left in Redis once it is back.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from celery_redislock import RedisLockError, task_lock_key
from celery_redislock import connection as connection_module
from celery_redislock._scripts import ACQUIRE, RELEASE, RENEW
from celery_redislock._task_scripts import ADOPT
from celery_redislock.connection import client_for
from celery_redislock.testing import RedisServer
from tests import invariants
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.faults.proxy import TCPProxy
from tests.ports import held_port

TTL = 1.5


@pytest.fixture
def locks(prefix: str) -> Iterator[RedisServer]:
    """The lock server, checked like the stage's: a TTL on every key at all times, no lock left."""
    with RedisServer() as server:
        sampler = invariants.Sampler(server.client(), prefix).start()
        yield server
        sampler.stop()
        if server.process is not None and server.process.poll() is None:
            invariants.check(server.client(), prefix)


def test_a_redis_restart_without_persistence_mid_task(stage: Stage, locks: RedisServer) -> None:
    worker = stage.worker("restart", "prefork", 2, redislock_url=locks.url, redislock_ttl=TTL)
    app = stage.app_with(redislock_url=locks.url)
    x, task = fresh(), app.tasks["taskapp.fenced"]
    client_for(app)[0].ping()  # the test side's lock connection, stale after the restart
    first = task.delay(x)
    first_start = stage.wait_events("start", x)[0]
    locks.stop()
    locks.start()  # same port, empty dataset, no scripts loaded
    restarted_at = time.monotonic()
    assert locks.client().script_exists(ACQUIRE.sha, RELEASE.sha, RENEW.sha) == [False] * 3
    lost = stage.wait_events("lost", x)[0]
    assert lost[3] == first.id and lost[8] in ("not_owned", "expired")  # the lock vanished with the data
    assert float(lost[7]) - restarted_at <= TTL
    with pytest.raises(Exception, match="was lost while held"):
        first.get(timeout=RESULT_TIMEOUT)
    assert "lost (" in worker.output()
    # Later tasks lock normally, on reconnected clients and reloaded scripts, with greater fences.
    second = task.delay(x)
    second_start = stage.wait_events("start", x, 2)[1]
    assert int(second_start[5]) > int(first_start[5])
    assert locks.client().exists(task_lock_key(task, (x,)))
    stage.recorder.open_gate(x)
    assert second.get(timeout=RESULT_TIMEOUT) == x
    y, queued = fresh(), app.tasks["taskapp.until_executed"]
    result = queued.delay(y, gate=True)  # an enqueue lock from the test side, adopted by the worker
    assert queued.delay(y, gate=True).id == result.id
    stage.wait_events("start", y)
    stage.recorder.open_gate(y)
    assert result.get(timeout=RESULT_TIMEOUT) == y
    assert locks.client().script_exists(ACQUIRE.sha, RELEASE.sha, RENEW.sha, ADOPT.sha) == [True] * 4


class Unreachable:
    """A lock server's address, a port of 127.0.0.1, that refuses connections until ``back()``.

    The port is held by a socket bound there that does not listen (``tests/ports.py``):
    connections are refused, as at a stopped server's port, and no other test process can
    start a server there meanwhile, as it could at a stopped server's. ``back()`` starts a
    redis-server and has the held socket listen, forwarding to it (``TCPProxy``): Redis is
    back at the same address, which never was free.
    """

    def __init__(self, held: socket.socket) -> None:
        self._held = held
        self.port: int = held.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.server: RedisServer | None = None
        self.proxy: TCPProxy | None = None

    def back(self) -> RedisServer:
        """Redis answers at ``url`` from now on; the server behind it (a client of it sees its data)."""
        self.server = RedisServer().start()
        self.proxy = TCPProxy(self.server.port, listener=self._held).start()
        return self.server

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.server is not None:
            self.server.close()


@pytest.fixture
def unreachable() -> Iterator[Unreachable]:
    with held_port() as held:
        address = Unreachable(held)
        try:
            yield address
        finally:
            address.close()


def masked(address: Unreachable) -> tuple[str, str]:
    """A URL of ``address`` with a password, and how error messages must show it."""
    return f"redis://:secret@127.0.0.1:{address.port}/0", f"redis://:**@127.0.0.1:{address.port}/0"


@contextmanager
def connections_to(port: int) -> Iterator[list[float | None]]:
    """Every connection this process opens to ``127.0.0.1:port`` in the block, as the timeout
    its socket had (the client's connect timeout), whether it connected or not."""
    attempts: list[float | None] = []
    connect = socket.socket.connect

    def counted(sock: socket.socket, address: Any) -> None:
        if address[:2] == ("127.0.0.1", port):
            attempts.append(sock.gettimeout())
        connect(sock, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", counted)
        yield attempts


@pytest.mark.parametrize("how", ["refused", "stalled"])
@pytest.mark.parametrize("on_error", ["fail", "run"])
def test_redis_unreachable_at_enqueue(
    stage: Stage,
    unreachable: Unreachable,
    how: str,
    on_error: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(connection_module, "SOCKET_TIMEOUT", 0.5)  # the client's, created below
    with TCPProxy(stage.server.port) as proxy:
        if how == "refused":
            url, shown = masked(unreachable)
            port = unreachable.port
        else:
            proxy.stall()
            url = shown = proxy.url()
            port = proxy.port
        app = stage.app_with(redislock_url=url, redislock_on_error=on_error)
        x, task = fresh(), app.tasks["taskapp.until_executed"]
        with connections_to(port) as attempts:
            if on_error == "fail":
                with pytest.raises(RedisLockError) as raised:
                    task.delay(x)
                message = str(raised.value)
                assert "task 'taskapp.until_executed'" in message and shown in message
                assert task_lock_key(task, (x,)) in message and "secret" not in message
                assert stage.client.llen(stage.queue) == 0  # nothing was sent
            else:
                with caplog.at_level(logging.WARNING, logger="celery_redislock"):
                    task.delay(x)
                assert "sending it unlocked (redislock_on_error='run')" in caplog.text
                assert shown in caplog.text and "secret" not in caplog.text
                assert stage.client.llen(stage.queue) == 1
        # Bounded by the client's timeouts, not hanging on retries: the enqueue gives up after one
        # attempt to take the lock and one to clean up, each a connection the 0.5 s timeouts bound
        # (refused at once, or a stalled reply waited for once), not retrying against the outage.
        assert 1 <= len(attempts) <= 2 and set(attempts) == {0.5}, (
            f"{len(attempts)} connection(s) to the unreachable lock server in one enqueue, with "
            f"timeouts {attempts}: expected 1 or 2, each with the client's 0.5 s timeout"
        )
        proxy.heal()
    server = unreachable.back()
    assert invariants.keys_of(server.client(), stage.prefix) == []
    stage.client.delete(stage.queue)  # the unlocked message nobody consumes


@pytest.mark.parametrize("on_error", ["fail", "run"])
def test_redis_unreachable_at_execution_then_back(
    stage: Stage, unreachable: Unreachable, on_error: str
) -> None:
    url = shown = unreachable.url  # (the password is masked in messages: see the enqueue test)
    worker = stage.worker("w", redislock_url=url, redislock_on_error=on_error, redislock_ttl=TTL)
    x, task = fresh(), stage.task("hold_skip")  # no enqueue lock: the test side does not need Redis
    result = task.delay(x)
    if on_error == "fail":
        with pytest.raises(RedisLockError) as raised:
            result.get(timeout=RESULT_TIMEOUT)
        assert shown in str(raised.value) and "secret" not in str(raised.value)
        assert stage.events("start", x) == []
    else:
        assert result.get(timeout=RESULT_TIMEOUT) == x
        assert stage.events("start", x)[0][5] == "None"  # ran unlocked: no fence
        assert "running unlocked (redislock_on_error='run')" in worker.output()
    # Redis is back (at the same address, as the worker knows it): the next run locks again.
    server = unreachable.back()
    again = task.delay(x)
    assert again.get(timeout=RESULT_TIMEOUT) == x
    assert stage.events("start", x)[-1][5] != "None"
    assert invariants.keys_of(server.client(), stage.prefix) == []  # nothing stays locked


@pytest.mark.parametrize("mode", ["until_executing", "until_and_while_executing"])
def test_an_enqueue_lock_left_by_an_outage_at_the_runs_start_goes_once_redis_is_back(
    stage: Stage, mode: str
) -> None:
    """The message's enqueue lock was taken at ``delay()``; Redis cannot be reached as the run
    starts, where the mode frees it (``until_executing``) or swaps it for the execution lock
    (``until_and_while_executing``), so with ``redislock_on_error="run"`` the body runs unlocked.
    Redis is back before the body ends: the enqueue lock is freed then, not left to refuse every
    ``delay()`` of these arguments for ``lock_queue_ttl`` (an hour)."""
    with TCPProxy(stage.server.port) as proxy:
        worker = stage.worker("w", redislock_url=proxy.url(), redislock_on_error="run", redislock_ttl=TTL)
        x, task = fresh(), stage.task(mode)
        ticket = task_lock_key(task, (x,), {"gate": True}) + task.lock_options.rules.queued_suffix
        proxy.drop()
        result = task.delay(x, gate=True)  # the test side's lock client goes straight to Redis
        assert stage.client.ttl(ticket) > 0
        stage.wait_events("start", x)
        assert "running unlocked (redislock_on_error='run')" in worker.output()
        proxy.heal()
        stage.recorder.open_gate(x)
        assert result.get(timeout=RESULT_TIMEOUT) == x
        assert not stage.client.exists(ticket)
        again = task.delay(x)
        assert again.id != result.id and again.get(timeout=RESULT_TIMEOUT) == x


def test_a_release_that_cannot_reach_redis_leaves_a_lock_that_expires_within_lock_ttl(stage: Stage) -> None:
    """The worker's connections to the locks are dropped while its task runs: its release fails,
    and nothing renews the lease any more, so Redis expires the lock within a lease. The key's
    events say so however slow the worker is to get there: never deleted, not renewed once the
    release failed, expired."""
    with TCPProxy(stage.server.port) as proxy:
        worker = stage.worker("w", redislock_url=proxy.url(), redislock_ttl=TTL)
        x, task = fresh(), stage.task("hold_skip")
        key = task_lock_key(task, (x,), {"gate": True})
        events = stage.key_events(key)
        result = task.delay(x, gate=True)
        stage.wait_events("start", x)
        proxy.drop()
        stage.recorder.open_gate(x)  # the body ends; its release cannot reach Redis
        assert result.get(timeout=RESULT_TIMEOUT) == x  # the task's outcome stands
        # reported once the release's outcome is known, which may come after the result is stored
        worker.wait_for_line(f"could not release lock {key}", what="the release's WARNING")
        events.mark("release-failed")
        seen = events.until(lambda seen: {"expired", "release-failed"} <= set(seen), "the lease to run out")
        assert "expire" not in seen[seen.index("release-failed") :], seen  # no longer renewed...
        held = [event for event in seen if event != "release-failed"]
        assert held == ["set", *["expire"] * (len(held) - 2), "expired"], seen  # ...nor deleted: expired
        proxy.heal()
        assert stage.events("lost", x) == []  # released (as far as it knew), not lost
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x  # the next run locks normally


def test_the_worker_reconnects_through_the_proxy(stage: Stage) -> None:
    """The proxy itself: a worker's lock client reconnects after its connections were dropped."""
    with TCPProxy(stage.server.port) as proxy:
        stage.worker("w", redislock_url=proxy.url(), redislock_ttl=TTL)
        x, task = fresh(), stage.task("hold_skip")
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
        proxy.drop()
        proxy.heal()
        assert task.delay(x).get(timeout=RESULT_TIMEOUT) == x
        assert proxy.accepted >= 2
        proxy.drop()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(proxy.url(), retry=None).ping()
