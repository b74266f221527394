"""Bad configuration is refused when the task is bound: a task option or an app setting that is
mistyped, of the wrong type or out of range fails with ``LockConfigurationError`` naming the task
(or app), the option or setting, the value and what is allowed, and never shows a secret.
Nothing reaches Redis or the queue.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError
from celery_redislock.config import app_settings
from celery_redislock.connection import client_for
from celery_redislock.testing import RedisServer
from tests.test_task_config import define, new_app, nothing_under

SECRET = "s3cret-pw"


@pytest.fixture
def app(redis_server: RedisServer, prefix: str) -> Iterator[Celery]:
    app = new_app(redis_server.url, prefix)
    yield app
    app.close()


BAD_OPTIONS = [
    ("lock_mode", "sometimes", "allowed: 'while_executing', 'until_executing'"),
    ("lock_busy", "later", "allowed: 'skip', 'retry', 'wait', 'raise'"),
    ("lock_busy", "", "allowed: 'skip', 'retry', 'wait', 'raise'"),  # was the mode's default, silently
    ("lock_busy", 0, "allowed: 'skip', 'retry', 'wait', 'raise'"),
    ("lock_duplicate", "ignore", "allowed: 'return', 'raise'"),
    ("lock_on_lost", "panic", "allowed: 'log', 'raise', 'terminate'"),
    ("lock_ttl", 0, ">= 0.3"),
    ("lock_ttl", 0.1, ">= 0.3"),
    ("lock_ttl", -5, ">= 0.3"),
    ("lock_ttl", "30", "seconds (int/float) or a timedelta"),
    ("lock_ttl", True, "seconds (int/float) or a timedelta"),
    ("lock_ttl", float("nan"), "seconds (int/float) or a timedelta"),
    ("lock_ttl", 10**9, "<= 31536000"),
    ("lock_queue_ttl", timedelta(seconds=-1), ">= 0.001"),
    ("lock_retry_delay", -1, ">= 0.1"),
    # a busy run republished at once, its copy found the lock busy and did again: hundreds of
    # messages a second while the holder ran
    ("lock_retry_delay", 0, ">= 0.1"),
    ("lock_retry_delay", timedelta(0), ">= 0.1"),
    ("lock_retry_delay", 0.01, ">= 0.1"),
    ("lock_wait_timeout", "forever", "seconds"),
    ("lock_period", 0, ">= 0.001"),
    ("lock_on", "a", "a tuple of the task's parameter names"),
    ("lock_on", ("a", 3), "a tuple of the task's parameter names"),
    ("lock_on", ("user",), "'user' is not a parameter of the task (a, b)"),
    ("lock_on", ("a", "b "), "'b ' is not a parameter of the task (a, b)"),
    ("lock_on", 42, "a tuple of the task's parameter names"),
    ("lock_ttl", timedelta(days=400), "<= 31536000"),
    ("lock_wait_timeout", -1, ">= 0"),
    ("lock_queue_ttl", 0, ">= 0.001"),
]


def test_an_app_wide_retry_delay_below_its_floor_fails_only_the_tasks_that_retry(
    redis_server: RedisServer, prefix: str
) -> None:
    """``redislock_retry_delay=0`` makes every busy retry come back at once: a task whose
    ``lock_busy`` retries fails at bind naming it, and the others, which never read it, bind (a
    worker with one such task failed to start)."""
    app = new_app(redis_server.url, prefix, redislock_retry_delay=0)
    define(app, lock_busy="skip", name="cfg.skips")
    with pytest.raises(LockConfigurationError) as raised:
        define(app, lock_busy="retry", name="cfg.retries")
    assert "redislock_retry_delay=0 is not valid" in str(raised.value) and ">= 0.1" in str(raised.value)


@pytest.mark.parametrize(("option", "value", "allowed"), BAD_OPTIONS)
def test_a_bad_option_fails_at_bind_naming_task_option_value_and_allowed(
    app: Celery, client: redis.Redis, prefix: str, option: str, value: object, allowed: str
) -> None:
    options: dict[str, Any] = {option: value}
    if option == "lock_retry_delay":  # read by lock_busy="retry" alone
        options["lock_busy"] = "retry"
    with pytest.raises(LockConfigurationError) as raised:
        define(app, **options)
    message = str(raised.value)
    assert message.startswith("task 'cfg.add': ")
    assert f"{option}={value!r}" in message
    assert allowed in message
    assert isinstance(raised.value, ValueError)
    assert nothing_under(client, prefix)


def test_a_mistyped_option_is_refused_with_a_suggestion(app: Celery) -> None:
    with pytest.raises(
        LockConfigurationError, match="unknown task option 'lock_tll'; did you mean 'lock_ttl'"
    ):
        define(app, lock_tll=5)


def test_until_expired_needs_a_period(app: Celery) -> None:
    with pytest.raises(LockConfigurationError, match="lock_period=None is not valid; until_expired needs it"):
        define(app, lock_mode="until_expired")


@pytest.mark.parametrize(
    "mode", ["while_executing", "until_executing", "until_executed", "until_and_while_executing"]
)
def test_a_period_on_a_task_whose_mode_keeps_no_lock_after_its_runs_is_refused(
    app: Celery, client: redis.Redis, prefix: str, mode: str
) -> None:
    """``lock_period`` is how long ``until_expired`` keeps the lock after a run; on a task of
    another mode it was ignored, the task run as if it kept nothing (a once-a-day job, say, run
    as often as called)."""
    with pytest.raises(LockConfigurationError) as raised:
        define(app, lock_mode=mode, lock_period=timedelta(days=1))
    message = str(raised.value)
    assert message.startswith(f"task 'cfg.add': lock_period={timedelta(days=1)!r} is not valid; ")
    assert f"lock_mode {mode!r} keeps no lock after a run" in message and "'until_expired'" in message
    assert nothing_under(client, prefix)


def test_the_apps_period_is_the_default_of_its_until_expired_tasks_alone(
    redis_server: RedisServer, prefix: str
) -> None:
    app = new_app(redis_server.url, prefix, redislock_period=60)
    try:
        assert define(app).lock_options.period_ms == 0
        expiring = define(app, name="cfg.expiring", lock_mode="until_expired")
        assert expiring.lock_options.period_ms == 60_000
    finally:
        app.close()


@pytest.mark.parametrize(
    ("setting", "value", "culprits"),
    [
        ("redislock_url", "http://localhost", ["redislock_url='http://localhost' is not valid"]),
        ("redislock_url", 6379, ["redislock_url of type int is not valid"]),
        (
            "redislock_url",
            f"redis://:{SECRET}@127.0.0.1:notaport/0",
            ["redislock_url='redis://:**@127.0.0.1:notaport/0'", "Port could not be cast"],
        ),
        (
            "redislock_url",
            f"redis://127.0.0.1:6379/0?password={SECRET}&socket_keepalive=yes&colour=red",
            [
                "redislock_url='redis://127.0.0.1:6379/0?password=**&socket_keepalive=yes&colour=red'",
                "'colour'",
            ],
        ),
        (
            "redislock_url",
            "rediss://127.0.0.1:70000/0",
            ["redislock_url='rediss://127.0.0.1:70000/0'", "Port out of range"],
        ),
        (
            "redislock_url",
            "redis://127.0.0.1:6379/locks",
            ["redislock_url='redis://127.0.0.1:6379/locks'", "the database 'locks' is not a number"],
        ),
        # a Cluster's or a sentinel's query options were dropped unread, a typo as well
        (
            "redislock_url",
            f"redis-cluster://:{SECRET}@127.0.0.1:7000,127.0.0.1:7001?socket_timout=1",
            [
                "redislock_url='redis-cluster://:**@127.0.0.1:7000,127.0.0.1:7001?socket_timout=1'",
                "socket_timout",
            ],
        ),
        (
            "redislock_url",
            f"sentinel://:{SECRET}@127.0.0.1:26379/0?socket_timeout=1",
            ["redislock_url='sentinel://:**@127.0.0.1:26379/0?socket_timeout=1'", "takes no query options"],
        ),
        # a scheme mistyped, or another transport's: the URL was shown as given, password and all
        (
            "redislock_url",
            f"rediss+tls://user:{SECRET}@127.0.0.1:6379/0",
            ["redislock_url='rediss+tls://user:**@127.0.0.1:6379/0' is not valid", "allowed: a redis://"],
        ),
        # an '@' or a ';' in the password (redis-py reads both): only the part before it was masked
        (
            "redislock_url",
            f"redis://:pre@{SECRET}@127.0.0.1:6379/locks",
            ["redislock_url='redis://:**@127.0.0.1:6379/locks'", "'locks' is not a number"],
        ),
        (
            "redislock_url",
            f"redis://:pre;{SECRET}@127.0.0.1:6379/locks",
            ["redislock_url='redis://:**@127.0.0.1:6379/locks'", "'locks' is not a number"],
        ),
        # timeouts redis-py takes from the query, unchecked: the first apply_async raised a bare
        # ValueError ("Invalid value NaN", "Timeout value out of range") or OverflowError
        *(
            (
                "redislock_url",
                f"redis://:{SECRET}@127.0.0.1:6379/0?{query}",
                [f"redislock_url='redis://:**@127.0.0.1:6379/0?{query}'", f"{query.split('=')[0]}="],
            )
            for query in (
                "socket_timeout=nan",
                "socket_timeout=-1",
                "socket_timeout=0",
                "socket_connect_timeout=inf",
                "socket_timeout=1e400",
            )
        ),
        (
            "redislock_url",
            f"redis-cluster://:{SECRET}@127.0.0.1:7000,127.0.0.1:7001/0?socket_timeout=nan",
            ["redislock_url='redis-cluster://:**@127.0.0.1:7000,127.0.0.1:7001/0?socket_timeout=nan'"],
        ),
        # past what Redis's WAIT takes: every acquisition failed ("value is not an integer or out of range")
        (
            "redislock_replicas",
            2**63,
            [f"redislock_replicas={2**63} is not valid; allowed: an int from 0 to"],
        ),
        ("redislock_prefix", "a{b}", ["redislock_prefix='a{b}' is not valid"]),
        ("redislock_prefix", 5, ["redislock_prefix=5"]),
        # text no Redis key can hold: each failed at the first apply_async with a UnicodeError
        ("redislock_prefix", "locks\udcff", ["redislock_prefix='locks\\udcff' is not valid", "UTF-8"]),
        ("redislock_url", "redis://h\udcff:1/0", ["redislock_url='redis://h\\udcff:1/0' is not", "UTF-8"]),
        (
            "redislock_on_error",
            "ignore",
            ["redislock_on_error='ignore' is not valid; allowed: 'fail', 'run'"],
        ),
        ("redislock_busy", "never", ["redislock_busy='never' is not valid"]),
        ("redislock_on", "a", ["redislock_on='a' is not valid"]),  # was named lock_on, as if set on the task
        ("redislock_on", ("user",), ["redislock_on=('user',) is not valid", "'user' is not a parameter"]),
        ("redislock_tll", 3, ["unknown setting 'redislock_tll'; did you mean 'redislock_ttl'"]),
    ],
)
def test_bad_app_settings_fail_at_bind(
    redis_server: RedisServer, prefix: str, setting: str, value: object, culprits: list[str]
) -> None:
    # Raised where the first LockedTask is bound: by define(), or by finalize() for shared tasks.
    with pytest.raises(LockConfigurationError) as raised:
        define(new_app(redis_server.url, prefix, **{setting: value}))
    message = str(raised.value)
    for culprit in culprits:
        assert culprit in message, f"{culprit!r} not in {message!r}"
    assert SECRET not in message


@pytest.mark.parametrize(
    ("setting", "value", "culprit"),
    [
        # a URL given as bytes is refused (redis-py reads a str): it was shown with its password
        (
            "redislock_url",
            f"redis://:{SECRET}@127.0.0.1:6379/0".encode(),
            "redislock_url=b'redis://:**@127.0.0.1",
        ),
        (
            "redislock_url",
            f"redis://:{SECRET}@h\xff:1/0".encode("latin-1"),
            "redislock_url=b'redis://:**@h\\xff:1",
        ),
        # transport options that are no dict: shown as given, a sentinel's password in them
        (
            "redislock_transport_options",
            [("sentinel_kwargs", {"password": SECRET})],
            "redislock_transport_options of type list is not valid; allowed: a dict",
        ),
    ],
)
def test_a_setting_of_the_wrong_type_is_refused_without_showing_its_password(
    redis_server: RedisServer, client: redis.Redis, prefix: str, setting: str, value: object, culprit: str
) -> None:
    with pytest.raises(LockConfigurationError) as raised:
        define(new_app(redis_server.url, prefix, **{setting: value}))
    message = str(raised.value)
    assert message.startswith("app 'cfg': ")
    assert culprit in message, f"{culprit!r} not in {message!r}"
    assert SECRET not in message
    assert nothing_under(client, prefix)


@pytest.mark.parametrize(
    ("name", "allowed"),
    [("cfg.\udcff", "it must be UTF-8 text"), ("cfg.a}b", "a '}' must close a {hash tag}")],
)
def test_a_task_name_no_lock_key_can_hold_is_refused_at_bind(
    app: Celery, client: redis.Redis, prefix: str, name: str, allowed: str
) -> None:
    """A task's lock keys hold its name: one with lone surrogates failed at the first
    ``apply_async`` with a ``UnicodeEncodeError`` (after a WARNING that the enqueue lock could
    not be given back), one with a ``}`` outside a hash tag at the run with an error naming the
    lock key, not the task's name."""
    with pytest.raises(LockConfigurationError) as raised:
        define(app, name=name, lock_mode="until_executed")
    message = str(raised.value)
    assert message.startswith(f"task {name!r}: name={name!r} is not valid; ")
    assert allowed in message
    assert nothing_under(client, prefix)


