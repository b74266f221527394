"""Task options and app settings: resolved once, validated, frozen; and the key a run locks
under them (``run_key``).

A task's option ``lock_<x>`` comes from the task attribute (``@app.task(lock_<x>=...)``,
a subclass, or ``task_annotations``), else from the app setting
``redislock_<x>``, else from the default below. ``None`` means "not set" at
the first two levels. Every value is checked when the task is bound to its
app; a bad one raises ``LockConfigurationError`` naming the task, the option
(or setting), the value and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.cluster
from celery import states

from ._durations import seconds, to_ms
from ._permit_scripts import MAX_LIMIT
from ._urls import cluster_parts, listed, masked, url_problem
from .attempt import MAX_REPLICAS, MAX_TTL, MIN_WATCHDOG_TTL, companion_key, is_replica_count, is_utf8
from .exceptions import LockConfigurationError
from .keys import LockOn, call_digest, lock_key
from .modes import MODE_RULES, UNLOCKED, ModeRules
from .protocol import REPUBLISH, received_arguments
from .semaphore import permit_limit

__all__ = [
    "APP_SETTINGS",
    "MODES",
    "TASK_OPTIONS",
    "AppSettings",
    "LockOptions",
    "app_settings",
    "call_headers",
    "check_call_options",
    "check_client",
    "check_task_id",
    "run_key",
    "task_options",
]

MODES = tuple(MODE_RULES)
BUSY = ("skip", "retry", "wait", "raise", "reject")
DUPLICATE = ("return", "raise", "replace")
ON_LOST = ("log", "raise", "terminate")
ON_ERROR = ("fail", "run")
#: ``redislock_spans``: a run's lock steps as events of the recording span (if any; a release
#: that simply freed the lock notes none), as spans (children of that span, or roots), or not traced
SPANS = ("auto", "always", "never")
#: ``LockedTask``'s attributes holding what the ``lock_*`` options resolve to: not options.
RESOLVED = frozenset({"lock_options", "lock_settings"})


def bound_options(task: object) -> LockOptions | None:
    """``task``'s resolved lock options if it is a ``LockedTask`` bound to an app, else ``None``."""
    options = getattr(task, "lock_options", None)
    return options if isinstance(options, LockOptions) else None


URL_SCHEMES = ("redis", "rediss", "unix", "sentinel", "redis-cluster", "rediss-cluster")


#: Option name (without ``lock_``) -> library default; ``lock_busy`` and
#: ``lock_wait_timeout`` have defaults that depend on other options.
TASK_OPTIONS: Mapping[str, Any] = {
    "mode": "while_executing",
    "on": None,
    "ttl": 30.0,
    "busy": None,
    "duplicate": "return",
    "queue_ttl": 3600.0,
    "period": None,
    "retry_delay": 5.0,
    "wait_timeout": None,
    "on_lost": "log",
    "beat": False,
    "limit": 1,
}
APP_SETTINGS: Mapping[str, Any] = {
    "url": None,
    "prefix": "redislock",
    "on_error": "fail",
    "beat_leader": False,
    "beat_leader_ttl": 30.0,
    "transport_options": None,
    "replicas": 0,
    "replica_timeout": 1.0,
    "key_secret": None,
    "enabled": True,
    "client": None,
    "skip_state": None,
    "spans": "auto",
}
#: Shortest ``lock_retry_delay`` (seconds): with none, a busy run's message came back at once,
#: found the lock busy again and was republished again, hundreds of times a second.
MIN_RETRY_DELAY = 0.1
#: What ``redislock_client`` is, or its callable returns: a client of one server (a Sentinel
#: primary's too) or of a Cluster, whose connection pool redis-py resets in a forked child.
CLIENT_TYPES = (redis.Redis, redis.cluster.RedisCluster)


@dataclass(frozen=True)
class LockOptions:
    """A task's resolved lock options (durations in seconds)."""

    mode: str
    on: LockOn
    ttl: float
    busy: str
    duplicate: str
    queue_ttl: float
    period: float | None
    retry_delay: float
    wait_timeout: float
    on_lost: str
    #: run once per schedule slot when sent by beat (see ``celery_redislock.beat``)
    beat: bool
    #: what ``mode`` takes, keeps and frees (``MODE_RULES[mode]``; ``UNLOCKED`` when the app's
    #: ``redislock_enabled`` is ``False``)
    rules: ModeRules
    #: how many runs of one key may run at once, each holding a permit (``semaphore``); 1: the lock
    limit: int = 1

    @property
    def period_ms(self) -> int:
        """``lock_period`` in ms where the mode keeps the lock that long after a run; else 0."""
        return to_ms(self.period) if self.rules.settles and self.period is not None else 0


