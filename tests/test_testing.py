"""celery_redislock.testing and its pytest plugin, as a user's test suite uses them: the docs'
example (docs/testing.md) runs under pytest (in a subprocess, with the plugin the package registers), and each
helper is checked against a real server."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError, LockedTask, LockNotAcquired, task_lock_key
from celery_redislock.lock import companion_key
from celery_redislock.state import app_state
from celery_redislock.testing import RedisServer, _free_port, assert_no_locks, hold, locks_left, use_redis
from tests import invariants
from tests.taskapp import make_app, recorder
from tests.workers import threads_worker, wait_for

TESTING_PAGE = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
NOWHERE = "redis://127.0.0.1:9/0"  # the discard port: nothing answers there


def docs_pytest_example() -> str:
    blocks: list[str] = re.findall(r"```python\n(.*?)```", TESTING_PAGE.read_text(), flags=re.DOTALL)
    (block,) = [block for block in blocks if "def test_" in block and "redislock_url" in block]
    return block


@pytest.fixture
def app(prefix: str) -> Iterator[Celery]:
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.update(redislock_url=NOWHERE, redislock_prefix=prefix)

    @app.task(base=LockedTask, shared=False, lock_busy="skip")
    def skip(x: int) -> int:
        return x

    @app.task(base=LockedTask, shared=False, lock_busy="raise")
    def refuse(x: int) -> int:
        return x

    @app.task(base=LockedTask, shared=False, lock_mode="until_executed")
    def once(x: int) -> int:
        return x

    yield app
    app.close()


def test_the_docs_example_passes_under_pytest_with_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_tasks=docs_pytest_example())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_redislock_url_is_emptied_before_each_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_two="""
import redis

def test_first(redislock_url, redislock_server):
    redis.Redis.from_url(redislock_url).set("left-by-first", 1, ex=60)
    assert redislock_server.url == redislock_url