@pytest.mark.parametrize(
    ("value", "got"),
    [("", "an empty one"), (b"", "an empty one"), (12345, "int"), (["k3y-in-a-list"], "list")],
)
def test_a_bad_key_secret_fails_at_bind_without_showing_it(
    redis_server: RedisServer, prefix: str, value: object, got: str
) -> None:
    """An empty or mistyped ``redislock_key_secret`` is refused at bind, naming the setting
    and the type, never the value."""
    with pytest.raises(LockConfigurationError) as raised:
        define(new_app(redis_server.url, prefix, redislock_key_secret=value))
    message = str(raised.value)
    assert message.startswith("app 'cfg': ")
    assert f"redislock_key_secret must be a non-empty str or bytes, got {got}" in message
    assert "12345" not in message and "k3y" not in message


def test_the_key_secret_is_not_in_the_settings_repr(redis_server: RedisServer, prefix: str) -> None:
    secret = f"k3y-{uuid.uuid4().hex}"
    settings = app_settings(new_app(redis_server.url, prefix, redislock_key_secret=secret))
    assert settings.key_secret == secret.encode()
    assert secret not in repr(settings)


def test_no_password_of_the_url_or_transport_options_is_in_the_settings_repr(prefix: str) -> None:
    """The settings' repr showed ``redislock_url`` as given, and ``sentinel_kwargs``, passwords and all."""
    url = f"sentinel://user:{SECRET}@127.0.0.1:26379/0"
    options = {"master_name": "m", "sentinel_kwargs": {"password": SECRET}}
    app = new_app(url, prefix, redislock_transport_options=options)
    try:
        assert SECRET not in repr(app_settings(app))
    finally:
        app.close()


