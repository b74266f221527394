"""Sentinel (a primary, a replica, three sentinels on loopback): sentinel:// URLs, WAIT, failover."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_redislock import (
    LockConfigurationError,
    LockNotAcquired,
    LockNotReplicated,
    RedisLock,
    RedisLockError,
    task_lock_key,
)
from celery_redislock.connection import client_for, lock_url, redis_client
from celery_redislock.testing import RedisSentinelServers, RedisServer, forget_client
from tests.ports import held_port
from tests.taskapp import make_app, recorder
from tests.workers import threads_worker, wait_for


def test_a_sentinel_broker_url_is_used_with_its_master_name(
    sentinels: RedisSentinelServers, prefix: str
) -> None:
    app = Celery("sentinel", broker=sentinels.url, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": sentinels.master_name}
    assert lock_url(app) == (sentinels.url, "broker_url")  # every sentinel, not just the first
    client, _ = client_for(app)
    lock = RedisLock(client, f"{prefix}:k", ttl=5)
    assert lock.acquire(blocking=False)
    with sentinels.primary.client() as primary:
        assert primary.exists(f"{prefix}:k") == 1
    lock.release()
    app = Celery("sentinel", set_as_current=False)
    app.conf.redislock_url = sentinels.url
    with pytest.raises(LockConfigurationError, match="master name"):
        client_for(app)


@pytest.mark.parametrize("spelling", ["joined", "list"])
def test_a_task_locks_through_the_next_sentinel_when_the_first_listed_is_down(
    sentinels: RedisSentinelServers, prefix: str, spelling: str
) -> None:
    # Celery takes several sentinels as one ';'-joined URL or as a list, and kombu asks each in turn.
    with held_port() as down:
        listed = [f"sentinel://127.0.0.1:{down.getsockname()[1]}", *sentinels.url.split(";")]
        app = make_app(
            sentinels.primary.url,  # the results and the recorder's events
            prefix,
            f"q-{prefix}",
            broker_url=";".join(listed) if spelling == "joined" else listed,
            broker_transport_options={
                "master_name": sentinels.master_name,
                # kombu's broker connections retry a refused sentinel (~5 s) before the next
                "sentinel_kwargs": {"retry": None, "socket_connect_timeout": 5, "socket_timeout": 5},
            },
            redislock_url=None,  # from the broker URL
        )
        try:
            task = app.tasks["taskapp.hold_skip"]
            with threads_worker(app, concurrency=2), sentinels.primary.client() as primary:
                first = task.delay("x", gate=True)
                wait_for(lambda: recorder(app).events() or first.ready(), what="the run to start or end")
                assert not first.ready(), first.result  # it started: it had its lock
                assert primary.exists(task_lock_key(task, ("x",), {"gate": True})) == 1  # on the primary
                assert task.delay("x", gate=True).get(timeout=30) is None  # the duplicate finds it busy
                recorder(app).open_gate("x")
                assert first.get(timeout=30) == "x"
            assert lock_url(app) == (";".join(listed), "broker_url")
        finally:
            app.close()


@pytest.mark.parametrize(
    ("broker", "shown", "primary"),
    [
        (
            ["sentinel://u:s3cret@127.0.0.1:1/2", "sentinel://v:other@127.0.0.1:2/5"],
            "sentinel://u:**@127.0.0.1:1/2;sentinel://v:**@127.0.0.1:2/5",
            ("u", "s3cret", 2),
        ),
        (
            "sentinel://127.0.0.1:1;sentinel://v:other@127.0.0.1:2/5",
            "sentinel://127.0.0.1:1;sentinel://v:**@127.0.0.1:2/5",
            (None, None, 0),
        ),
    ],
)
def test_the_first_sentinel_urls_credentials_and_db_are_the_primarys_as_kombus(
    broker: str | list[str], shown: str, primary: tuple[str | None, str | None, int]
) -> None:
    app = Celery("sentinel", set_as_current=False)
    app.conf.update(broker_url=broker, broker_transport_options={"master_name": "mymaster"})
    with app.connection_for_write() as kombus:
        assert (kombus.userid, kombus.password, int(kombus.virtual_host.strip("/") or 0)) == primary
    client, where = client_for(app)  # made without connecting
    assert where == shown  # every sentinel, every password masked
    assert isinstance(client, redis.Redis)
    made = client.connection_pool.connection_kwargs
    assert (made.get("username"), made.get("password"), made.get("db")) == primary
    forget_client(app)


def test_replicas_acknowledge_an_acquisition(sentinels: RedisSentinelServers, prefix: str) -> None:
    client = redis_client(sentinels.url, {"master_name": sentinels.master_name})
    lock = RedisLock(client, f"{prefix}:k", ttl=5, replicas=1)
    assert lock.acquire(blocking=False)
    assert sentinels.replica is not None
    with sentinels.replica.client() as replica:
        assert replica.exists(f"{prefix}:k") == 1  # WAIT returned: the replica has it
    lock.release()


def test_an_acquisition_not_acknowledged_is_rolled_back(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()  # no replica at all
    lock = RedisLock(client, f"{prefix}:k", ttl=5, replicas=1, replica_timeout=0.1)
    with pytest.raises(LockNotReplicated) as refused:
        lock.acquire()
    assert (refused.value.acknowledged, refused.value.wanted) == (0, 1)
    assert isinstance(refused.value, LockNotAcquired)
    assert lock.token is None and client.exists(f"{prefix}:k") == 0  # released again
    with pytest.raises(LockConfigurationError, match="replicas"):
        RedisLock(client, f"{prefix}:k", replicas=-1)
    with pytest.raises(LockConfigurationError, match="replica_timeout"):
        RedisLock(client, f"{prefix}:k", ttl=1, replicas=1, replica_timeout=2)


@pytest.fixture
def failing_over() -> Iterator[RedisSentinelServers]:
    """A sentinel group of the test's own, as its primary will be killed."""
    with RedisSentinelServers() as servers:
        yield servers


