"""Security: argument values never reach Redis, no pickle, TLS with a test CA,
and the ACL command list of docs/operations.md ("Redis permissions"): enough, and minimal.
"""

from __future__ import annotations

import ast
import base64
import gc
import logging
import os
import re
import ssl
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import EncodeError

import celery_redislock
from celery_redislock import (
    LockedTask,
    LockNotOwned,
    RedisLock,
    RedisLockError,
    RedisSemaphore,
    task_lock_key,
)
from celery_redislock.connection import lock_url
from celery_redislock.keys import call_digest, lock_key
from celery_redislock.lock import companion_key
from celery_redislock.testing import RedisServer, find_redis_server
from tests import invariants
from tests.faults.conftest import RESULT_TIMEOUT, Stage, fresh
from tests.faults.tls import TLSRedisServer, TLSUnsupported, have_openssl, make_certificates
from tests.taskapp import LEASE, make_app
from tests.workers import renewed, threads_worker, wait_for

PERMISSIONS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PACKAGE = Path(celery_redislock.__file__).resolve().parent

# -- argument values never appear in Redis --------------------------------------------------


def everything_in(client: redis.Redis) -> list[tuple[bytes, bytes]]:
    """(key, value) for every key of the server, whatever its type (a value per member)."""
    found: list[tuple[bytes, bytes]] = []
    for key in client.scan_iter(match="*", count=1000):
        kind = client.type(key)
        values: list[Any]
        if kind == b"string":
            values = [client.get(key) or b""]
        elif kind == b"list":
            values = list(client.lrange(key, 0, -1))
        elif kind == b"zset":
            values = list(client.zrange(key, 0, -1))
        elif kind == b"hash":
            values = [item for pair in client.hgetall(key).items() for item in pair]
        elif kind == b"set":
            values = list(client.smembers(key))
        else:
            values = [kind]
        found += [(bytes(key), bytes(value)) for value in values]
    return found


def test_argument_values_never_appear_in_lock_keys_or_values(stage: Stage) -> None:
    """Every mode holds its locks at once, on a lock server of their own, with a secret in the
    arguments; a scan of every key name and value finds no trace of it (raw, hex, base64)."""
    secret = f"hunter2-{uuid.uuid4().hex}"
    forms = [secret.encode(), secret.encode().hex().encode(), base64.b64encode(secret.encode())]
    with RedisServer() as locks:
        json_only: dict[str, Any] = {"accept_content": ["json"], "result_accept_content": ["json"]}
        stage.worker("w", "threads", 6, redislock_url=locks.url, **json_only)
        app = stage.app_with(redislock_url=locks.url, **json_only)
        task = app.tasks.__getitem__
        gated = [
            task("taskapp.hold_wait").delay(f"{secret}-1", gate=True),
            task("taskapp.hold_wait").delay(f"{secret}-1", gate=True),  # waits: queue, deadlines, wake list
            task("taskapp.until_executed").delay(f"{secret}-2", gate=True),
            task("taskapp.until_and_while_executing").delay(f"{secret}-3", gate=True),
            task("taskapp.per_user").delay(f"{secret}-4", 1, gate=True),
        ]
        ran = task("taskapp.until_expired").delay(f"{secret}-5")  # its lock stays for lock_period
        task("taskapp.until_executed").apply_async((f"{secret}-6",), queue="nobody")  # stays queued
        for x in (f"{secret}-1", f"{secret}-2", f"{secret}-3", f"{secret}-4-1"):
            stage.wait_events("start", x)
        queued = task("taskapp.until_and_while_executing").delay(f"{secret}-3", gate=True)  # ...:queued
        stage.wait_events("busy", f"{secret}-1")
        assert ran.get(timeout=RESULT_TIMEOUT) == f"{secret}-5"
        lock_client = locks.client()
        scanned = everything_in(lock_client)
        names = {key for key, _ in scanned}
        assert len([key for key in names if not key.startswith(b"{")]) == 7  # each mode's lock(s) held
        assert any(key.endswith(b"}:queue") for key in names) and any(
            key.endswith(b"}:waiters") for key in names
        )
        leaks = [(key, value) for key, value in scanned for form in forms if form in key or form in value]
        assert leaks == []
        for key, value in scanned:  # and lock values are text: token, fence, holder; no pickle
            if not key.startswith(b"{"):
                assert re.fullmatch(rb"[0-9a-f]{32}:\d+:task=\S+ try=0 state=\w+ node=\S+ pid=\d+", value)
        for x in (f"{secret}-1", f"{secret}-2", f"{secret}-3", f"{secret}-4-1"):
            stage.recorder.open_gate(x, times=2)
        for result in [*gated, queued]:
            result.get(timeout=RESULT_TIMEOUT)
        assert not [
            (key, value) for key, value in everything_in(lock_client) for form in forms if form in value
        ]
        lock_client.delete(*lock_client.keys(f"{stage.prefix}:*"))  # the until_expired and the queued lock
        stage.client.delete("nobody")