def test_a_password_in_the_urls_query_is_masked_where_the_url_is_shown(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py reads a password from a URL's query too (``?password=``), where only the one
    before the host was masked: the INFO log naming where the locks are, and what
    ``celery redislock`` prints, showed it."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?username=locks&password={SECRET}&db=0"
    app = new_app(redis_server.url, prefix, redislock_url=url)
    try:
        with caplog.at_level(logging.INFO, logger="celery_redislock.connection"):
            _, where = client_for(app)  # made, not connected
        assert where == f"redis://127.0.0.1:{redis_server.port}/0?username=locks&password=**&db=0"
        assert f"locks in Redis at {where} (from redislock_url)" in caplog.text
        assert SECRET not in caplog.text
    finally:
        app.close()


@pytest.mark.parametrize("password", [f"pre@{SECRET}", f"pre;{SECRET}", f"pre@x;{SECRET}"])
def test_a_password_holding_an_at_or_a_semicolon_is_masked_whole_where_the_url_is_shown(
    prefix: str, caplog: pytest.LogCaptureFixture, password: str
) -> None:
    """redis-py reads a password up to the host's '@' (the last), a ';' and '@' in it included;
    the masking stopped at the first of either, and the INFO log naming where the locks are
    showed the rest."""
    with RedisServer() as server:
        with server.client() as admin:
            admin.config_set("requirepass", password)
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        app = new_app(url, prefix)
        try:
            with caplog.at_level(logging.INFO, logger="celery_redislock.connection"):
                client, where = client_for(app)
            assert client.ping()  # the password redis-py read is the whole of it
            assert where == f"redis://:**@127.0.0.1:{server.port}/0"
            assert f"locks in Redis at {where} (from redislock_url)" in caplog.text
            assert SECRET not in caplog.text
        finally:
            app.close()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"redis-cluster://:{SECRET}@127.0.0.1:7000,nohostport/0", "each node must be host:port"),
        (f"rediss-cluster://user:{SECRET}@127.0.0.1:7000/3", "a Redis Cluster has only db 0"),
    ],
)
def test_a_bad_cluster_url_is_refused_with_its_password_masked(
    redis_server: RedisServer, prefix: str, url: str, problem: str
) -> None:
    """A Redis Cluster URL is read when the lock client is made: its error showed the URL
    with the password."""
    app = new_app(redis_server.url, prefix, redislock_url=url)
    try:
        with pytest.raises(LockConfigurationError) as raised:
            client_for(app)
        message = str(raised.value)
        assert problem in message and ":**@127.0.0.1:7000" in message
        assert SECRET not in message
    finally:
        app.close()