@dataclass(frozen=True)
class AppSettings:
    """An app's ``redislock_*`` settings; ``url`` is ``None`` until resolved from the broker URL."""

    #: never shown (nor ``transport_options``): it may hold a password
    url: str | None = field(repr=False)
    prefix: str
    on_error: str
    #: beat processes elect a leader that alone sends, holding its lock for ``beat_leader_ttl`` s
    beat_leader: bool
    beat_leader_ttl: float
    #: for a sentinel:// URL: ``master_name`` etc. (None: ``broker_transport_options``)
    transport_options: Mapping[str, Any] | None = field(default=None, repr=False)
    #: replicas that must acknowledge an acquisition (``WAIT``), and how long to wait for them
    replicas: int = 0
    replica_timeout: float = 1.0
    #: HMAC-SHA-256 key of the digests in lock keys (None: plain SHA-256); never shown
    key_secret: bytes | None = field(default=None, repr=False)
    #: ``False``: no lock is taken, nothing connects to Redis (``redislock_enabled``)
    enabled: bool = True
    #: a redis-py client, or a callable ``(app) -> client``, used instead of a URL (``redislock_client``)
    client: Any = field(default=None, repr=False)
    #: the result state a skipped run records (``None``: ``SUCCESS`` with ``None``, as a return)
    skip_state: str | None = None
    #: how a run's lock steps are traced (``SPANS``, ``celery_redislock.telemetry``)
    spans: str = "auto"

    @property
    def replication(self) -> dict[str, Any]:
        """The ``RedisLock`` arguments that ask for replica acknowledgements."""
        return {"replicas": self.replicas, "replica_timeout": self.replica_timeout} if self.replicas else {}


#: The ``lock_*`` options a call (``apply_async``) takes: ``lock_in_canvas``, and those the package
#: sends itself, a beat entry's ``lock_beat`` (``beat.OPTION``) and a busy retry's ``REPUBLISH``.
CALL_OPTIONS = frozenset({"lock_in_canvas", "lock_beat", REPUBLISH})


def check_task_id(task: Any, task_id: object) -> str | None:
    """``task_id``, or ``LockConfigurationError`` naming one that no lock's holder can name:
    neither ``None`` nor a str, or not UTF-8 text."""
    if task_id is None or (type(task_id) is str and task_id.isascii()):  # every run's: the common case
        return task_id
    if not isinstance(task_id, str) or not is_utf8(task_id):
        allowed = "allowed: a str" + (" of UTF-8 text" if isinstance(task_id, str) else "")
        raise LockConfigurationError(f"task {task.name!r}: task_id={task_id!r} is not valid; {allowed}")
    return task_id


def check_call_options(task: Any, task_id: object, options: Mapping[str, Any]) -> None:
    """``LockConfigurationError`` naming a ``task_id`` a holder cannot name (``check_task_id``), a
    ``lock_in_canvas`` that is no bool, or a ``lock_*`` option of a call that no call takes (a
    task option, or a misspelt one), which Celery would send among the message's properties,
    unread."""
    check_task_id(task, task_id)
    in_canvas = options.get("lock_in_canvas", False)
    if isinstance(in_canvas, (str, bytes)):  # a "no" would opt in
        raise LockConfigurationError(
            f"task {task.name!r}: lock_in_canvas={in_canvas!r} is not valid; allowed: True or False"
        )
    for option, value in options.items():
        if option.startswith("lock_") and option not in CALL_OPTIONS:
            raise LockConfigurationError(
                f"task {task.name!r}: {option}={value!r} is not an option of apply_async; of the lock "
                "options, a call takes lock_in_canvas (the others are the task's, @app.task(lock_...=...))"
            )


