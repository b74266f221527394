"""LockedTask options, settings, bad input, Redis errors and direct calls, on a real Redis.

Bad values fail when the task is bound, naming task, option, value and what
is allowed; arguments that cannot be keyed fail at ``apply_async`` before
anything is sent; an unreachable Redis fails the task (or runs it unlocked)
with a message naming the URL. None of them leaves a key behind.
"""

from __future__ import annotations

import decimal
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta, timezone
from typing import Any

import kombu.serialization
import kombu.utils.json
import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

import celery_redislock.execution
from celery_redislock import (
    LockConfigurationError,
    LockedTask,
    LockKeyError,
    LockNotAcquired,
    RedisLock,
    RedisLockError,
    install,
    task_lock_key,
)
from celery_redislock.connection import client_for, lock_url
from celery_redislock.state import running
from celery_redislock.testing import RedisServer
from tests.workers import threads_worker


def new_app(url: str, prefix: str, **conf: Any) -> Celery:
    app = Celery("cfg", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        {"redislock_url": url, "redislock_prefix": prefix, "task_default_queue": f"q-{prefix}", **conf}
    )
    app.finalize()
    return app


@pytest.fixture
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    app = new_app(redis_server.url, prefix)
    yield app
    app.close()


def define(app: Celery, body: Callable[..., Any] | None = None, **options: Any) -> Any:
    def add(a: int, b: int = 2) -> int:
        return a + b

    return app.task(**{"base": LockedTask, "shared": False, "name": "cfg.add", **options})(body or add)


def nothing_under(client: redis.Redis, prefix: str) -> bool:
    return [*client.scan_iter(match=f"{prefix}*"), *client.scan_iter(match=f"{{{prefix}*")] == []


# -- options: resolution and validation at bind time ----------------------------------------------


def test_options_come_from_the_task_then_the_app_then_the_defaults(
    redis_server: RedisServer, prefix: str
) -> None:
    app = new_app(redis_server.url, prefix, redislock_ttl=timedelta(seconds=12), redislock_busy="wait")
    task = define(app, lock_ttl=7)
    options = task.lock_options
    assert (options.ttl, options.busy, options.on_lost, options.wait_timeout) == (7.0, "wait", "log", 7.0)
    assert (options.mode, options.on, options.retry_delay, options.queue_ttl) == (
        "while_executing",
        None,
        5.0,
        3600.0,
    )


def test_subclass_and_task_annotations_set_options(redis_server: RedisServer, prefix: str) -> None:
    class Patient(LockedTask):
        lock_busy = "wait"
        lock_wait_timeout = 2

    app = new_app(redis_server.url, prefix, task_annotations={"cfg.add": {"lock_ttl": 9}})
    task = define(app, base=Patient)
    assert (task.lock_options.busy, task.lock_options.wait_timeout, task.lock_options.ttl) == (
        "wait",
        2.0,
        9.0,
    )


def test_install_is_idempotent_and_automatic(app: Celery) -> None:
    from celery.signals import task_postrun

    define(app)
    receivers = len(task_postrun.receivers)
    install(app)
    install(app)
    assert len(task_postrun.receivers) == receivers


@pytest.mark.parametrize("app", [None, "proj", 5])
def test_install_names_what_is_no_celery_app(app: object) -> None:
    """``install(app)`` with no Celery app (a beat process's setup passing the wrong object)
    raised ``TypeError: cannot create weak reference to 'int' object``, or an ``AttributeError``,
    naming neither ``install`` nor ``app``."""
    with pytest.raises(LockConfigurationError, match=r"install\(app\): app must be a Celery app, got "):
        install(app)


def test_install_connects_its_receivers_once_per_process_not_once_per_app(
    app: Celery, redis_server: RedisServer, prefix: str
) -> None:
    """Every receiver ``install`` connects has a ``dispatch_uid`` of the package's
    (``celery_redislock.``): a process that makes app after app (a test suite) does not
    gather one more receiver per app, each kept for good."""
    import celery.signals
    from celery.utils.dispatch import Signal

    signals = {name: s for name, s in vars(celery.signals).items() if isinstance(s, Signal)}
    install(app)
    before = {name: [key for key, _ in signal.receivers] for name, signal in signals.items()}
    other = new_app(redis_server.url, f"{prefix}-other")
    try:
        install(other)
        added = {
            name: [receiver for key, receiver in signal.receivers if key not in before[name]]
            for name, signal in signals.items()
        }
        assert {name: receivers for name, receivers in added.items() if receivers} == {}
    finally:
        other.close()