def test_locks_keep_working_after_a_failover(failing_over: RedisSentinelServers, prefix: str) -> None:
    group = failing_over
    client = redis_client(
        group.url, {"master_name": group.master_name}, socket_timeout=1, socket_connect_timeout=1
    )
    held = RedisLock(client, f"{prefix}:held", ttl=6, replicas=1)  # on the replica before we go on
    held.acquire()
    os.kill(group.primary.pid, signal.SIGKILL)  # the primary crashes
    assert group.primary.process is not None
    group.primary.process.wait()
    assert group.replica is not None
    deadline = time.monotonic() + 30
    promoted = False
    while not promoted:  # poll the new topology against the deadline
        assert time.monotonic() < deadline, "the sentinels never promoted the replica"
        with group.replica.client() as replica:
            promoted = replica.info("replication")["role"] == "master"
    after = RedisLock(client, f"{prefix}:after", ttl=5)
    deadline = time.monotonic() + 15
    while True:  # the client finds the new primary through the sentinels
        try:
            assert after.acquire(blocking=False)
            break
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline, "the client never reached the new primary"
    assert not held.lost.is_set()  # renewed on the promoted replica, which had the hold
    assert held.owned()
    assert not RedisLock(client, f"{prefix}:held", ttl=5).acquire(blocking=False)
    held.release()
    after.release()
    with pytest.raises(LockNotReplicated):  # no replica left to acknowledge
        RedisLock(client, f"{prefix}:again", ttl=5, replicas=1, replica_timeout=0.1).acquire()
    with group.replica.client() as primary:
        assert primary.exists(f"{prefix}:held", f"{prefix}:after", f"{prefix}:again") == 0