def call_headers(task: Any, headers: Any) -> dict[str, Any]:
    """A call's ``headers`` as a dict of its own (the enqueue lock's ticket joins it), or
    ``LockConfigurationError`` naming what ``dict()`` does not take."""
    try:
        return dict(headers or {})
    except (TypeError, ValueError) as exc:
        raise LockConfigurationError(
            f"task {task.name!r}: headers={headers!r} is not valid; allowed: a dict ({exc})"
        ) from None


def run_key(
    task: Any,
    options: LockOptions,
    settings: AppSettings,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    sent: Mapping[str, Any] | None = None,
) -> str:
    """The key the run of ``task`` (its lock ``options``, its app's ``settings``) with ``args`` and
    ``kwargs`` locks (``task_lock_key``); ``sent``: the options of a message sent with these
    arguments (``{}``: the task's), else they are the run's own. ``LockKeyError`` names what
    cannot be keyed."""
    dump = getattr(task, "_dump_pydantic_arguments", None)  # pydantic=True (Celery >= 5.7)
    if dump is not None:  # the models Celery sends as dicts, which the worker's run receives
        args, kwargs = dump(args, kwargs)
    if sent is not None and callable(options.on):  # called with what the worker's run will be
        args, kwargs = received_arguments(task, args, kwargs, sent)
    digest = call_digest(task.name, task.run, args, kwargs, options.on, settings.key_secret)
    return lock_key(settings.prefix, task.name, digest)


