"""Bad input at run time fails with a clear error naming the culprit, and leaves nothing in
Redis (no key under the test's prefix) and nothing in the queue: arguments that cannot be keyed,
connection and permission errors, and the primitive's own arguments. Bad task options and app
settings, refused when the task is bound, are in ``tests/test_bad_config.py``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio
from celery import Celery

from celery_redislock import (
    AsyncRedisLock,
    AsyncRedisSemaphore,
    LockConfigurationError,
    LockedTask,
    LockKeyError,
    RedisLock,
    RedisLockError,
    RedisSemaphore,
    task_lock_key,
)
from celery_redislock import connection as connection_module
from celery_redislock.testing import RedisServer, hold
from tests import invariants
from tests.workers import threads_worker

SECRET = "s3cret-pw"
TASK_UUID = uuid.UUID("6a1f7a3e-0c1b-4c9e-9f55-3d2b8e1d4c21")


@dataclass
class Env:
    server: RedisServer
    prefix: str
    apps: list[Celery] = field(default_factory=list)
    users: list[str] = field(default_factory=list)

    @property
    def queue(self) -> str:
        return f"q-{self.prefix}"

    def app(self, **conf: Any) -> Celery:
        app = Celery("bad", broker=self.server.url, backend=self.server.url, set_as_current=False)
        app.conf.update(
            {
                "redislock_url": self.server.url,
                "redislock_prefix": self.prefix,
                "task_default_queue": self.queue,
                **conf,
            }
        )
        app.finalize()  # tasks defined from now on are bound (and their options checked) at once
        self.apps.append(app)
        return app

    def task(self, app: Celery | None = None, **options: Any) -> Any:
        """``bad.add(a, b=2)``, locked at enqueue (``until_executed``) unless told otherwise."""

        def add(a: Any, b: Any = 2) -> Any:
            return a

        options = {"lock_mode": "until_executed", **options}
        target: Any = app or self.app()
        return target.task(base=LockedTask, shared=False, name="bad.add", **options)(add)

    def url_for(self, *rules: str) -> str:
        """A URL logging in as a new ACL user (password ``SECRET``) with ``rules``."""
        name = f"u{uuid.uuid4().hex[:8]}"
        admin = self.server.client()
        admin.execute_command("ACL", "SETUSER", name, "on", f">{SECRET}", *rules)  # type: ignore[no-untyped-call]
        admin.close()
        self.users.append(name)
        return f"redis://{name}:{SECRET}@127.0.0.1:{self.server.port}/0"

    def close(self) -> None:
        for app in self.apps:
            app.close()
        if self.users:
            admin = self.server.client()
            admin.acl_deluser(*self.users)
            admin.close()


@pytest.fixture
def env(redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    monkeypatch.setattr(connection_module, "SOCKET_TIMEOUT", 0.5)  # a TLS handshake with a plain server
    env = Env(redis_server, prefix)
    yield env
    env.close()


def deeply_nested(depth: int = 100_000) -> list[Any]:
    top: list[Any] = []
    inner = top
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return top


def async_client(env: Env) -> redis.asyncio.Redis:
    """An asyncio client of the test's server (not connected: the constructors send nothing)."""
    return redis.asyncio.Redis(host="127.0.0.1", port=env.server.port)


def redlock_of(env: Env, query: str) -> RedisLock:
    """A Redlock of the test's server, by a URL with a password and ``query``, and of db 1 there."""
    url = env.server.url.replace("redis://", f"redis://:{SECRET}@")
    return RedisLock([f"{url}?{query}", env.server.url.replace("/0", "/1")], f"{env.prefix}:k")


def raising_lock_on(a: Any, b: Any = 2) -> Any:
    raise KeyError("tenant")


Action = Callable[[Env], object]

