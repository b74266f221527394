"""``redislock_client``: a redis-py client, or a callable ``(app) -> client``, instead of a URL.

A prefork worker's pool children lock through it without ever using a
connection of their parent's; the callable is called again in each child;
Cluster and Sentinel clients work; a wrong value is refused naming the setting.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
import redis.asyncio
from celery import Celery
from celery.beat import Scheduler
from celery.exceptions import SoftTimeLimitExceeded
from celery.schedules import schedule

from celery_redislock import LockConfigurationError, LockedTask, RedisLockError
from celery_redislock.beat import guard
from celery_redislock.connection import client_for, client_location, redis_client
from celery_redislock.protocol import BEAT_HEADER
from celery_redislock.state import forget_client
from celery_redislock.testing import RedisClusterServers, RedisSentinelServers, RedisServer
from tests.taskapp import Recorder, make_app
from tests.workers import Subprocess

RESULT_TIMEOUT = 30


class ClientWorker(Subprocess):
    """``celery -A tests.client_app worker``: prefork, two children, locks on ``redislock_client``."""

    def __init__(self, url: str, prefix: str, queue: str, kind: str) -> None:
        env = {"CLIENTAPP_URL": url, "CLIENTAPP_PREFIX": prefix, "CLIENTAPP_QUEUE": queue}
        env["CLIENTAPP_KIND"] = kind
        args = ["worker", "-P", "prefork", "-c", "2", "-Q", queue, "-n", f"client-{kind}@%h", "-l", "INFO"]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        super().__init__("worker", f"client-{kind}", env, args, app="tests.client_app")


@pytest.fixture
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    """The sending side, its locks on the same server through a URL."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    yield app
    app.recorder.client.delete(app.conf.task_default_queue)  # type: ignore[attr-defined]
    app.close()


@pytest.mark.parametrize("kind", ["instance", "callable"])
def test_prefork_children_lock_through_the_setting_never_on_their_parents_connections(
    app: Celery, redis_server: RedisServer, prefix: str, kind: str
) -> None:
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]
    task = app.tasks["taskapp.until_executed"]  # the children adopt and release the enqueue locks
    results = [task.delay(f"c{i}") for i in range(6)]
    worker = ClientWorker(redis_server.url, prefix, app.conf.task_default_queue, kind)
    worker.start()
    try:
        assert [result.get(timeout=RESULT_TIMEOUT) for result in results] == [f"c{i}" for i in range(6)]
        connections = {entry["name"]: entry for entry in recorder.client.client_list()}
    finally:
        worker.stop()
    starts = [event for event in recorder.events() if event[0] == "start"]
    assert len(starts) == 6 and all(event[5].isdigit() for event in starts), starts  # fenced: locked
    children = {int(event[4]) for event in starts}
    assert worker.pid not in children
    if kind == "instance":
        for name in ("parent-loan", "parent-pool"):  # the main process's, named before the fork
            # its last command is still the CLIENT SETNAME that named it ("client" on Redis 6.2)
            assert connections[name]["cmd"] in ("client|setname", "client"), connections[name]
    else:  # each child that ran a task made its own client
        called_in = [int(pid) for pid in recorder.client.lrange(f"{prefix}:factory", 0, -1)]
        assert children <= set(called_in)
        assert len(called_in) == len(set(called_in)), called_in  # once per process


def locked_app(prefix: str, client: Any) -> Celery:
    """An eager app whose locks are on ``client`` (``redislock_client``)."""
    app = Celery("client-setting", set_as_current=False)
    app.conf.update(redislock_client=client, redislock_prefix=prefix, task_always_eager=True)

    @app.task(base=LockedTask, bind=True, shared=False, name="client.fence")
    def fence(self: Any, x: int) -> object:
        return self.request.lock_fence

    @app.task(base=LockedTask, bind=True, shared=False, name="client.queued", lock_mode="until_executed")
    def queued(self: Any, x: int) -> object:
        return self.request.lock_fence

    return app


def failing_callable(app: Celery) -> redis.Redis:
    raise OSError("token endpoint unreachable; token=secret")