def test_the_lock_url_defaults_to_a_redis_broker_then_localhost() -> None:
    app = Celery("urls", broker="rediss://:secret@cache.example:6380/2", set_as_current=False)
    assert lock_url(app) == ("rediss://:secret@cache.example:6380/2", "broker_url")
    app = Celery("urls", broker="amqp://guest@localhost//", set_as_current=False)
    assert lock_url(app) == ("redis://localhost:6379/0", "default")
    app.conf.redislock_url = "unix:///run/redis.sock?db=1"
    assert lock_url(app) == ("unix:///run/redis.sock?db=1", "redislock_url")


def test_a_redis_broker_on_a_unix_socket_is_the_lock_url(redis_server: RedisServer) -> None:
    """Celery spells a Redis broker on a Unix socket ``redis+socket://`` (the db in
    ``virtual_host``); the locks went to ``redis://localhost:6379/0`` instead."""
    broker = f"redis+socket://{redis_server.unix_socket}?virtual_host=3"
    app = Celery("urls", broker=broker, set_as_current=False)
    try:
        assert lock_url(app) == (f"unix://{redis_server.unix_socket}?db=3", "broker_url")
        client, _ = client_for(app)
        assert isinstance(client, redis.Redis)
        assert client.connection_pool.connection_kwargs["db"] == 3
        assert client.ping()
    finally:
        app.close()


@pytest.mark.parametrize("reqs", ["CERT_REQUIRED", "CERT_OPTIONAL", "CERT_NONE"])
def test_a_tls_brokers_certificate_requirement_in_kombus_spelling_is_read(reqs: str) -> None:
    """Celery's broker takes ``ssl_cert_reqs=CERT_REQUIRED`` (kombu reads both spellings);
    redis-py only ``required``: every lock call raised ``Invalid SSL Certificate Requirements Flag``."""
    app = Celery(
        "urls", broker=f"rediss://:pw@cache.example:6380/2?ssl_cert_reqs={reqs}", set_as_current=False
    )
    try:
        url, source = lock_url(app)
        assert (url, source) == (
            f"rediss://:pw@cache.example:6380/2?ssl_cert_reqs={reqs.removeprefix('CERT_').lower()}",
            "broker_url",
        )
        client, _ = client_for(app)
        assert isinstance(client, redis.Redis)
        client.connection_pool.make_connection()  # raised RedisError; nothing is sent
    finally:
        app.close()


# -- keys ------------------------------------------------------------------------------------


def test_task_lock_key_applies_defaults_and_hides_values(app: Celery, prefix: str) -> None:
    task = define(app)
    key = task_lock_key(task, (1,))
    assert key == task_lock_key(task, (1, 2)) == task_lock_key(task, (), {"a": 1, "b": 2})
    assert re.fullmatch(rf"{prefix}:cfg\.add:[0-9a-f]{{64}}", key)
    assert key != task_lock_key(task, (1, 3))


def test_unkeyable_arguments_fail_at_apply_async_before_sending(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    task = define(app)
    with pytest.raises(LockKeyError, match=r"task 'cfg\.add'.*argument 'b'") as raised:
        task.delay(1, b=object())
    assert raised.value.argument == "b"
    with pytest.raises(LockKeyError, match="argument 'c'"):
        task.apply_async((1,), {"c": 3})  # not a parameter of the task
    assert client.llen(f"q-{prefix}") == 0
    assert nothing_under(client, prefix)


@pytest.mark.parametrize(
    "mode", ["until_executing", "until_executed", "until_and_while_executing", "until_expired"]
)
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("countdown", float("nan")),
        ("countdown", "soon"),
        ("countdown", "5"),
        ("countdown", 10**30),
        ("countdown", 1e12),
        ("countdown", -1e300),
        ("eta", "tomorrow"),
        ("eta", 123),
        ("eta", [1]),
        ("expires", "never"),
        ("expires", [1]),
        ("expires", 1e12),
        ("expires", -(10**30)),
    ],
)
def test_a_bad_countdown_eta_or_expires_is_named_before_the_enqueue_lock(
    app: Celery, client: redis.Redis, prefix: str, mode: str, option: str, value: object
) -> None:
    """An enqueue lock's TTL is read from them: a NaN countdown raised ``ttl must be finite``,
    an option the call never named, and the others a bare ``ValueError`` naming none; an ``eta``
    in seconds (which ``expires`` takes, not ``eta``) was taken as one, and the send then failed
    with Celery's ``AttributeError: 'int' object has no attribute 'isoformat'``, naming none.
    A countdown that is a numeric string, or a countdown or ``expires`` in seconds past the
    range of Celery's datetimes (year 1 to 9999), was read as a time, the lock taken, and the
    send then failed with Celery's ``TypeError`` or ``OverflowError``, naming none."""
    task = define(app, lock_mode=mode, lock_period=60 if mode == "until_expired" else None)
    message = f"task 'cfg.add': {option}={value!r} is not valid"
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        task.apply_async((1,), **{option: value})
    assert client.llen(f"q-{prefix}") == 0
    assert nothing_under(client, prefix)