class _Problem:
    """Builds ``LockConfigurationError`` messages for one task or app."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, option: str, value: object, allowed: str) -> LockConfigurationError:
        return LockConfigurationError(f"{self.where}: {option}={value!r} is not valid; {allowed}")

    def of_type(self, option: str, value: object, allowed: str) -> LockConfigurationError:
        """The error for a setting whose value may hold a password: named by its type alone."""
        kind = type(value).__name__
        return LockConfigurationError(f"{self.where}: {option} of type {kind} is not valid; {allowed}")


def _choice(problem: _Problem, option: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise problem(option, value, "allowed: " + ", ".join(repr(item) for item in allowed))
    return str(value)


def _flag(problem: _Problem, option: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise problem(option, value, "allowed: True or False")
    return value


def _duration(problem: _Problem, option: str, value: object, low: float, high: float = MAX_TTL) -> float:
    allowed = f"allowed: seconds (int/float) or a timedelta, >= {low:g} and <= {high:.0f}"
    try:
        result = seconds(value, option)
    except LockConfigurationError:
        raise problem(option, value, allowed) from None
    if not low <= result <= high:
        raise problem(option, value, allowed)
    return result


def _limit(problem: _Problem, option: str, value: object, mode: str, replicated: bool) -> int:
    """``lock_limit``: above 1 only in the modes where the runs hold a lock of their own, and
    without ``redislock_replicas`` (a permit is not confirmed by replicas)."""
    try:
        limit = permit_limit(value)
    except LockConfigurationError:
        raise problem(option, value, f"allowed: an int from 1 to {MAX_LIMIT}") from None
    limited = [name for name, rules in MODE_RULES.items() if rules.execution_lock and not rules.adopts_ticket]
    if limit > 1 and mode not in limited:
        needs = " or ".join(repr(name) for name in limited)
        raise problem(option, limit, f"above 1 it needs lock_mode {needs} (a lock the runs alone hold)")
    if limit > 1 and replicated:
        raise problem(
            option, limit, "above 1 it cannot be used with redislock_replicas (permits are not confirmed)"
        )
    return limit


def _lock_on(problem: _Problem, option: str, value: object, run: Callable[..., Any]) -> LockOn:
    if value is None or callable(value):
        return value
    allowed = "allowed: None, a tuple of the task's parameter names, or a callable"
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise problem(option, value, allowed)
    names = tuple(value)
    if not all(isinstance(name, str) for name in names):
        raise problem(option, value, allowed)
    try:
        parameters = inspect.signature(run).parameters
    except (TypeError, ValueError):  # a run() without a signature: checked at call time
        return names
    unknown = [name for name in names if name not in parameters]
    if unknown:
        listed = ", ".join(parameters)
        raise problem(option, value, f"{unknown[0]!r} is not a parameter of the task ({listed})")
    return names


def _bound_run(task: type[Any]) -> Callable[..., Any]:
    """``task.run`` as an instance calls it: a plain function on the class is a method, whose
    first parameter (``self``, the task) is no argument of a call."""
    run = inspect.getattr_static(task, "run", None)
    return functools.partial(run, None) if inspect.isfunction(run) else task.run


def _unknown(problem: _Problem, kind: str, name: str, known: list[str]) -> LockConfigurationError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
    return LockConfigurationError(f"{problem.where}: unknown {kind} {name!r}{hint}")


def _check_url(problem: _Problem, url: object) -> None:
    """``redislock_url`` as redis-py will read it, or an error showing it with its password masked."""
    allowed = (
        "allowed: a redis://, rediss://, unix://, redis-cluster://, rediss-cluster:// or sentinel:// URL"
    )
    if isinstance(url, bytes):  # redis-py reads a str; the bytes shown, their password masked
        raise problem("redislock_url", masked(url.decode("latin-1")).encode("latin-1"), f"{allowed} (a str)")
    if not isinstance(url, str):  # a list of URLs, say: their passwords with them
        raise problem.of_type("redislock_url", url, allowed)
    scheme = url.partition("://")[0]
    if scheme not in URL_SCHEMES:  # a mistyped scheme may hold a password too
        raise problem("redislock_url", masked(url), allowed)
    if not is_utf8(url):
        raise problem("redislock_url", masked(url), f"{allowed}, of UTF-8 text")
    shown = masked(url)
    if scheme == "sentinel":
        for part in listed(url):
            try:
                sentinel = urlsplit(part.strip())
                sentinel.port  # noqa: B018  (raises for a bad port)
            except ValueError as exc:
                raise problem("redislock_url", shown, f"{allowed}: {exc}") from None
            if sentinel.query:  # they would go unread
                options = "a sentinel:// URL takes no query options (redislock_transport_options does)"
                raise problem("redislock_url", shown, f"{allowed}: {options}")
            db = sentinel.path.strip("/")
            if db and not db.isdigit():
                raise problem("redislock_url", shown, f"{allowed}: the database {db!r} is not a number")
        return
    if scheme in ("redis-cluster", "rediss-cluster"):  # its nodes: read by connection.redis_client
        url = cluster_parts(url)[0]  # what redis-py reads of the rest: as for one server
    unusable = url_problem(url)
    if unusable is not None:
        raise problem("redislock_url", shown, f"{allowed}: {unusable}")


def _key_secret(problem: _Problem, value: object) -> bytes | None:
    """``redislock_key_secret`` as bytes; an error names the setting, never the value."""
    if value is None:
        return None
    if not isinstance(value, (str, bytes)) or not value:
        kind = "an empty one" if isinstance(value, (str, bytes)) else type(value).__name__
        raise LockConfigurationError(
            f"{problem.where}: redislock_key_secret must be a non-empty str or bytes, got {kind}"
        )
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value


def _enabled(problem: _Problem, app: Any) -> bool:
    value = app.conf.get("redislock_enabled")
    return _flag(problem, "redislock_enabled", APP_SETTINGS["enabled"] if value is None else value)


def check_client(where: str, client: object, what: str, *, callable_allowed: bool) -> None:
    """Raise ``LockConfigurationError`` naming ``what`` unless ``client`` is one the locks can use
    (``callable_allowed``: the error lists a callable among what ``what`` may be).

    The error names the type of a wrong value, never the value (it may hold a password).
    """
    if not isinstance(client, CLIENT_TYPES):
        allowed = "a redis.Redis (a Sentinel primary's too) or redis.cluster.RedisCluster client"
        allowed += ", or a callable (app) -> client" if callable_allowed else ""
        kind = f"{type(client).__module__}.{type(client).__qualname__}"
        raise LockConfigurationError(f"{where}: {what} is a {kind}; allowed: {allowed}")
    if isinstance(client, redis.Redis) and client.connection is not None:
        raise LockConfigurationError(
            f"{where}: {what} is a single_connection_client, whose one connection the watchdog "
            "thread and forked pool children would share; give a client with a connection pool"
        )


def _client(problem: _Problem, app: Any) -> Any:
    """``redislock_client``: a client (checked now), a callable (its client is checked when
    called, in ``connection.client_for``), or ``None``; never together with ``redislock_url``."""
    client = app.conf.get("redislock_client")
    if client is None:
        return None
    if app.conf.get("redislock_url") is not None:
        raise LockConfigurationError(
            f"{problem.where}: redislock_url and redislock_client are both set; set one of them"
        )
    if not callable(client):
        check_client(problem.where, client, "redislock_client", callable_allowed=True)
    return client


#: Celery's own states, which a skip state must not be.
_CELERY_STATES = states.ALL_STATES | {states.IGNORED, states.REJECTED}


def _skip_state(problem: _Problem, value: object) -> str | None:
    """``redislock_skip_state``: a state of its own, not one Celery gives a meaning to."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[A-Z][A-Z0-9_]*", value) or value in _CELERY_STATES:
        allowed = "allowed: None, or an upper-case name that is not one of Celery's states, e.g. 'SKIPPED'"
        raise problem("redislock_skip_state", value, allowed)
    return value