@pytest.mark.parametrize("name", ["client.fence", "client.queued"])
def test_a_failing_callable_fails_the_task_naming_its_exception_type_only(prefix: str, name: str) -> None:
    app = locked_app(prefix, failing_callable)
    failed = r"app 'client-setting': the redislock_client callable failed: OSError$"
    with pytest.raises(RedisLockError, match=failed) as raised:
        app.tasks[name].delay(1).get()
    assert "secret" not in str(raised.value)
    app.close()


@pytest.mark.parametrize("name", ["client.fence", "client.queued"])
def test_a_failing_callable_runs_the_task_unlocked_with_on_error_run(
    prefix: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_redislock")  # whatever an earlier worker set the root to
    app = locked_app(prefix, failing_callable)
    app.conf.redislock_on_error = "run"
    assert app.tasks[name].delay(1).get() is None  # ran, unlocked: no fence
    unlocked = [
        record.getMessage() for record in caplog.records if "redislock_on_error='run'" in record.getMessage()
    ]
    assert unlocked and all("the redislock_client callable failed: OSError" in line for line in unlocked)
    assert not any("secret" in line for line in unlocked)
    app.close()


def interrupted_callable(app: Celery) -> redis.Redis:
    raise SoftTimeLimitExceeded()  # the task's soft time limit, landing as the client is made


@pytest.mark.parametrize("on_error", ["fail", "run"])
@pytest.mark.parametrize("name", ["client.fence", "client.queued"])
def test_a_soft_time_limit_in_the_callable_stops_the_task(prefix: str, name: str, on_error: str) -> None:
    """A soft time limit (an ``Exception``) landing in the ``redislock_client`` callable is not
    the callable failing, taken for Redis unreachable: it propagates, with either
    ``redislock_on_error`` (``"run"`` would run the body unlocked, past the limit)."""
    app = locked_app(prefix, interrupted_callable)
    app.conf.redislock_on_error = on_error
    with pytest.raises(SoftTimeLimitExceeded):
        app.tasks[name].delay(1).get()
    app.close()


@pytest.mark.parametrize("on_error", ["fail", "run"])
def test_a_failing_callable_at_a_beat_slot_claim_follows_on_error(
    redis_server: RedisServer, prefix: str, on_error: str
) -> None:
    """A beat whose ``redislock_client`` callable raises treats it as Redis unreachable, as a
    task does: ``"fail"`` raises ``RedisLockError`` and sends nothing, ``"run"`` sends the
    entry unclaimed."""
    app = Celery("client-beat", set_as_current=False, broker=redis_server.url)
    queue = f"q-{prefix}"
    app.conf.update(
        redislock_client=failing_callable,
        redislock_prefix=prefix,
        redislock_on_error=on_error,
        task_default_queue=queue,
    )

    @app.task(base=LockedTask, shared=False, name="client.beat_job", lock_beat=True)
    def beat_job() -> None:
        return None

    scheduler = Scheduler(app, lazy=True)
    guard(scheduler)
    every_10s = schedule(timedelta(seconds=10))
    entry = scheduler.Entry(name="job", task="client.beat_job", schedule=every_10s, app=app)
    client = redis_server.client()
    try:
        if on_error == "fail":
            with pytest.raises(RedisLockError, match="the redislock_client callable failed: OSError"):
                scheduler.apply_async(entry)
            assert client.llen(queue) == 0
        else:
            scheduler.apply_async(entry)
            (raw,) = client.lrange(queue, 0, -1)
            assert json.loads(raw)["headers"][BEAT_HEADER]["claimed"] is False
    finally:
        client.delete(queue)
        scheduler.close()
        app.close()


def test_a_cluster_client(cluster: RedisClusterServers, prefix: str) -> None:
    client = cluster.client()
    app = locked_app(prefix, client)
    assert isinstance(app.tasks["client.fence"].delay(1).get(), int)
    nodes = client.get_nodes()  # type: ignore[no-untyped-call]
    assert client_for(app) == (client, "Redis Cluster " + ",".join(node.name for node in nodes))
    app.close()
    client.close()


def test_a_sentinel_primarys_client(sentinels: RedisSentinelServers, prefix: str) -> None:
    client = redis_client(sentinels.url, {"master_name": sentinels.master_name})
    app = locked_app(prefix, client)
    assert isinstance(app.tasks["client.fence"].delay(1).get(), int)
    assert client_for(app)[1] == f"Sentinel service {sentinels.master_name}"
    app.close()
    client.close()


def test_a_given_client_is_never_closed_a_made_one_is(redis_server: RedisServer, prefix: str) -> None:
    given = redis_server.client()
    app = locked_app(prefix, given)
    assert app.tasks["client.fence"].delay(1).get() is not None
    connection_id = given.client_id()
    forget_client(app)  # as testing.use_redis does
    assert given.client_id() == connection_id  # still connected: not closed
    made: list[redis.Redis] = []

    def make(app: Celery) -> redis.Redis:
        made.append(redis_server.client())
        return made[-1]

    app.conf.redislock_client = make
    assert app.tasks["client.fence"].delay(1).get() is not None
    connection_id = made[0].client_id()
    forget_client(app)
    assert made[0].client_id() != connection_id  # closed: connected afresh
    assert client_for(app)[0] is made[1]  # and the callable called again
    app.close()
    given.close()
    made[1].close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param(
            lambda server: "redis://user:secret@127.0.0.1/0",
            r"redislock_client is a builtins\.str; allowed: a redis\.Redis",
            id="a URL",
        ),
        pytest.param(
            lambda server: redis.asyncio.Redis.from_url(server.url),
            r"redislock_client is a redis\.asyncio\.client\.Redis; allowed",
            id="an asyncio client",
        ),
        pytest.param(
            lambda server: redis.Redis.from_url(server.url, single_connection_client=True),
            r"redislock_client is a single_connection_client",
            id="one connection",
        ),
    ],
)
def test_a_value_that_is_not_a_pooled_redis_client_is_refused(
    redis_server: RedisServer, prefix: str, value: Callable[[RedisServer], Any], message: str
) -> None:
    app = locked_app(prefix, value(redis_server))
    with pytest.raises(LockConfigurationError, match=rf"^app .client-setting.: {message}") as refused:
        app.tasks["client.fence"]
    assert "secret" not in str(refused.value)
    app.close()