@pytest.mark.parametrize("mode", ["while_executing", "until_executed"])
@pytest.mark.parametrize(("option", "value"), [("lock_ttl", 5), ("lock_mode", "x"), ("lock_in_canvs", True)])
def test_a_lock_option_apply_async_does_not_take_is_refused_naming_it(
    app: Celery, client: redis.Redis, prefix: str, mode: str, option: str, value: object
) -> None:
    """Lock options are the task's; a call takes ``lock_in_canvas`` only. Any other, or a
    misspelt one, was ignored: the message was sent (with the option among its properties),
    locked as the task's options say, as if the call had not asked."""
    task = define(app, lock_mode=mode)
    message = f"task 'cfg.add': {option}={value!r} is not an option of apply_async"
    with pytest.raises(LockConfigurationError, match=re.escape(message)) as raised:
        task.apply_async((1,), **{option: value})
    assert "lock_in_canvas" in str(raised.value)
    assert client.llen(f"q-{prefix}") == 0
    assert nothing_under(client, prefix)


@pytest.mark.parametrize("mode", ["while_executing", "until_executed"])
@pytest.mark.parametrize("task_id", [5, uuid.UUID(int=5), b"id"])
def test_a_task_id_that_is_no_str_is_named(
    app: Celery, client: redis.Redis, prefix: str, mode: str, task_id: object
) -> None:
    """A task id is a str: an int, a ``uuid.UUID`` or bytes ended in ``TypeError:
    quote_from_bytes() expected bytes`` (the enqueue lock's holder), or in Celery's own
    ``TypeError`` from the result backend, naming no argument."""
    task = define(app, lock_mode=mode)
    message = f"task 'cfg.add': task_id={task_id!r} is not valid; allowed: a str"
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        task.apply_async((1,), task_id=task_id)
    assert client.llen(f"q-{prefix}") == 0
    assert nothing_under(client, prefix)


@pytest.mark.parametrize("headers", [5, "k=v", [("k",)]])
def test_headers_that_are_no_mapping_are_named(
    app: Celery, client: redis.Redis, prefix: str, headers: object
) -> None:
    """``apply_async(headers=...)`` is what ``dict()`` takes (the enqueue lock's ticket joins it):
    an int ended in ``TypeError: 'int' object is not iterable``, a str in ``ValueError:
    dictionary update sequence element #0 has length 1; 2 is required``, naming no argument."""
    task = define(app, lock_mode="until_executed")
    message = f"task 'cfg.add': headers={headers!r} is not valid; allowed: a dict ("
    with pytest.raises(LockConfigurationError, match=re.escape(message)):
        task.apply_async((1,), headers=headers)
    assert client.llen(f"q-{prefix}") == 0
    assert nothing_under(client, prefix)