def test_a_sentinel_list_with_a_url_not_a_sentinels_is_refused_with_its_passwords_masked(
    redis_server: RedisServer, prefix: str
) -> None:
    """A sentinel:// URL is read when the lock client is made: its error quoted the wrong URL
    of the list as given, its password with it."""
    url = f"sentinel://:{SECRET}@127.0.0.1:26379;redis://:{SECRET}@127.0.0.1:6379"
    options = {"master_name": "m"}
    app = new_app(redis_server.url, prefix, redislock_url=url, redislock_transport_options=options)
    try:
        with pytest.raises(LockConfigurationError) as raised:
            client_for(app)
        message = str(raised.value)
        assert "'redis://:**@127.0.0.1:6379' is not a sentinel://host:port URL" in message
        assert SECRET not in message
    finally:
        app.close()


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"sentinel_kwargs": 5}, "option sentinel_kwargs is not valid; allowed: a dict, got int"),
        ({"sentinel_kwargs": [SECRET]}, "option sentinel_kwargs is not valid; allowed: a dict, got list"),
        ({"min_other_sentinels": "x"}, "option min_other_sentinels='x' is not valid; allowed: an int"),
    ],
)
def test_a_sentinel_transport_option_of_the_wrong_type_is_named(
    redis_server: RedisServer, prefix: str, options: dict[str, Any], problem: str
) -> None:
    """Read when the lock client is made: ``sentinel_kwargs`` that is no dict raised a bare
    ``TypeError: 'int' object is not a mapping``, and a ``min_other_sentinels`` that is no int was
    blamed on the URL (``redislock_url=... is not a URL redis-py reads``)."""
    url = f"sentinel://:{SECRET}@127.0.0.1:26379"
    transport = {"master_name": "m", **options}
    app = new_app(redis_server.url, prefix, redislock_url=url, redislock_transport_options=transport)
    try:
        with pytest.raises(LockConfigurationError) as raised:
            client_for(app)
        message = str(raised.value)
        assert problem in message and "'sentinel://:**@127.0.0.1:26379'" in message
        assert SECRET not in message and "is not a URL" not in message
    finally:
        app.close()