def app_settings(app: Any) -> AppSettings:
    """The app's ``redislock_*`` settings, validated (unknown ``redislock_*`` names included)."""
    problem = _Problem(f"app {app.main or app!r}")
    known = [f"redislock_{name}" for name in APP_SETTINGS] + [f"redislock_{name}" for name in TASK_OPTIONS]
    for key in list(app.conf):
        name = str(key).lower().removeprefix("celery_")
        if name.startswith("redislock_") and name not in known:
            raise _unknown(problem, "setting", name, known)

    def setting(name: str) -> Any:
        """The setting ``redislock_<name>``, its default where unset (``None``), never where falsy."""
        value = app.conf.get(f"redislock_{name}")
        return APP_SETTINGS[name] if value is None else value

    url = app.conf.get("redislock_url")
    if url is not None:
        _check_url(problem, url)
    prefix = setting("prefix")
    if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix or not is_utf8(prefix):
        raise problem("redislock_prefix", prefix, "allowed: a non-empty str of UTF-8 text without '{' or '}'")
    transport_options = app.conf.get("redislock_transport_options")
    if transport_options is not None and not isinstance(transport_options, Mapping):
        allowed = "allowed: a dict, e.g. {'master_name': ...}"  # the value may hold a password
        raise problem.of_type("redislock_transport_options", transport_options, allowed)
    replicas = setting("replicas")
    if not is_replica_count(replicas):
        raise problem("redislock_replicas", replicas, f"allowed: an int from 0 to {MAX_REPLICAS}")
    return AppSettings(
        url=url,
        prefix=prefix,
        on_error=_choice(problem, "redislock_on_error", setting("on_error"), ON_ERROR),
        beat_leader=_flag(problem, "redislock_beat_leader", setting("beat_leader")),
        beat_leader_ttl=_duration(
            problem, "redislock_beat_leader_ttl", setting("beat_leader_ttl"), MIN_WATCHDOG_TTL
        ),
        transport_options=transport_options,
        replicas=replicas,
        replica_timeout=_duration(problem, "redislock_replica_timeout", setting("replica_timeout"), 0.001),
        key_secret=_key_secret(problem, app.conf.get("redislock_key_secret")),
        enabled=_enabled(problem, app),
        client=_client(problem, app),
        skip_state=_skip_state(problem, app.conf.get("redislock_skip_state")),
        spans=_choice(problem, "redislock_spans", setting("spans"), SPANS),
    )


def _check_outcomes(
    problem: _Problem, mode: str, busy: tuple[str, str], duplicate: tuple[str, str], replicated: bool
) -> None:
    """A task's own ``lock_duplicate="replace"`` needs an enqueue lock (and no replicas: not
    supported yet), its own ``lock_busy="reject"`` an execution lock, the only lock a run can
    find busy. The app's setting is the default of the tasks it applies to (the others never
    read it)."""
    rules = MODE_RULES[mode]
    if duplicate[1] == "replace" and rules.enqueue_lock and replicated:
        raise problem(*duplicate, "not supported with redislock_replicas")
    if duplicate == ("lock_duplicate", "replace") and not rules.enqueue_lock:
        raise problem(*duplicate, f"lock_mode {mode!r} takes no enqueue lock to replace")
    if busy == ("lock_busy", "reject") and not rules.execution_lock:
        raise problem(*busy, f"lock_mode {mode!r} takes no lock a run can find busy")