def test_the_worker_locks_the_key_apply_async_computed(app: Celery, client: redis.Redis) -> None:
    """The enqueue lock's key and the key the worker locks are one, for every type Celery's
    JSON carries: a tuple arrives as a list and a dict's int keys as strings; today
    {10: ..., 9: ...} was keyed with its keys sorted as ints at apply_async and as strings at
    the worker (another key), and a dict with int and str keys could not be sent at all."""

    def lock_key_seen(self: Any, value: Any) -> str:
        return self.request.lock_key  # type: ignore[no-any-return]

    task = app.task(base=LockedTask, bind=True, shared=False, name="cfg.keyed", lock_mode="until_executed")(
        lock_key_seen
    )
    values = [
        {10: "a", 9: "b"},
        {1: "a", "b": (2, 3)},
        (1, [2, (3, None)], 1.0, True),
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        date(2026, 1, 2),
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        b"\xff\x00",
        {"nested": [{"at": datetime(2026, 1, 2)}, b"bytes"]},
    ]
    with threads_worker(app, concurrency=2):
        for value in values:
            assert task.delay(value).get(timeout=30) == task_lock_key(task, (value,)), value
    assert all(client.exists(task_lock_key(task, (value,))) == 0 for value in values)  # adopted, released


def test_a_lock_on_callable_that_raises_is_named(app: Celery) -> None:
    def broken(a: int, b: int = 2) -> None:
        raise KeyError("tenant")

    task = define(app, lock_on=broken)
    with pytest.raises(LockKeyError, match="lock_on"):
        task.delay(1)


def test_a_soft_time_limit_in_a_lock_on_callable_propagates(app: Celery) -> None:
    """A soft time limit (an ``Exception``) landing in the ``lock_on`` callable, as a run's body
    sends a call, is not the callable failing: it propagates as itself (the body's own handler
    of it runs), not as ``LockKeyError``; nothing is sent."""

    def interrupted(a: int, b: int = 2) -> None:
        raise SoftTimeLimitExceeded()

    task = define(app, lock_on=interrupted)
    with pytest.raises(SoftTimeLimitExceeded):
        task.delay(1)


def test_a_soft_time_limit_as_the_arguments_go_through_the_serializer_propagates(
    app: Celery, client: redis.Redis
) -> None:
    """The arguments a ``lock_on`` callable is called with at ``apply_async`` go through the
    message's serializer first; a soft time limit landing there (kombu wraps it in an
    ``EncodeError``) propagates, never taken for arguments the serializer cannot take (left to
    Celery's send to report): nothing is sent."""
    interrupts = [SoftTimeLimitExceeded()]

    def encode(value: Any) -> str:
        if interrupts:
            raise interrupts.pop()
        return kombu.utils.json.dumps(value)

    kombu.serialization.register("interrupting", encode, kombu.utils.json.loads, "application/x-interrupting")
    try:
        task = define(app, lock_on=lambda a, b=2: a)
        with pytest.raises(SoftTimeLimitExceeded):
            task.apply_async((1,), serializer="interrupting")
    finally:
        kombu.serialization.unregister("interrupting")
    assert not interrupts
    assert client.llen(app.conf.task_default_queue) == 0


# -- direct calls, apply(), eager --------------------------------------------------------------------


def test_direct_calls_and_apply_lock_too(app: Celery, client: redis.Redis) -> None:
    seen: list[tuple[str, int | None]] = []

    def body(self: Any, a: int, b: int = 2) -> int:
        key = self.request.lock_key
        seen.append((key, self.request.lock_fence))
        assert client.get(key) is not None  # held while the body runs
        return a + b

    task = app.task(base=LockedTask, shared=False, bind=True, name="cfg.add")(body)
    assert task(1) == 3
    assert task.apply((2,)).get() == 4
    app.conf.task_always_eager = True
    assert task.delay(3).get() == 5
    assert len(seen) == 3 and all(fence is not None for _, fence in seen)
    assert all(client.exists(key) == 0 for key, _ in seen)


def test_a_direct_call_finds_the_lock_busy(app: Celery, client: redis.Redis) -> None:
    skip = define(app)
    holder = RedisLock(client, task_lock_key(skip, (1,)), ttl=5)
    holder.acquire()
    assert skip(1) is None  # lock_busy="skip"
    holder.release()
    assert skip(1) == 3


def test_eager_raise_and_wait(app: Celery, client: redis.Redis) -> None:
    raising = define(app, lock_busy="raise")
    key = task_lock_key(raising, (1,))
    holder = RedisLock(client, key, ttl=5, holder="someone")
    holder.acquire()
    with pytest.raises(LockNotAcquired, match="held by 'someone'") as raised:
        raising.apply((1,)).get()
    assert raised.value.key == key
    holder.release()


# -- Redis errors: redislock_on_error ----------------------------------------------------------