@pytest.mark.parametrize("on_error", ["fail", "run"])
def test_a_task_lock_not_acknowledged_follows_redislock_on_error(
    redis_server: RedisServer, prefix: str, on_error: str
) -> None:
    # No replica acknowledges: like an unreachable Redis, never "busy" (lock_busy="skip" would drop it).
    app = make_app(
        redis_server.url,
        prefix,
        f"q-{prefix}",
        redislock_replicas=1,
        redislock_replica_timeout=0.1,
        redislock_on_error=on_error,
    )
    try:
        with threads_worker(app, concurrency=1):
            executed = app.tasks["taskapp.hold_skip"].delay("x")
            if on_error == "fail":
                with pytest.raises(RedisLockError, match="replica"):
                    executed.get(timeout=30)
                with pytest.raises(RedisLockError, match="enqueue lock"):
                    app.tasks["taskapp.until_executed"].delay("y")
            else:
                assert executed.get(timeout=30) == "x"  # ran unlocked
                assert app.tasks["taskapp.until_executed"].delay("y").get(timeout=30) == "y"  # sent unlocked
    finally:
        app.close()


def test_a_sentinel_that_fails_is_asked_once_before_the_next(
    sentinels: RedisSentinelServers, prefix: str
) -> None:
    # redis-py's sentinel clients retry a failing sentinel with backoff (redis-py 8: ~5 s) before
    # the next is asked: for the locks, the next sentinel listed is the retry.
    accepted = 0
    with socket.socket() as failing:
        failing.bind(("127.0.0.1", 0))
        failing.listen(16)

        def hang_up() -> None:  # a sentinel that accepts and closes each connection at once
            nonlocal accepted
            while True:
                try:
                    connection, _ = failing.accept()
                except OSError:  # closed: the test is over
                    return
                accepted += 1
                connection.close()

        threading.Thread(target=hang_up, daemon=True).start()
        url = f"sentinel://127.0.0.1:{failing.getsockname()[1]};{sentinels.url}"
        lock = RedisLock(redis_client(url, {"master_name": sentinels.master_name}), f"{prefix}:k", ttl=5)
        assert lock.acquire(blocking=False)
        lock.release()
        assert accepted == 1


def test_an_acl_users_password_holding_a_semicolon_locks_through_the_sentinels(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Sentinels and an ACL user whose password holds ';' and '@' (redis-py reads both): each
    sentinel URL of the list was cut at the password's ';', the rest taken for a database,
    refused with the password's tail in the message."""
    secret = "s3cret-pw"
    password = f"p@ss;{secret}"
    with RedisSentinelServers() as servers:
        assert servers.replica is not None
        for server in (servers.primary, servers.replica):
            with server.client() as admin:
                admin.acl_setuser(
                    "locks", enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
                )
                admin.config_set("masterauth", password)
                admin.config_set("masteruser", "locks")
        for sentinel in servers.sentinels:  # the sentinels ask the primary as that user too
            with sentinel.client() as admin:
                admin.execute_command("SENTINEL", "SET", servers.master_name, "auth-user", "locks")
                admin.execute_command("SENTINEL", "SET", servers.master_name, "auth-pass", password)
        url = ";".join(
            f"sentinel://locks:{password}@127.0.0.1:{sentinel.port}/0" for sentinel in servers.sentinels
        )
        app = Celery("sentinel", broker="memory://", set_as_current=False)
        app.conf.update(
            redislock_url=url,
            redislock_prefix=prefix,
            redislock_transport_options={"master_name": "mymaster"},
        )
        try:
            with caplog.at_level(logging.INFO, logger="celery_redislock.connection"):
                client, where = client_for(app)
            with RedisLock(client, f"{prefix}:k", ttl=5) as lock:
                assert lock.owned()
            assert where == ";".join(
                f"sentinel://locks:**@127.0.0.1:{sentinel.port}/0" for sentinel in servers.sentinels
            )
            assert secret not in caplog.text
        finally:
            forget_client(app)
            app.close()