def test_a_key_secret_keys_the_locks_and_shows_nowhere(
    redis_server: RedisServer, client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ``redislock_key_secret``, a running task's lock is ``task_lock_key``'s, an
    HMAC-SHA-256, not the plain SHA-256 of its canonical arguments that anyone can compute from
    a guessed user id; the secret is in no Redis key or value (locks, broker, results) and in
    no log record of the enqueue, the run and the release."""
    secret = f"k3y-{uuid.uuid4().hex}"
    forms = [secret.encode(), secret.encode().hex().encode(), base64.b64encode(secret.encode())]
    app = make_app(redis_server.url, prefix, f"q-{prefix}", redislock_key_secret=secret)
    started, finish = threading.Event(), threading.Event()

    @app.task(base=LockedTask, bind=True, shared=False, name="secret.charge", lock_mode="until_executed")
    def charge(self: Any, user_id: int) -> str:
        started.set()
        finish.wait(RESULT_TIMEOUT)
        return self.request.lock_key  # type: ignore[no-any-return]

    key = task_lock_key(charge, (42,))
    plain = lock_key(prefix, charge.name, call_digest(charge.name, charge.run, (42,)))
    assert key != plain and key.startswith(f"{prefix}:secret.charge:")
    with caplog.at_level(logging.DEBUG), threads_worker(app, concurrency=2):
        result = charge.delay(42)
        assert started.wait(RESULT_TIMEOUT)
        scanned = everything_in(client)
        assert client.exists(key) == 1 and client.exists(plain) == 0
        finish.set()
        assert result.get(timeout=RESULT_TIMEOUT) == key
    scanned += everything_in(client)
    assert [(name, value) for name, value in scanned for form in forms if form in name or form in value] == []
    assert [record for record in caplog.records if secret in record.getMessage()] == []
    app.close()


def test_no_pickle_anywhere_in_the_package() -> None:
    """No module imports a pickle-like serializer or names the pickle content type or serializer."""
    forbidden_modules = {
        "pickle",
        "_pickle",
        "cPickle",
        "dill",
        "cloudpickle",
        "shelve",
        "marshal",
        "jsonpickle",
    }
    forbidden_strings = {"pickle", "application/x-python-serialize"}
    sources = sorted(PACKAGE.glob("*.py"))
    assert len(sources) > 10
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {alias.name.split(".")[0] for alias in node.names} & forbidden_modules, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in forbidden_modules, path
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in forbidden_strings, f"{path}: {node.value!r}"


# -- TLS --------------------------------------------------------------------------------------


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TLSRedisServer]:
    if not have_openssl():
        pytest.skip("openssl is needed to make the test CA")
    try:
        server = TLSRedisServer(tmp_path).start()
    except TLSUnsupported as exc:
        pytest.skip(str(exc))
    yield server
    gc.collect()  # results left in reference cycles unsubscribe now, while their server is up
    server.stop()


def test_the_lock_over_tls_with_a_test_ca(tls_server: TLSRedisServer, prefix: str) -> None:
    client = tls_server.client()
    name = f"{prefix}:k"
    holder = RedisLock(client, name, ttl=LEASE)
    assert holder.acquire(blocking=False)
    renewed(client, name)  # by the watchdog, over its own TLS connections
    assert not holder.lost.is_set()
    waiter = RedisLock(client, name, ttl=LEASE, fair=True)
    thread = threading.Thread(target=waiter.acquire, kwargs={"timeout": 10})
    thread.start()
    wait_for(lambda: client.zcard(companion_key(name, "queue")) == 1, what="the waiter to queue")
    holder.release()  # hands the lock over; the waiter blocks in BLPOP over TLS
    thread.join(10)
    assert waiter.owned()
    waiter.release()
    assert invariants.keys_of(client, prefix) == []
    for url in (tls_server.url(ca=False), f"redis://127.0.0.1:{tls_server.port}/0"):
        with pytest.raises(redis.ConnectionError):  # not trusted without the test CA; not plain TCP
            redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping()


def test_locked_tasks_over_tls_broker_and_locks(tls_server: TLSRedisServer, prefix: str) -> None:
    """Broker, results and locks over ``rediss://``: the locks inherit the broker's URL and its
    ``broker_use_ssl`` (the test CA); a worker runs a locked task."""
    ssl_options = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tls_server.ca)}
    url = tls_server.url(ca=False)
    app = Celery("tls", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"q-{prefix}",
        redislock_prefix=prefix,
        broker_use_ssl=ssl_options,
        redis_backend_use_ssl=ssl_options,
    )

    @app.task(base=LockedTask, bind=True, shared=False, name="tls.fence")
    def fence(self: Any, x: str) -> int:
        return self.request.lock_fence  # type: ignore[no-any-return]

    assert lock_url(app) == (url, "broker_url")
    with threads_worker(app, concurrency=2):
        assert isinstance(fence.delay(fresh()).get(timeout=RESULT_TIMEOUT), int)
    assert invariants.keys_of(tls_server.client(), prefix) == []
    untrusted = Celery("tls", broker="memory://", set_as_current=False)
    untrusted.conf.update(redislock_url=url, redislock_prefix=prefix)

    @untrusted.task(base=LockedTask, shared=False, name="tls.one")
    def one() -> int:
        return 1

    with pytest.raises(RedisLockError, match=r"rediss://127\.0\.0\.1.*certificate verify failed"):
        one()


def test_locked_tasks_over_a_tls_cluster_as_an_acl_user(
    tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``rediss-cluster://user:password@nodes?ssl_cert_reqs=required&ssl_ca_certs=/path`` (no db
    path, as a Cluster has only db 0): the '/' of the CA's path was taken for the start of the
    db, the CA dropped, and every lock failed with CERTIFICATE_VERIFY_FAILED. The password
    (holding '@' and ';') is shown nowhere."""
    if not have_openssl():
        pytest.skip("openssl is needed to make the test CA")
    secret = "s3cret-pw"
    password = f"p@ss;{secret}"
    ca, cert, key = make_certificates(tmp_path)
    acl = ["--user", "locks", "on", f">{password}", "~*", "&*", "+@all"]
    nodes: list[TLSRedisServer] = []
    try:
        for i in range(3):
            (tmp_path / f"node{i}").mkdir()
            node = TLSRedisServer(
                tmp_path / f"node{i}",
                *("--cluster-enabled", "yes", "--tls-cluster", "yes", "--cluster-config-file", "nodes.conf"),
                *(*acl, "--masteruser", "locks", "--masterauth", password),
                certificates=(ca, cert, key),
                highest_port=55535,  # a node's bus port is its port + 10,000
            )
            nodes.append(node)
            node.start()
        cli = Path(find_redis_server()).with_name("redis-cli")
        subprocess.run(
            [
                *(str(cli) if cli.exists() else "redis-cli", "--tls", "--cacert", str(ca), "--user", "locks"),
                *("--cluster", "create", *(f"127.0.0.1:{node.port}" for node in nodes), "--cluster-yes"),
            ],
            env={**os.environ, "REDISCLI_AUTH": password},
            check=True,
            capture_output=True,
            timeout=60,
        )
        for node in nodes:
            with node.client(username="locks", password=password) as client:
                wait_for(lambda: client.cluster("info")["cluster_state"] == "ok", what="the cluster")
    except TLSUnsupported as exc:
        pytest.skip(str(exc))
    try:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        url = f"rediss-cluster://locks:{password}@{hosts}?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        app = Celery("tls-cluster", broker="memory://", set_as_current=False)
        app.conf.update(redislock_url=url, redislock_prefix=prefix)

        @app.task(base=LockedTask, bind=True, shared=False, name="tls.cluster")
        def fence(self: Any, x: int) -> int:
            return self.request.lock_fence  # type: ignore[no-any-return]

        with caplog.at_level(logging.INFO, logger="celery_redislock"):
            fences = [fence(x) for x in range(3)]  # keys in several slots: several nodes
        assert all(isinstance(value, int) for value in fences)
        assert f"rediss-cluster://locks:**@{hosts}?ssl_cert_reqs=required" in caplog.text
        assert secret not in caplog.text
        app.close()
    finally:
        for node in nodes:
            node.stop()


# -- ACL: the command list of docs/operations.md -------------------------------------------------


def documented_acl() -> tuple[list[str], list[str]]:
    """(key patterns, commands) of the ``ACL SETUSER`` line in docs/operations.md, "Redis permissions"."""
    [line] = re.findall(r"^ACL SETUSER locks on .*$", PERMISSIONS_PAGE.read_text(), flags=re.MULTILINE)
    tokens = line.split()
    patterns = [token for token in tokens if token.startswith("~")]
    commands = [token[1:] for token in tokens if token.startswith("+")]
    assert "-@all" in tokens and patterns == ["~redislock:*", "~{redislock:*"], line
    return patterns, commands


COMMANDS = documented_acl()[1]
#: What redis-py sends at every connect (MAINT_NOTIFICATIONS: redis-py 8, over RESP3), refused
#: under the documented list and only logged; the documented optional rules for them.
HANDSHAKE = ["client|setinfo", "client|maint_notifications"]


def handshake_rules(admin: redis.Redis) -> list[str]:
    """The ``HANDSHAKE`` rules the server takes: Redis 6.2 any subcommand name; 7.0 and 7.1
    none (they know neither subcommand, so refuse neither command); 7.2+ CLIENT SETINFO."""
    version = server_version(admin)
    if version < (7, 0):
        return HANDSHAKE
    return [] if version < (7, 2) else HANDSHAKE[:1]


def server_version(admin: redis.Redis) -> tuple[int, int]:
    major, minor = admin.info("server")["redis_version"].split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """A server of the module's own: the tests add users and flush its script cache."""
    with RedisServer() as server:
        yield server
        gc.collect()  # results of the in-process worker's retries unsubscribe now, while the server is up


def logged_as(admin: redis.Redis, command: str) -> str:
    """How ACL LOG names a refused ``command``: Redis 6.2 by the command alone (``script``),
    7.0 and later with the subcommand (``script|load``)."""
    return command.split("|")[0] if server_version(admin) < (7, 0) else command


def acl_url(server: RedisServer, prefix: str, commands: list[str], handshake: bool = True) -> str:
    """A user with the documented rules for ``prefix`` and ``commands``, and its optional rules
    for redis-py's handshake where the server takes them (unless ``handshake=False``)."""
    name = f"locks-{uuid.uuid4().hex[:8]}"
    admin = server.client()
    rules = [f"~{prefix}:*", f"~{{{prefix}:*", "resetchannels", "-@all"]  # the documented rules, per prefix
    commands = [*commands, *(handshake_rules(admin) if handshake else [])]
    admin.acl_setuser(name, enabled=True, passwords=["+pw"], reset=True)
    admin.execute_command("ACL", "SETUSER", name, *rules, *[f"+{command}" for command in commands])  # type: ignore[no-untyped-call]
    admin.close()
    return f"redis://{name}:pw@127.0.0.1:{server.port}/0"


def lock_workload(url: str, prefix: str, admin: redis.Redis) -> list[str]:
    """Every path of the lock: what went wrong, if anything (empty: all worked).

    Free acquire after the server lost its scripts, ``owned``/``locked``, renewals and
    ``extend``, a first-come waiter woken by a release, a fair waiter handed the lock, a
    waiter that gives up, and a semaphore's permit (``lock_limit`` above 1).
    """
    problems: list[str] = []
    client = redis.Redis.from_url(url, socket_timeout=5)
    name = f"{prefix}:k"

    def attempt(what: str, call: Any) -> Any:
        try:
            return call()
        except (redis.RedisError, LockNotOwned) as exc:
            problems.append(f"{what}: {exc!r}")
            return None

    def waiter(fair: bool, timeout: float, got: list[bool]) -> None:
        lock = RedisLock(client, name, ttl=5, fair=fair)
        got.append(bool(attempt("wait", lambda: lock.acquire(timeout=timeout))))
        if got[-1]:
            attempt("release after the wait", lock.release)

    def contended(fair: bool, timeout: float, released: bool) -> list[bool]:
        holder = RedisLock(client, name, ttl=5, watchdog=False)
        if not attempt("acquire a busy lock's first hold", lambda: holder.acquire(blocking=False)):
            return []
        got: list[bool] = []
        thread = threading.Thread(target=waiter, args=(fair, timeout, got))
        thread.start()
        queued = wait_for(
            lambda: admin.zcard(companion_key(name, "queue")) or got, timeout=10, what="a waiter"
        )
        if released and queued:
            attempt("release to a waiter", holder.release)
        thread.join(15)
        if not released:
            attempt("release", holder.release)
        return got

    admin.script_flush()
    lock = RedisLock(client, name, ttl=LEASE)
    if attempt("acquire", lambda: lock.acquire(blocking=False)):
        if not attempt("owned", lock.owned):
            problems.append("owned() was not True")
        if not attempt("locked", lock.locked):
            problems.append("locked() was not True")
        lowest = admin.pttl(name)

        def renewed_or_lost() -> bool:
            nonlocal lowest
            now = admin.pttl(name)
            lowest, rose = min(lowest, now), now > lowest
            return rose or lock.lost.is_set()

        wait_for(renewed_or_lost, timeout=10 * LEASE, what="a renewal by the watchdog, or a loss")
        if lock.lost.is_set():
            problems.append("the watchdog could not renew the lease")
        attempt("extend", lambda: lock.extend(LEASE))
        attempt("release", lock.release)
    for fair in (False, True):
        if contended(fair, timeout=1, released=True) != [True]:  # a release wakes it in ms
            problems.append(f"a {'fair' if fair else 'first-come'} waiter did not get the released lock")
    if contended(False, timeout=0.2, released=False) != [False]:
        problems.append("a waiter that gave up did not report it")
    semaphore = RedisSemaphore(client, f"{prefix}:s", 2, ttl=5, watchdog=False)
    if attempt("acquire a permit", lambda: semaphore.acquire(blocking=False)):
        attempt("release a permit", semaphore.release)
    client.close()
    return problems


def test_the_documented_acl_list_is_enough(acl_server: RedisServer, prefix: str) -> None:
    url = acl_url(acl_server, prefix, COMMANDS)
    admin = acl_server.client()
    admin.acl_log_reset()
    assert lock_workload(url, prefix, admin) == []
    # The task paths too: an enqueue lock adopted by the worker and kept across a retry (ADOPT,
    # PARK), a period kept after the run (SETTLE); the broker uses the default user.
    # And lock_duplicate="replace": a call taking the queued message's lock over (REPLACE), one
    # that cannot be sent giving it back (UNREPLACE), the superseded message dropped (DROP).
    app = make_app(acl_server.url, prefix, f"q-{prefix}", redislock_url=url)

    def last_call(x: str, call: object = 0) -> object:
        return call

    replaced: Any = app.task(base=LockedTask, shared=False, name="acl_replace", lock_on=("x",),
                             lock_mode="until_executing", lock_duplicate="replace")(last_call)  # fmt: skip
    x, y, z = fresh(), fresh(), fresh()
    superseded = replaced.delay(z, 1)
    with pytest.raises(EncodeError):
        replaced.delay(z, object())  # the key is made of x alone: only sending fails
    latest = replaced.delay(z, 2)
    app.recorder.open_gate(x, times=2)  # type: ignore[attr-defined]
    with threads_worker(app, concurrency=2):
        assert app.tasks["taskapp.retry_twice"].delay(x).get(timeout=RESULT_TIMEOUT) == x
        assert app.tasks["taskapp.until_expired"].delay(y).get(timeout=RESULT_TIMEOUT) == y
        assert latest.get(timeout=RESULT_TIMEOUT) == 2
        assert superseded.get(timeout=RESULT_TIMEOUT) is None  # dropped
    until_expired = task_lock_key(app.tasks["taskapp.until_expired"], (y,))
    assert 0 < admin.pttl(until_expired) <= 600_000
    admin.delete(until_expired)
    invariants.check(admin, prefix)
    assert admin.acl_log() == []  # nothing was refused
    app.close()


@pytest.mark.parametrize("missing", COMMANDS)
def test_the_documented_acl_list_is_minimal(acl_server: RedisServer, prefix: str, missing: str) -> None:
    url = acl_url(acl_server, prefix, [command for command in COMMANDS if command != missing])
    admin = acl_server.client()
    admin.acl_log_reset()
    problems = lock_workload(url, prefix, admin)
    assert problems, f"everything worked without {missing}"
    refused = {entry["object"] for entry in admin.acl_log() if entry["reason"] == "command"}
    assert refused == {logged_as(admin, missing)}, problems
    for key in invariants.keys_of(admin, prefix):  # what a script stopped midway left
        admin.delete(key)


def test_a_refused_handshake_is_only_logged(acl_server: RedisServer, prefix: str) -> None:
    """Without the documented optional ``+client|...`` rules, every path of the lock still works:
    redis-py goes on when the server refuses its CLIENT SETINFO (and MAINT_NOTIFICATIONS) at
    connect. The refusal is only logged (ACL LOG), where the rules would take it away; Redis
    7.0 has nothing to refuse."""
    admin = acl_server.client()
    admin.acl_log_reset()
    assert lock_workload(acl_url(acl_server, prefix, COMMANDS, handshake=False), prefix, admin) == []
    refused = {entry["object"] for entry in admin.acl_log() if entry["reason"] == "command"}
    assert refused == ({"client"} if handshake_rules(admin) else set())
    assert all(f"+{rule}" in PERMISSIONS_PAGE.read_text() for rule in HANDSHAKE)