@pytest.fixture
def unreachable_url(refused_port: int) -> str:
    """A lock URL, with a password, where connections are refused for the whole test: its port
    is held (``tests/ports.py``), so no other test process's server answers there meanwhile."""
    return f"redis://:secret@127.0.0.1:{refused_port}/0"


def test_on_error_fail_names_the_url_without_its_password(
    redis_server: RedisServer, prefix: str, unreachable_url: str
) -> None:
    app = new_app(redis_server.url, prefix, redislock_url=unreachable_url)
    task = define(app)
    with threads_worker(app), pytest.raises(RedisLockError) as raised:
        task.delay(1).get(timeout=30)
    message = str(raised.value)
    assert "task 'cfg.add'" in message and unreachable_url.replace("secret", "**") in message
    assert "secret" not in message


def test_on_error_run_runs_unlocked_with_a_warning(
    redis_server: RedisServer, prefix: str, unreachable_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = new_app(redis_server.url, prefix, redislock_url=unreachable_url, redislock_on_error="run")

    def fence(self: Any) -> int | None:
        return self.request.lock_fence  # type: ignore[no-any-return]

    task = app.task(base=LockedTask, shared=False, bind=True, name="cfg.fence")(fence)
    with caplog.at_level(logging.WARNING, logger="celery_redislock"):
        assert task() is None  # ran, unlocked: no fence
    assert "running unlocked" in caplog.text


def test_on_error_run_runs_unlocked_through_apply_and_in_a_worker(
    redis_server: RedisServer, prefix: str, unreachable_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run Celery traces (``apply()``, a worker's) that runs unlocked, Redis unreachable as it
    took the lock (``redislock_on_error="run"``), ends as a direct call does: its result, no
    error after it, nothing left of it in the package. Its ``after_return`` met the run still
    registered with no lock, and failed an assertion: ``apply()`` raised ``AssertionError``, and
    a worker logged "after_return handler raised"."""
    app = new_app(redis_server.url, prefix, redislock_url=unreachable_url, redislock_on_error="run")

    def fence(self: Any) -> int | None:
        return self.request.lock_fence  # type: ignore[no-any-return]

    task = app.task(base=LockedTask, shared=False, bind=True, name="cfg.traced_fence")(fence)
    with caplog.at_level(logging.WARNING):
        assert task.apply().get() is None  # ran, unlocked: no fence
        with threads_worker(app):
            assert task.delay().get(timeout=30) is None
    assert "running unlocked" in caplog.text
    assert "after_return handler raised" not in caplog.text
    assert not [run for run in running.values() if run.task.name == task.name]


def test_an_until_executed_run_unlocked_by_a_redis_error_at_its_adopt_frees_its_enqueue_lock_as_it_ends(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_executed``, ``redislock_on_error="run"``: the run's ``ADOPT`` of its message's
    enqueue lock fails with a Redis error (Redis gone for a moment), and the body runs unlocked,
    the enqueue lock kept while it runs so that no duplicate is sent beside it. Once the run
    ended, the lock goes, as the mode says: a ``delay()`` of the same arguments is sent, not
    refused as a duplicate of a task that is over for ``lock_queue_ttl``."""
    app = new_app(redis_server.url, prefix, redislock_on_error="run")
    task = define(app, lock_mode="until_executed")

    def adopt_failing(lock: Any, token: str) -> Any:
        raise redis.exceptions.ConnectionError("Redis gone for a moment")

    monkeypatch.setattr(celery_redislock.execution, "adopt", adopt_failing)
    key = task_lock_key(task, (1,))
    with threads_worker(app, concurrency=1):
        first = task.delay(1)
        assert first.get(timeout=30) == 3
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert not client.exists(key), f"left: {client.get(key)!r}, PTTL {client.pttl(key)} ms"
        finally:
            client.delete(key)
            client.close()


def test_acl_credentials_in_the_url_are_used(prefix: str) -> None:
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command(  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            "ACL", "SETUSER", "locker", "on", ">pw", f"~{prefix}*", f"~{{{prefix}*", "+@all", "-@dangerous"
        )
        app = new_app(server.url, prefix, redislock_url=f"redis://locker:pw@127.0.0.1:{server.port}/0")
        task = define(app)
        assert task(1) == 3
        wrong = new_app(server.url, prefix, redislock_url=f"redis://locker:nope@127.0.0.1:{server.port}/0")
        with pytest.raises(RedisLockError, match=r"redis://locker:\*\*@127\.0\.0\.1"):
            define(wrong)(1)
        admin.close()


def test_one_client_per_app_per_process_and_a_fresh_one_after_fork(app: Celery) -> None:
    first, url = client_for(app)
    assert client_for(app)[0] is first and url == app.conf.redislock_url
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a client of its own, which works
        child, _ = client_for(app)
        os.write(write, b"fresh" if child is not first and child.ping() else b"shared")
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"fresh"
    os.waitpid(pid, 0)
    os.close(read)


# -- enqueue lock lifetimes: a naive eta or expires is UTC -------------------------------------


@pytest.fixture
def local_time_14_hours_ahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time zone set to UTC+14 (a POSIX TZ, no tz database needed)."""
    monkeypatch.setenv("TZ", "AHEAD-14")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_naive_eta_or_expires_is_utc_as_celery_reads_it(
    app: Celery, client: redis.Redis, prefix: str, local_time_14_hours_ahead: None
) -> None:
    """Celery's worker reads a naive ``eta``/``expires`` as UTC (``maybe_make_aware``), whatever
    the local time zone; so does the enqueue lock. In a process 14 h ahead of UTC, a naive eta
    600 s ahead gives the lock the life ``countdown=600`` gives it, and a naive ``expires`` 300 s
    ahead bounds it to 300 s; today both were read as local times 14 h in the past (no delay;
    a lock of 1 ms)."""
    assert datetime.now().hour != datetime.now(timezone.utc).hour
    task = define(app, lock_mode="until_executed", lock_queue_ttl=3600)
    utc_now = datetime.now(timezone.utc).replace(tzinfo=None)
    task.apply_async((1,), countdown=600)
    task.apply_async((2,), eta=utc_now + timedelta(seconds=600))
    task.apply_async((3,), eta=(utc_now + timedelta(seconds=600)).isoformat())
    task.apply_async((4,), expires=utc_now + timedelta(seconds=300))
    keys = [task_lock_key(task, (a,)) for a in (1, 2, 3, 4)]
    countdown, eta, eta_text, expires = (client.pttl(key) for key in keys)
    assert 4_140_000 < countdown <= 4_200_000
    assert abs(eta - countdown) < 30_000 and abs(eta_text - countdown) < 30_000
    assert 240_000 < expires <= 300_000
    client.delete(*keys, f"q-{prefix}")


# -- bad input found by a review: each refused, naming the option, at bind where it can be --


def test_a_huge_int_duration_is_refused_naming_the_option(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    with pytest.raises(LockConfigurationError) as raised:
        define(app, lock_ttl=10**400)
    assert "task 'cfg.add': lock_ttl=" in str(raised.value)
    assert nothing_under(client, prefix)


def test_lock_on_self_of_a_bound_task_is_refused_at_bind(app: Celery) -> None:
    def add(self: Any, a: int, b: int = 2) -> int:
        return a + b

    with pytest.raises(LockConfigurationError, match="'self' is not a parameter of the task"):
        app.task(base=LockedTask, shared=False, bind=True, name="cfg.add", lock_on=("self",))(add)


def test_a_cluster_url_with_a_socket_timeout_in_its_query_makes_a_client(
    redis_server: RedisServer, prefix: str
) -> None:
    # redis-py reads socket_timeout from a URL's query; a redis:// URL takes it, a cluster URL must too
    app = new_app(redis_server.url, prefix)
    app.conf.redislock_url = "redis-cluster://127.0.0.1:1?socket_timeout=3"
    try:
        with pytest.raises(redis.RedisError):  # nothing listens: a connection error, not a TypeError
            client_for(app)
    finally:
        app.close()


@pytest.mark.parametrize("url", ["sentinel://127.0.0.1:26379/locks", "sentinel://127.0.0.1:notaport"])
def test_a_bad_sentinel_url_is_refused_at_bind(redis_server: RedisServer, prefix: str, url: str) -> None:
    app = Celery("cfg", broker=redis_server.url, set_as_current=False)
    app.conf.update(
        redislock_url=url, redislock_prefix=prefix, redislock_transport_options={"master_name": "m"}
    )
    try:
        app.finalize()
        with pytest.raises(LockConfigurationError, match="redislock_url"):
            define(app)
    finally:
        app.close()


def test_a_lock_ttl_not_above_the_replica_timeout_is_refused_at_bind(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    # accepted at bind (lock_ttl >= 0.3, replica_timeout 1 s), every run then fails in RedisLock:
    # "replica_timeout must be > 0 and < ttl (1), got 1.0"
    app = new_app(redis_server.url, prefix, redislock_replicas=1)
    try:
        with pytest.raises(
            LockConfigurationError, match=r"task 'cfg\.add': lock_ttl=1 .*redislock_replica_timeout"
        ):
            define(app, lock_ttl=1)
        assert nothing_under(client, prefix)
    finally:
        app.close()


@pytest.mark.parametrize(("setting", "value"), [("redislock_replica_timeout", 0), ("redislock_prefix", "")])
def test_a_falsy_app_setting_out_of_range_is_refused_not_replaced_by_the_default(
    redis_server: RedisServer, prefix: str, setting: str, value: object
) -> None:
    app = new_app(redis_server.url, prefix, **{setting: value})
    try:
        with pytest.raises(LockConfigurationError, match=setting):
            define(app)
    finally:
        app.close()


def test_a_redislock_url_with_an_unknown_query_option_is_refused_at_bind(
    redis_server: RedisServer, client: redis.Redis, prefix: str
) -> None:
    # "sockettimeout" (for socket_timeout): redis-py's parse_url keeps it, its Connection() refuses it at
    # the first command; the task then fails with a TypeError that names neither the setting nor the task
    url = f"redis://127.0.0.1:{redis_server.port}/0?sockettimeout=3"
    app = new_app(redis_server.url, prefix, redislock_url=url)
    try:
        with pytest.raises(LockConfigurationError, match="redislock_url"):
            define(app)
        assert nothing_under(client, prefix)
    finally:
        app.close()


def test_an_unkeyable_keyword_argument_of_a_var_keyword_task_is_named(app: Celery) -> None:
    def anything(**options: Any) -> None:
        return None

    task = define(app, anything)
    with pytest.raises(LockKeyError, match="argument 'when'"):
        task.delay(when=object())


def test_the_longest_lock_queue_ttl_takes_a_countdown(app: Celery, client: redis.Redis, prefix: str) -> None:
    # lock_queue_ttl is accepted up to 365 days; the enqueue lock of a call with a countdown then lives
    # lock_queue_ttl plus the countdown, which RedisLock refuses: every such call fails, naming no option
    task = define(app, lock_mode="until_executed", lock_queue_ttl=365 * 24 * 3600)
    task.apply_async((1,), countdown=60, queue=f"idle-{prefix}")
    key = task_lock_key(task, (1,))
    assert client.pttl(key) > 0
    client.delete(key)


@pytest.mark.parametrize("on_error", ["run", "fail"])
def test_a_cluster_unreachable_at_first_use_is_a_redis_error_as_redislock_on_error_says(
    redis_server: RedisServer, prefix: str, on_error: str
) -> None:
    # RedisCluster() connects to its startup nodes when made; nothing listens at port 1
    app = new_app(
        redis_server.url, prefix, redislock_url="redis-cluster://127.0.0.1:1", redislock_on_error=on_error
    )
    try:
        task = define(app)
        if on_error == "run":
            assert task.apply((1,)).get() == 3  # runs unlocked, with a WARNING
        else:
            with pytest.raises(RedisLockError, match=re.escape("redis-cluster://127.0.0.1:1")):
                task.apply((1,)).get()
    finally:
        app.close()


@pytest.mark.parametrize("query", ["protocol=4", "ssl_cert_reqs=bogus"])
def test_a_redislock_url_whose_query_options_redis_py_refuses_is_named_at_bind(
    redis_server: RedisServer, prefix: str, query: str
) -> None:
    """As an unknown option: redis-py's connection refuses these with a Redis error."""
    scheme = "rediss" if "ssl" in query else "redis"
    app = new_app(
        redis_server.url, prefix, redislock_url=f"{scheme}://127.0.0.1:{redis_server.port}/0?{query}"
    )
    try:
        with pytest.raises(LockConfigurationError, match="redislock_url"):
            define(app)
    finally:
        app.close()