def test_a_callable_returning_something_else_is_refused_when_called(prefix: str) -> None:
    app = locked_app(prefix, lambda app: "localhost:6379")
    returned = r"what the redislock_client callable returned is a builtins\.str; allowed: a redis\.Redis"
    with pytest.raises(LockConfigurationError, match=returned):
        app.tasks["client.fence"].delay(1).get()
    app.close()


def test_a_url_and_a_client_together_are_refused(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_client=client)
    with pytest.raises(LockConfigurationError, match="redislock_url and redislock_client are both set"):
        app.tasks["taskapp.hold_skip"]
    app.close()
    client.close()


def test_where_a_given_client_points_is_logged_without_credentials_and_with_its_scheme(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Read from the client, not connecting: TLS shows as ``rediss://``, a socket as ``unix://``."""
    tls = redis.Redis(host="127.0.0.1", port=redis_server.port, db=2, password="secret", ssl=True)
    plain = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3, password="secret")
    socket_client = redis.Redis(unix_socket_path=redis_server.unix_socket)
    assert client_location(tls) == f"rediss://127.0.0.1:{redis_server.port}/2"
    assert client_location(plain) == f"redis://127.0.0.1:{redis_server.port}/3"
    assert client_location(socket_client) == f"unix://{redis_server.unix_socket}?db=0"
    app = locked_app(prefix, socket_client)
    with caplog.at_level(logging.INFO, logger="celery_redislock.connection"):
        assert app.tasks["client.fence"].delay(1).get() is not None
    assert f"locks in Redis at unix://{redis_server.unix_socket}?db=0 (from redislock_client)" in caplog.text
    app.close()
    for client in (tls, plain, socket_client):
        client.close()


def test_two_threads_needing_the_client_at_once_call_the_callable_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """While the first call is under way, a second thread asks for the client: it waits for the
    first's client (given it a second to call the callable itself, as it did unguarded)."""
    made: list[redis.Redis] = []
    got: list[object] = []
    second = threading.Thread(target=lambda: got.append(client_for(app)[0]))

    def make(app: Celery) -> redis.Redis:
        made.append(redis_server.client())
        if len(made) == 1:
            second.start()
            second.join(1.0)  # unguarded, the second thread calls make() meanwhile and ends
        return made[0]

    app = locked_app(prefix, make)
    assert client_for(app)[0] is made[0]
    second.join(30)
    assert got == [made[0]] and len(made) == 1
    app.close()
    for client in made:
        client.close()
