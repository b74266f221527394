"""Redis Cluster (3 primaries on loopback): redislock_url, hash slots, per-node renewal, resharding."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster
import redis.connection
from celery import Celery
from redis.crc import key_slot

from celery_redislock import LockedTask, RedisLock
from celery_redislock.connection import client_for
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisClusterServers, RedisServer
from tests.taskapp import LEASE, lock_fields
from tests.workers import wait_for


@pytest.fixture
def client(cluster: RedisClusterServers) -> Iterator[redis.cluster.RedisCluster]:
    connection = cluster.client()
    yield connection
    connection.close()


def node_of(cluster: RedisClusterServers, client: redis.cluster.RedisCluster, key: str) -> RedisServer:
    port = client.get_node_from_key(key).port  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    return next(server for server in cluster.servers if server.port == port)


def test_redislock_url_names_a_cluster(cluster: RedisClusterServers, prefix: str) -> None:
    app = Celery("cluster", set_as_current=False)
    app.conf.update(redislock_url=cluster.url, redislock_prefix=prefix, task_always_eager=True)
    seen = {}

    @app.task(base=LockedTask, bind=True, name="cluster.work")
    def work(self: LockedTask, n: int) -> int:
        lock_client, _ = client_for(app)
        seen["fence"], seen["held"] = (
            lock_fields(self).lock_fence,
            lock_client.exists(lock_fields(self).lock_key),
        )
        return n

    assert isinstance(client_for(app)[0], redis.cluster.RedisCluster)
    assert work.delay(3).get() == 3
    assert isinstance(seen["fence"], int) and seen["held"] == 1


def test_every_key_of_a_lock_lives_in_its_slot(
    client: redis.cluster.RedisCluster, cluster: RedisClusterServers, prefix: str
) -> None:
    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=30, fair=True)
    holder.acquire()
    waiters = [RedisLock(client, name, ttl=30, fair=True) for _ in range(2)]
    granted: queue.Queue[RedisLock] = queue.Queue()  # in the order the waiters got the lock
    threads = [threading.Thread(target=lambda w=w: granted.put(w) if w.acquire() else None) for w in waiters]
    for thread in threads:
        thread.start()
    node = node_of(cluster, client, name).client()
    deadline = time.monotonic() + 10
    while node.zcard(companion_key(name, "queue")) < 2:
        assert time.monotonic() < deadline, "the waiters never queued"
    keys = [key for server in cluster.servers for key in server.client().scan_iter(match=f"*{prefix}*")]
    assert len(keys) >= 3  # the lock, its queue and its waiters' deadlines
    assert {key_slot(key) for key in keys} == {key_slot(name.encode())}
    holder.release()  # hands over to the first queued waiter (not necessarily the first started)
    for _ in waiters:
        granted.get(timeout=30).release()  # ... who hands over to the other
    for thread in threads:
        thread.join(timeout=30)
    assert client.exists(name) == 0


#: The watchdog's thread, and those it renews several servers side by side on.
RENEWING_THREADS = ("celery-redislock-watchdog", "celery-redislock-renewal")


def test_the_watchdog_renews_each_node_in_one_round_trip(
    client: redis.cluster.RedisCluster, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[tuple[int, int]] = []  # (connection, commands) of each write by the watchdog's threads
    real_send = redis.connection.Connection.send_packed_command

    def counted(self: redis.connection.Connection, command: Any, check_health: bool = True) -> None:
        if threading.current_thread().name.startswith(RENEWING_THREADS):
            writes.append((id(self), len(command)))
        real_send(self, command, check_health)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
    # names of one length: CRC16 is linear, so their 300 slots differ whatever the prefix (with
    # lengths mixed, about 1 prefix in 100 put fewer than 250 apart)
    # a lease of 6 s, renewed every 2 s: a loaded machine's stalls stay well inside it
    locks = [RedisLock(client, f"{prefix}:{i:04d}", ttl=6) for i in range(300)]  # ~100 slots per node
    for lock in locks:
        lock.acquire()
    assert len({key_slot(lock.name.encode()) for lock in locks}) > 250

    def one_write_per_node() -> bool:  # three writes in a row, one per node, renewing all 300 leases
        seen = list(writes)
        rounds = zip(seen, seen[1:], seen[2:], strict=False)
        return any(len({c for c, _ in r}) == 3 and sum(n for _, n in r) >= 300 for r in rounds)

    # leases taken over a loaded second are renewed apart at first, then fall into step
    wait_for(one_write_per_node, what="a renewal round of all 300 leases in one write per node")
    renewed = list(writes)
    assert all(not lock.lost.is_set() for lock in locks)
    for lock in locks:
        lock.release()
    assert len({connection for connection, _ in renewed}) == 3  # one connection per node


def _move_slot(cluster: RedisClusterServers, slot: int, source: RedisServer, finish: bool) -> RedisServer:
    """Migrates ``slot``'s keys from ``source`` to another node; ``finish`` assigns the slot to it
    (clients then get MOVED), else the slot stays migrating (clients get ASK for moved keys)."""
    target = next(server for server in cluster.servers if server is not source)
    src, dst = source.client(), target.client()
    src_id, dst_id = src.cluster("MYID"), dst.cluster("MYID")
    dst.cluster("SETSLOT", slot, "IMPORTING", src_id)
    src.cluster("SETSLOT", slot, "MIGRATING", dst_id)
    for key in src.cluster("GETKEYSINSLOT", slot, 1000):
        src.migrate("127.0.0.1", target.port, key, 0, 5000)
    if finish:
        for server in cluster.servers:
            server.client().cluster("SETSLOT", slot, "NODE", dst_id)
    return target


def logged(caplog: pytest.LogCaptureFixture, error: str) -> None:
    """Wait until the watchdog logs a renewal redirected with ``error`` (it then renews through the
    client; the test reads nothing through the Cluster client meanwhile, which would learn the move)."""
    wait_for(
        lambda: any(error in record.getMessage() for record in caplog.records),
        what=f"a renewal redirected with {error}",
    )


def test_a_reshard_is_followed_with_ask_and_moved(
    client: redis.cluster.RedisCluster,
    cluster: RedisClusterServers,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redislock.watchdog")
    name = f"{{{prefix}}}:k"
    lock = RedisLock(client, name, ttl=LEASE)
    lock.acquire()
    slot, source = key_slot(name.encode()), node_of(cluster, client, name)
    _move_slot(cluster, slot, source, finish=False)  # the key moved, the slot is migrating: ASK
    assert lock.owned()
    logged(caplog, "AskError")  # renewals redirected by ASK, followed by the client
    assert not lock.lost.is_set()
    target = _move_slot(cluster, slot, source, finish=True)  # the slot moved: MOVED
    logged(caplog, "MovedError")
    assert not lock.lost.is_set()
    assert lock.owned() and node_of(cluster, client, name) is target
    assert not RedisLock(client, name, ttl=5).acquire(blocking=False)
    lock.release()
    assert client.exists(name) == 0
    with target.client() as node:
        node_id = node.cluster("MYID")
    with source.client() as node:
        source_id = node.cluster("MYID")
    for server in cluster.servers:  # and back, for the tests that follow
        server.client().cluster("SETSLOT", slot, "NODE", source_id)
    assert node_id != source_id