def test_second(redislock_url):
    assert redis.Redis.from_url(redislock_url).keys("*") == []
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_celery_config_can_use_the_session_server_for_a_worker(pytester: pytest.Pytester) -> None:
    """What the docs say for Celery's own fixtures: broker, results and locks on the session server."""
    pytester.makepyfile(
        test_worker="""
import pytest
from celery_redislock import LockedTask
from celery_redislock.testing import assert_no_locks, hold, use_redis

pytest_plugins = ["celery.contrib.pytest"]

@pytest.fixture(scope="session")
def celery_config(redislock_server):
    url = redislock_server.url
    return {"broker_url": url, "result_backend": url, "redislock_url": url}

def test_a_worker_skips_a_busy_call(celery_app, celery_worker):
    @celery_app.task(base=LockedTask, lock_busy="skip")
    def work(x):
        return x

    celery_worker.reload()
    with hold(work, (1,)):
        assert work.delay(1).get(timeout=10) is None  # skipped: the lock is busy
    assert work.delay(1).get(timeout=10) == 1
    assert_no_locks(celery_app)
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_use_redis_moves_the_locks_for_the_block_and_restores_the_setting(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    skip = app.tasks["tests.test_testing.skip"]
    with use_redis(app, redis_server.url) as client:
        assert app.conf.redislock_url == redis_server.url
        with hold(skip, (1,)) as lock:
            assert client.get(lock.name) is not None and lock.name.startswith(f"{prefix}:")
            assert skip(1) is None  # busy: skipped
        assert skip(1) == 1
    assert app.conf.redislock_url == NOWHERE
    assert app_state(app).client is None  # the next use reads the setting again


def test_use_redis_restores_an_unset_redislock_url(redis_server: RedisServer) -> None:
    app = Celery("bare", broker="memory://", set_as_current=False)
    with use_redis(app, redis_server.url):
        assert app.conf.redislock_url == redis_server.url
    assert app.conf.get("redislock_url") is None
    app.close()


def test_use_redis_sets_a_redislock_client_aside_for_the_block(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    given = redis.Redis.from_url(NOWHERE)
    app.conf.redislock_url = None
    app.conf.redislock_client = given
    skip = app.tasks["tests.test_testing.skip"]
    with use_redis(app, redis_server.url) as client:
        assert app.conf.get("redislock_client") is None
        with hold(skip, (1,)) as lock:
            assert client.get(lock.name) is not None
            assert skip(1) is None  # busy: skipped
    assert app.conf.redislock_client is given and app.conf.redislock_url is None
    assert app_state(app).client is None  # the next use reads the settings again


def test_hold_makes_a_call_find_its_lock_busy_and_an_enqueue_a_duplicate(
    app: Celery, redis_server: RedisServer
) -> None:
    refuse, once = app.tasks["tests.test_testing.refuse"], app.tasks["tests.test_testing.once"]
    with use_redis(app, redis_server.url):
        with hold(refuse, (), {"x": 7}, task_id="the-other-one"):
            with pytest.raises(LockNotAcquired) as refused:
                refuse(7)  # the key is the task's own: keyword or positional alike
            assert "task=the-other-one" in (refused.value.holder or "")
            assert refuse(8) == 8
        assert refuse(7) == 7
        with hold(once, (3,), task_id="queued-once"):
            assert once.delay(3).id == "queued-once"  # refused, nothing sent
        assert_no_locks(app)


@pytest.mark.parametrize(
    "mode", ["until_executing", "until_executed", "until_and_while_executing", "until_expired"]
)
def test_hold_refuses_an_enqueue_where_the_enqueue_lock_is_the_key_it_holds(
    app: Celery, redis_server: RedisServer, mode: str
) -> None:
    """docs/testing.md: ``hold`` holds the execution key, which is the enqueue lock of
    ``until_executing``, ``until_executed`` and ``until_expired``: an enqueue meanwhile is refused
    as a duplicate of its ``task_id``. An ``until_and_while_executing`` enqueue takes the
    ``…:queued`` lock, which ``hold`` leaves free: it is sent (the docs said every ``until_*``
    mode refused it)."""

    period = 60 if mode == "until_expired" else None  # the only mode with one

    @app.task(base=LockedTask, shared=False, name=f"proj.{mode}", lock_mode=mode, lock_period=period)
    def task(x: int) -> int:
        return x

    with use_redis(app, redis_server.url) as client:
        with hold(task, (1,), task_id="held-here"):
            sent = task.delay(1)
        if mode == "until_and_while_executing":
            assert sent.id != "held-here"
            queued = task_lock_key(task, (1,)) + ":queued"  # its message is never run here
            assert client.delete(queued) == 1
        else:
            assert sent.id == "held-here"
        assert_no_locks(app)


def held_places(client: redis.Redis, key: str, limit: int) -> int:
    """How many of the ``limit`` places of the semaphore ``key`` are held: its permits and its own key."""
    return int(client.exists(key, *(companion_key(key, f"permit:{i}") for i in range(1, limit + 1))))


@pytest.mark.parametrize(("name", "limit"), [("limited", 3), ("limited_wait", 2)])
def test_hold_takes_every_place_of_a_task_with_lock_limit(
    redis_server: RedisServer, prefix: str, name: str, limit: int
) -> None:
    """A test of "all N runs are going on": while held, a call finds the task busy (``limited``
    skips, ``limited_wait`` waits and runs once the hold ends); every key has a TTL meanwhile,
    and nothing is left after."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    task, key = app.tasks[f"taskapp.{name}"], task_lock_key(app.tasks[f"taskapp.{name}"], ("x",))

    def kinds() -> set[str]:
        return {event[0] for event in recorder(app).events()}

    try:
        with threads_worker(app, concurrency=2), redis_server.client() as client:
            with hold(task, ("x",)):
                called = task.delay("x")
                wait_for(lambda: kinds() & {"busy", "start"}, what="the call to find the task busy or run")
                assert kinds() == {"busy"}  # busy, and never started
                if name == "limited":
                    assert called.get(timeout=30) is None  # skipped
                assert held_places(client, key, limit) == limit
                assert invariants.keys_without_ttl(client, prefix) == []
            assert called.get(timeout=30) == ("x" if name == "limited_wait" else None)
            invariants.check(client, prefix)  # every place and companion key freed
            assert held_places(client, key, limit) == 0
            assert_no_locks(app)
    finally:
        app.close()


def test_hold_with_places_takes_that_many(redis_server: RedisServer, prefix: str) -> None:
    """``places=1``: one of the task's runs going on elsewhere; a call still runs beside it."""
    app = make_app(redis_server.url, prefix, f"q-{prefix}")
    task = app.tasks["taskapp.limited"]
    try:
        with threads_worker(app, concurrency=2), redis_server.client() as client:
            with hold(task, ("x",), places=1):
                assert held_places(client, task_lock_key(task, ("x",)), 3) == 1
                assert task.delay("x").get(timeout=30) == "x"
            assert_no_locks(app)
        for wrong in (0, 4):
            with pytest.raises(LockConfigurationError, match="places"):
                hold(task, ("x",), places=wrong).__enter__()
        with pytest.raises(LockConfigurationError, match="places"):
            hold(app.tasks["taskapp.hold_skip"], ("x",), places=2).__enter__()
    finally:
        app.close()


def test_hold_needs_a_bound_locked_task(app: Celery) -> None:
    @app.task(shared=False)
    def plain() -> None:
        return None

    with pytest.raises(LockConfigurationError, match="is not a LockedTask"):
        hold(plain).__enter__()


def test_with_the_locks_off_hold_is_refused_and_nothing_is_left(app: Celery) -> None:
    """``redislock_enabled=False``: a held lock would be one the tasks ignore; and the app takes
    nothing, so nothing is left, said without connecting (nothing answers at its URL)."""
    app.conf.redislock_enabled = False
    with pytest.raises(LockConfigurationError, match=r"^task '.*\.skip': hold\(\) needs redislock_enabled"):
        hold(app.tasks["tests.test_testing.skip"], (1,)).__enter__()
    assert locks_left(app) == []
    assert_no_locks(app)
    assert app_state(app).client is None


def test_assert_no_locks_names_what_is_left(app: Celery, redis_server: RedisServer, prefix: str) -> None:
    skip = app.tasks["tests.test_testing.skip"]
    with use_redis(app, redis_server.url) as client:
        assert_no_locks(app)
        # a beat slot's marker outlives its slot on purpose: not a leftover
        client.set(f"{prefix}:slot:digest:2026-11-22T10:00:00Z", f"{'a' * 32}:0:beat=host:1", px=60_000)
        assert locks_left(app) == []
        with hold(skip, (5,)) as lock:
            with pytest.raises(AssertionError, match=r"1 lock\(s\) left") as left:
                assert_no_locks(app)
            assert f"{lock.name} held by task=held-by-test" in str(left.value)
        client.set(f"{prefix}:forgotten", "1")  # no TTL: reported even though it is no lock
        assert locks_left(app) == [f"{prefix}:forgotten has no TTL"]
        client.delete(f"{prefix}:forgotten", f"{prefix}:slot:digest:2026-11-22T10:00:00Z")
        assert_no_locks(app)


def test_assert_no_locks_reads_a_prefix_with_glob_characters_as_it_is(
    redis_server: RedisServer, prefix: str
) -> None:
    """The scan for keys without a TTL took the prefix as a SCAN pattern: under ``[x]`` it looked
    for ``x:*`` (another app's keys, reported as this app's) and missed the app's own."""
    glob = f"{prefix}[x]"  # a valid prefix: only braces are refused
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.update(redislock_prefix=glob)
    with use_redis(app, redis_server.url) as client:
        client.set(f"{prefix}x:other-app", "1")  # what the pattern {prefix}[x]:* matches
        client.set(f"{glob}:forgotten", "1")
        try:
            assert locks_left(app) == [f"{glob}:forgotten has no TTL"]
        finally:
            client.delete(f"{prefix}x:other-app", f"{glob}:forgotten")
    app.close()


def test_the_plugin_is_registered(pytestconfig: Any) -> None:
    assert pytestconfig.pluginmanager.has_plugin("celery_redislock")


def test_a_server_whose_port_another_process_took_starts_on_another(redis_server: RedisServer) -> None:
    """Tests run in parallel (``make test``): a server whose port was taken, between the pick and
    its start, by another process's server (here: the suite's) does not take that server's PONG
    for its own; it starts on another port, and answers as itself."""
    taken = RedisServer()
    taken.port = redis_server.port  # as if the free port it picked were taken meanwhile
    with taken:
        assert taken.port != redis_server.port
        with taken.client() as client:
            assert int(client.info("server")["process_id"]) == taken.pid


def test_a_server_that_requires_a_password_starts() -> None:
    """``--requirepass`` (or an ACL turning the default user off): the readiness probe, refused
    with NOAUTH, took the server for not started, killed it and tried again, five times over,
    then raised ``redis-server did not start``."""
    server = RedisServer("--requirepass", "s3cret-pw")
    with server:
        with server.client(password="s3cret-pw") as client:
            assert int(client.info("server")["process_id"]) == server.pid
        with server.client() as client, pytest.raises(redis.AuthenticationError):
            client.ping()
    assert server.process is not None and server.process.poll() is not None
    assert not server.dir.exists()


def test_a_server_that_fails_to_start_leaves_no_directory() -> None:
    """``with RedisServer(...)`` whose start raised never reached ``__exit__``: its directory
    (config, log, socket) stayed in the temp dir, one per failed fixture. And a bad directive,
    which redis-server reports on its stderr before it opens its log, raised a
    ``FileNotFoundError`` for the log instead of saying what is wrong."""
    server = RedisServer("--no-such-directive", "yes")
    with pytest.raises(RuntimeError, match=r"did not start(.|\n)*no-such-directive"), server:
        pass
    assert not server.dir.exists()


def test_a_start_interrupted_stops_its_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or any exception) while ``with RedisServer()`` waited for its server left the
    server running, never stopped by its pid, and its directory behind."""

    def interrupted(self: RedisServer) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(RedisServer, "_wait_ready", interrupted)
    server = RedisServer()
    try:
        with pytest.raises(KeyboardInterrupt), server:
            pass
        assert server.process is not None and server.process.poll() is not None, "still running"
        assert not server.dir.exists()
    finally:
        server.close()  # what the fix does: the server is stopped, by its pid, if the test failed


def test_a_cluster_node_listens_at_or_below_port_55535() -> None:
    """A Cluster node's bus port is its port + 10,000: a node is started at or below 55535, where
    the kernel's free ports run to 60999 (Linux's default range)."""
    node = RedisServer("--cluster-enabled", "yes", highest_port=55535)
    ports = {_free_port(55535) for _ in range(200)}
    assert max(ports) <= 55535
    with node:
        assert node.port <= 55535


def test_a_wrapper_runs_the_server_in_its_own_process() -> None:
    """``wrapper`` runs the server (a profiler, for ``bench/instructions_bench.py``): here ``nice``,
    which execs it at a lower priority; the server answers as the process started, stopped by
    its pid."""
    server = RedisServer(wrapper=["nice", "-n", "7"])
    with server:
        with server.client() as client:
            assert int(client.info("server")["process_id"]) == server.pid
        niceness = int(Path(f"/proc/{server.pid}/stat").read_text().rpartition(")")[2].split()[16])
        assert niceness == os.getpriority(os.PRIO_PROCESS, 0) + 7
    assert server.process is not None and server.process.poll() is not None