CASES = [
    # -- arguments that cannot be keyed, refused at apply_async before anything is sent
    pytest.param(
        lambda env: env.task().delay(object()),
        LockKeyError,
        ["task 'bad.add'", "argument 'a'", "cannot be encoded by Celery's JSON serializer"],
        id="argument-an-object",
    ),
    pytest.param(
        lambda env: env.task().delay({"tags": {1, 2}}),
        LockKeyError,
        ["argument 'a'", "set is not JSON serializable"],
        id="argument-with-a-set-inside",
    ),
    pytest.param(
        lambda env: env.task().delay(1, deeply_nested()),
        LockKeyError,
        ["argument 'b'", "recursion"],
        id="argument-nested-too-deeply",
    ),
    pytest.param(
        lambda env: env.task().delay(1, [{"__type__": "datetime", "__value__": "2026-01-02T03:04:05"}]),
        LockKeyError,
        ["argument 'b'", "shaped like kombu's JSON envelope", "delivers as another type"],
        id="argument-shaped-like-a-kombu-envelope",
    ),
    pytest.param(
        lambda env: env.task().delay(1, 2, 3),
        LockKeyError,
        ["argument '*'", "too many positional arguments"],
        id="too-many-arguments",
    ),
    pytest.param(
        lambda env: env.task().delay(),
        LockKeyError,
        ["argument '*'", "missing a required argument: 'a'"],
        id="missing-argument",
    ),
    pytest.param(  # keyed as the arguments "a" and "b", the lock taken; Celery's send then refused it
        lambda env: env.task().apply_async("ab"),
        LockKeyError,
        ["task 'bad.add'", "argument '*'", "args must be a list or tuple, got str"],
        id="args-a-string",
    ),
    pytest.param(  # was TypeError: object of type 'int' has no len()
        lambda env: env.task().apply_async(1),
        LockKeyError,
        ["task 'bad.add'", "argument '*'", "args must be a list or tuple, got int"],
        id="args-an-int",
    ),
    pytest.param(
        lambda env: env.task().apply_async((1,), [("b", 3)]),
        LockKeyError,
        ["task 'bad.add'", "argument '*'", "kwargs must be a mapping, got list"],
        id="kwargs-a-list",
    ),
    pytest.param(
        lambda env: env.task().delay(1, bb=3),
        LockKeyError,
        ["argument '*'", "unexpected keyword argument 'bb'"],
        id="misspelled-keyword",
    ),
    pytest.param(
        lambda env: env.task(lock_on=raising_lock_on).delay(1),
        LockKeyError,
        ["argument 'lock_on'", "raised KeyError('tenant')"],
        id="lock-on-callable-raises",
    ),
    pytest.param(
        lambda env: env.task(lock_on=lambda a, b=2: object()).delay(1),
        LockKeyError,
        ["argument 'lock_on'", "cannot be encoded"],
        id="lock-on-callable-returns-an-object",
    ),
    pytest.param(
        lambda env: env.task(lock_on=lambda a: a).delay(1, b=3),
        LockKeyError,
        ["argument 'lock_on'", "unexpected keyword argument 'b'"],
        id="lock-on-callable-with-another-signature",
    ),
    # -- a task id that is no str: apply() ran the task, which failed with "TypeError:
    # quote_from_bytes() expected bytes" as its holder was written (apply_async refused it)
    pytest.param(
        lambda env: env.task().apply((1,), task_id=TASK_UUID),
        LockConfigurationError,
        ["task 'bad.add'", f"task_id={TASK_UUID!r} is not valid; allowed: a str"],
        id="apply-task-id-a-uuid",
    ),
    pytest.param(
        lambda env: env.task().signature((1,), task_id=TASK_UUID).apply(),
        LockConfigurationError,
        ["task 'bad.add'", f"task_id={TASK_UUID!r} is not valid; allowed: a str"],
        id="signature-apply-task-id-a-uuid",
    ),
    pytest.param(
        lambda env: env.task().signature((1,)).apply_async(task_id=TASK_UUID),
        LockConfigurationError,
        ["task 'bad.add'", f"task_id={TASK_UUID!r} is not valid; allowed: a str"],
        id="signature-apply-async-task-id-a-uuid",
    ),
    pytest.param(  # a bare UnicodeEncodeError, naming neither the task nor the task id
        lambda env: env.task().apply_async((1,), task_id="run\udcff"),
        LockConfigurationError,
        ["task 'bad.add'", "task_id='run\\udcff' is not valid; allowed: a str of UTF-8 text"],
        id="apply-async-task-id-a-lone-surrogate",
    ),
    pytest.param(  # ran the task, which failed with a UnicodeEncodeError as its holder was written
        lambda env: env.task().apply((1,), task_id="run\udcff"),
        LockConfigurationError,
        ["task 'bad.add'", "task_id='run\\udcff' is not valid; allowed: a str of UTF-8 text"],
        id="apply-task-id-a-lone-surrogate",
    ),
    pytest.param(  # TypeError: quote_from_bytes() expected bytes
        lambda env: hold(env.task(), (1,), task_id=TASK_UUID).__enter__(),  # type: ignore[arg-type]
        LockConfigurationError,
        ["task 'bad.add'", f"task_id={TASK_UUID!r} is not valid; allowed: a str"],
        id="hold-task-id-a-uuid",
    ),
    pytest.param(
        lambda env: hold(env.task(), (1,), task_id="run\udcff").__enter__(),
        LockConfigurationError,
        ["task 'bad.add'", "task_id='run\\udcff' is not valid; allowed: a str of UTF-8 text"],
        id="hold-task-id-a-lone-surrogate",
    ),
    # -- connections and permissions, refused at apply_async (redislock_on_error="fail")
    pytest.param(
        lambda env: env.task(
            env.app(redislock_url=env.url_for("~*", "+@all").replace(SECRET, "wrong"))
        ).delay(1),
        RedisLockError,
        ["task 'bad.add'", ":**@127.0.0.1", "invalid username-password pair"],
        id="wrong-password",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url=f"redis://nobody:{SECRET}@{env.server.url[8:]}")).delay(1),
        RedisLockError,
        ["redis://nobody:**@127.0.0.1", "invalid username-password pair"],
        id="unknown-user",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url="unix:///nonexistent/redis.sock")).delay(1),
        RedisLockError,
        ["unix:///nonexistent/redis.sock", "No such file or directory"],
        id="unix-socket-missing",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url=env.server.url.replace("redis:", "rediss:"))).delay(1),
        RedisLockError,
        ["rediss://127.0.0.1", "Timeout connecting to server"],
        id="tls-url-for-a-plain-server",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url=env.server.url.replace("/0", "/99"))).delay(1),
        RedisLockError,
        ["/99", "DB index is out of range"],
        id="database-out-of-range",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url=env.url_for("~*", "+@all", "-evalsha"))).delay(1),
        RedisLockError,
        [":**@127.0.0.1", "'evalsha' command"],
        id="acl-without-evalsha",
    ),
    pytest.param(
        lambda env: env.task(env.app(redislock_url=env.url_for("~other:*", "+@all"))).delay(1),
        RedisLockError,
        [":**@127.0.0.1", "no permissions to access one of the keys"],
        id="acl-without-the-prefix-keys",
    ),
    # -- the primitive's own arguments
    pytest.param(
        lambda env: RedisLock(env.server.client(), b"\xffname"),
        LockConfigurationError,
        ["name must be UTF-8", "b'\\xffname'"],
        id="lock-name-not-utf8",
    ),
    pytest.param(  # a str no Redis key can hold: it failed at acquire with UnicodeEncodeError
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k\udcff").acquire(),
        LockConfigurationError,
        ["name must be UTF-8", "'{prefix}:k\\udcff'"],
        id="lock-name-a-lone-surrogate",
    ),
    pytest.param(  # each server refused it: acquire() returned False (blocking: tried forever)
        lambda env: RedisLock([env.server.client()], f"{env.prefix}:k\udcff").acquire(blocking=False),
        LockConfigurationError,
        ["name must be UTF-8", "'{prefix}:k\\udcff'"],
        id="redlock-name-a-lone-surrogate",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k", holder="w\udcff").acquire(),
        LockConfigurationError,
        ["holder must be UTF-8", "'w\\udcff'"],
        id="lock-holder-a-lone-surrogate",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:a}}b"),
        LockConfigurationError,
        ["name '{prefix}:a}b'", "has a '}' but no hash tag"],
        id="lock-name-with-an-unmatched-brace",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k", ttl="30"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["ttl must be a number of seconds or a timedelta, got '30'"],
        id="lock-ttl-a-string",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k").acquire(blocking=False, timeout=1),
        LockConfigurationError,
        ["timeout cannot be given with blocking=False"],
        id="lock-timeout-without-blocking",
    ),
    # a flag given as a str ("no", "false"): taken as True
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k", fair="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["fair must be True or False, got 'no'"],
        id="lock-fair-a-string",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k", watchdog="false"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["watchdog must be True or False, got 'false'"],
        id="lock-watchdog-a-string",
    ),
    pytest.param(
        lambda env: RedisLock([env.server.client()], f"{env.prefix}:k", fair="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["fair must be True or False, got 'no'"],
        id="redlock-fair-a-string",
    ),
    pytest.param(
        lambda env: RedisSemaphore(env.server.client(), f"{env.prefix}:k", 2, fair="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["fair must be True or False, got 'no'"],
        id="semaphore-fair-a-string",
    ),
    pytest.param(
        lambda env: AsyncRedisLock(async_client(env), f"{env.prefix}:k", watchdog="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["watchdog must be True or False, got 'no'"],
        id="async-lock-watchdog-a-string",
    ),
    pytest.param(
        lambda env: AsyncRedisSemaphore(async_client(env), f"{env.prefix}:k", 2, fair="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["fair must be True or False, got 'no'"],
        id="async-semaphore-fair-a-string",
    ),
    pytest.param(  # it waited for the lock: held, and left in Redis
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k").acquire(blocking="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["blocking must be True or False, got 'no'"],
        id="lock-blocking-a-string",
    ),
    pytest.param(
        lambda env: RedisSemaphore(env.server.client(), f"{env.prefix}:k", 2).acquire(blocking="no"),  # type: ignore[arg-type]
        LockConfigurationError,
        ["blocking must be True or False, got 'no'"],
        id="semaphore-blocking-a-string",
    ),
    pytest.param(  # it took the enqueue lock and sent the message
        lambda env: env.task().apply_async((1,), lock_in_canvas="no"),
        LockConfigurationError,
        ["task 'bad.add'", "lock_in_canvas='no' is not valid; allowed: True or False"],
        id="lock-in-canvas-a-string",
    ),
    # a Redlock's URL that redis-py takes, and whose first connection fails (an app's redislock_url
    # is checked so when the task is bound)
    pytest.param(  # TypeError: AbstractConnection.__init__() got an unexpected keyword argument
        lambda env: redlock_of(env, "colour=red").acquire(blocking=False),
        LockConfigurationError,
        ["client: bad Redis URL 'redis://:**@127.0.0.1", "?colour=red'", "'colour'"],
        id="redlock-url-an-unknown-option",
    ),
    pytest.param(  # ValueError: Timeout value out of range
        lambda env: redlock_of(env, "socket_timeout=-1").acquire(blocking=False),
        LockConfigurationError,
        ["client: bad Redis URL 'redis://:**@127.0.0.1", "socket_timeout=-1.0 must be > 0"],
        id="redlock-url-a-timeout-out-of-range",
    ),
    pytest.param(  # the server counted as refusing, each time: False, or a blocking acquire forever
        lambda env: redlock_of(env, "protocol=4").acquire(blocking=False),
        LockConfigurationError,
        ["client: bad Redis URL 'redis://:**@127.0.0.1", "?protocol=4'", "protocol"],
        id="redlock-url-a-protocol-redis-py-refuses",
    ),
    pytest.param(  # past what Redis's WAIT takes: a bare ResponseError at each acquire
        lambda env: RedisLock(env.server.client(), f"{env.prefix}:k", replicas=2**63).acquire(),
        LockConfigurationError,
        [f"replicas must be an int from 0 to {2**63 - 1}, got {2**63}"],
        id="lock-replicas-out-of-range",
    ),
    pytest.param(
        lambda env: RedisLock(env.server.url, f"{env.prefix}:k"),
        LockConfigurationError,
        ["client must be a redis.Redis or redis.cluster.RedisCluster, got str"],
        id="lock-client-a-url",
    ),
]


@pytest.mark.parametrize(("action", "error", "culprits"), CASES)
def test_bad_input_fails_clearly_and_leaves_nothing(
    env: Env, action: Action, error: type[Exception], culprits: list[str]
) -> None:
    with pytest.raises(error) as raised:
        action(env)
    message = str(raised.value)
    for culprit in culprits:
        assert culprit.replace("{prefix}", env.prefix) in message, f"{culprit!r} not in {message!r}"
    assert SECRET not in message
    client = env.server.client()
    assert invariants.keys_of(client, env.prefix) == []
    assert client.llen(env.queue) == 0  # nothing was sent
    client.close()


def test_there_are_at_least_20_cases() -> None:
    assert len(CASES) >= 20


def test_a_huge_argument_locks_a_key_of_fixed_size(env: Env) -> None:
    """Not bad input: a 20 MB argument is keyed by its digest, the key stays short."""
    task = env.task()
    huge = "x" * 20_000_000
    key = task_lock_key(task, (huge,))
    assert re.fullmatch(rf"{env.prefix}:bad\.add:[0-9a-f]{{64}}", key)
    result = task.delay(huge)
    client = env.server.client()
    value = client.get(key)
    assert value is not None and len(value) < 200 and client.llen(env.queue) == 1
    assert task.delay(huge).id == result.id  # a duplicate, found by the same short key
    client.delete(key, env.queue)
    client.close()


def test_non_utf8_bytes_and_lone_surrogates_are_keyed_consistently(env: Env) -> None:
    """Not bad input either: Celery's JSON serializer carries them, so they lock a key of their own."""
    task = env.task()
    keys = {task_lock_key(task, (value,)) for value in (b"\xff\xfe", "\udcff", b"\xfe\xff", "\udcfe")}
    assert len(keys) == 4
    client = env.server.client()
    result = task.delay(b"\xff\xfe")
    assert task.delay(b"\xff\xfe").id == result.id
    client.delete(*keys, env.queue)
    client.close()


def test_redis_errors_name_the_url_but_not_its_password(env: Env) -> None:
    """``redislock_on_error="run"`` logs the same message and sends the task unlocked."""
    url = env.url_for("~*", "+@all").replace(SECRET, "wrong")
    task = env.task(env.app(redislock_url=url, redislock_on_error="run"))
    # ignore_result: no result subscription, whose AsyncResult, collected once the session's server
    # had stopped, failed to unsubscribe (an unraisable exception that failed the pytest run)
    task.apply_async((1,), ignore_result=True)
    client = env.server.client()
    assert client.llen(env.queue) == 1
    assert invariants.keys_of(client, env.prefix) == []
    client.delete(env.queue)
    client.close()


@pytest.mark.parametrize("mode", ["while_executing", "until_executed"])
def test_a_message_whose_task_id_is_no_str_fails_its_run_naming_it(env: Env, mode: str) -> None:
    """``send_task`` sends the ``task_id`` it is given (no ``apply_async`` checks it), which kombu
    delivers as a ``uuid.UUID``: the run failed with ``TypeError: quote_from_bytes() expected
    bytes`` as its holder was written. It fails naming the task and the id, nothing taken."""
    task = env.task(lock_mode=mode)
    with threads_worker(task.app, concurrency=1):
        result = task.app.send_task("bad.add", (1,), task_id=TASK_UUID)
        with pytest.raises(LockConfigurationError) as raised:
            result.get(timeout=30)
    assert f"task 'bad.add': task_id={TASK_UUID!r} is not valid; allowed: a str" in str(raised.value)
    client = env.server.client()
    assert invariants.keys_of(client, env.prefix) == []
    client.close()


def test_a_message_whose_task_id_is_no_str_runs_where_locking_is_off(env: Env) -> None:
    """With ``redislock_enabled=False`` no holder names the task id: such a message runs, as it
    did before the package checked task ids (a worker with locking off changes nothing)."""
    app = env.app(redislock_enabled=False)
    env.task(app)
    with threads_worker(app, concurrency=1):
        task_id = uuid.uuid4()  # not TASK_UUID, whose failed result another test may have stored
        result = app.send_task("bad.add", (1,), task_id=task_id)  # type: ignore[arg-type]  # as a caller may
        assert result.get(timeout=30) == 1