def _check_name(problem: _Problem, name: str, prefix: str) -> None:
    """The task's ``name`` as its lock keys hold it (``{prefix}:{name}:{digest}``): UTF-8 text,
    where a ``}`` closes a hash tag (else the keys can have no companions in their slot)."""
    if not is_utf8(name):
        raise problem("name", name, "a lock key holds it: it must be UTF-8 text")
    try:
        companion_key(lock_key(prefix, name, "0"), "wake:")
    except LockConfigurationError:
        raise problem("name", name, "a lock key holds it: a '}' must close a {hash tag}") from None


def _lease(problem: _Problem, option: str, value: object, settings: AppSettings) -> float:
    """``lock_ttl`` in seconds: a lease the watchdog can renew, longer than the wait for the
    replicas' acknowledgement where the app waits for one (``redislock_replicas``)."""
    ttl = _duration(problem, option, value, MIN_WATCHDOG_TTL)
    if settings.replicas and not ttl > settings.replica_timeout:
        above = f"redislock_replica_timeout ({settings.replica_timeout:g})"
        raise problem(option, value, f"with redislock_replicas it must be above {above}")
    return ttl


def _period(problem: _Problem, option: str, value: object, mode: str) -> float | None:
    """``lock_period`` in seconds: needed by the modes that keep the lock after a run, refused on
    a task of another mode (the app's ``redislock_period`` is the default of those that use it)."""
    period = None if value is None else _duration(problem, option, value, 0.001)
    settles = MODE_RULES[mode].settles
    if settles and period is None:
        raise problem("lock_period", None, f"{mode} needs it: how long the lock stays after a run")
    if option == "lock_period" and period is not None and not settles:
        allowed = "keeps no lock after a run (a period is for 'until_expired')"
        raise problem(option, value, f"lock_mode {mode!r} {allowed}")
    return period


def task_options(task: type[Any], app: Any, settings: AppSettings) -> LockOptions:
    """Options of the task class ``task``: attribute > ``app.conf.redislock_*`` > default, validated
    (``settings``: the app's, validated)."""
    problem = _Problem(f"task {task.name!r}")
    known = [f"lock_{name}" for name in TASK_OPTIONS]
    for name in dir(task):
        if name in RESOLVED or not name.startswith("lock_") or name in known or callable(getattr(task, name)):
            continue
        raise _unknown(problem, "task option", name, known)

    def raw(name: str) -> tuple[str, Any]:
        value = getattr(task, f"lock_{name}", None)
        if value is not None:
            return f"lock_{name}", value
        value = app.conf.get(f"redislock_{name}")
        if value is not None:
            return f"redislock_{name}", value
        return f"lock_{name}", TASK_OPTIONS[name]

    _check_name(problem, task.name, settings.prefix)
    mode = _choice(problem, *raw("mode"), MODES)
    ttl = _lease(problem, *raw("ttl"), settings)
    busy_option, busy = raw("busy")
    rules = MODE_RULES[mode]
    busy = _choice(problem, busy_option, rules.default_busy if busy is None else busy, BUSY)
    period = _period(problem, *raw("period"), mode)
    option, wait_value = raw("wait_timeout")
    duplicate_option, duplicate = raw("duplicate")
    duplicate = _choice(problem, duplicate_option, duplicate, DUPLICATE)
    _check_outcomes(problem, mode, (busy_option, busy), (duplicate_option, duplicate), settings.replicas > 0)
    return LockOptions(
        mode=mode,
        on=_lock_on(problem, *raw("on"), _bound_run(task)),
        ttl=ttl,
        busy=busy,
        duplicate=duplicate,
        queue_ttl=_duration(problem, *raw("queue_ttl"), 0.001),
        period=period,
        # read by lock_busy="retry" only: another task keeps an app-wide value it has no use for
        retry_delay=_duration(problem, *raw("retry_delay"), MIN_RETRY_DELAY if busy == "retry" else 0),
        wait_timeout=ttl if wait_value is None else _duration(problem, option, wait_value, 0),
        on_lost=_choice(problem, *raw("on_lost"), ON_LOST),
        beat=_flag(problem, *raw("beat")),
        rules=rules if settings.enabled else UNLOCKED,
        limit=_limit(problem, *raw("limit"), mode, settings.replicas > 0),
    )
