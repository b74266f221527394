"""The Redis client an app's locks use: one connection pool per app per process.

URL kinds (``redislock_url``, or the broker URL):

* ``redis://``, ``rediss://``, ``unix://``: one server, as redis-py reads them;
* ``redis+socket://``: Celery's spelling of a broker on a Unix socket, read as ``unix://``
  (its ``virtual_host`` as ``db``); a broker's ``ssl_cert_reqs=CERT_REQUIRED`` (kombu's
  spelling) is read as redis-py's ``required``;
* ``redis-cluster://[user:password@]host:port[,host:port...]`` (``rediss-cluster://``
  for TLS): a Redis Cluster, found from any of the nodes listed;
* ``sentinel://[user:password@]host:port[/db][;sentinel://host:port...]``: the
  primary that Sentinel names, Celery's spelling, with the master name in the
  transport options (``{"master_name": ...}``; also ``sentinel_kwargs`` and
  ``min_other_sentinels``, as kombu reads them). Every sentinel listed is asked in
  turn; the first URL's credentials and db are the primary's, as with kombu.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.cluster
import redis.sentinel
from celery.exceptions import SoftTimeLimitExceeded

from ._process import current_pid
from ._urls import cluster_parts, listed, masked
from .config import URL_SCHEMES, app_settings, check_client
from .exceptions import LockConfigurationError, RedisLockError
from .state import LockClient, app_state
from .telemetry import log_fields

__all__ = [
    "DEFAULT_URL",
    "GIVEN_CLIENT",
    "ClientUnavailable",
    "client_for",
    "client_location",
    "lock_url",
    "redis_client",
]

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://localhost:6379/0"
#: Seconds to connect and to wait for a reply; a blocked waiter's BLPOP sets its own.
SOCKET_TIMEOUT = 5.0

Client = redis.Redis | redis.cluster.RedisCluster

#: Held while this process makes an app's lock client; a new one in a forked child, where a
#: thread the child does not have may have held the parent's.
_making = threading.Lock()


def _new_making_lock() -> None:
    global _making
    _making = threading.Lock()


os.register_at_fork(after_in_child=_new_making_lock)


#: Where an error message says the locks' Redis is when ``client_for`` itself failed (its
#: ``ClientUnavailable`` names where).
GIVEN_CLIENT = "the app's lock client"


class ClientUnavailable(RedisLockError, redis.exceptions.ConnectionError):
    """The app's lock client could not be made: the ``redislock_client`` callable raised (a token
    endpoint down, say; the message names the exception's type only, its text may hold a
    secret), or a Redis Cluster was unreachable as its client was made (``RedisCluster()``
    connects, and raises no ``RedisError``). As Redis being unreachable, so it is also a
    ``redis.ConnectionError``, and every path that handles one (``redislock_on_error``, a
    beat's claim, a receiver) handles it. The exception is its ``__cause__``."""


def _broker_url(app: Any) -> str | None:
    """The broker URL the locks share: the first listed (Celery takes several, for failover, as a
    list or joined with ``;``), or every ``sentinel://`` one listed, joined with ``;``, when the
    first is one: kombu asks each sentinel in turn."""
    given = app.conf.broker_url
    listed = given if isinstance(given, (list, tuple)) else [given]
    urls = [part.strip() for url in listed if isinstance(url, str) for part in url.split(";") if part.strip()]
    if urls and urls[0].startswith("sentinel://"):
        return ";".join(url for url in urls if url.startswith("sentinel://"))
    return urls[0] if urls else None


def lock_url(app: Any) -> tuple[str, str]:
    """(URL, where it came from): ``redislock_url``, else a Redis broker URL, else the default."""
    configured = app_settings(app).url
    if configured is not None:
        return configured, "redislock_url"
    broker = _broker_url(app)
    if broker is not None and broker.partition("://")[0] in (*URL_SCHEMES, "redis+socket"):
        return _as_redis_py(broker), "broker_url"
    return DEFAULT_URL, "default"


def _as_redis_py(broker: str) -> str:
    """A Redis broker URL as redis-py reads it: kombu's spellings of a Unix socket
    (``redis+socket://``, its ``virtual_host`` the ``db``) and of a certificate requirement
    (``ssl_cert_reqs=CERT_REQUIRED``, ``CERT_OPTIONAL``, ``CERT_NONE``) in redis-py's."""
    scheme, _, rest = broker.partition("://")
    where, _, query = rest.partition("?")
    if scheme != "redis+socket" and "ssl_cert_reqs=CERT_" not in query:
        return broker
    scheme = "unix" if scheme == "redis+socket" else scheme
    options = [
        (
            "db" if name == "virtual_host" and scheme == "unix" else name,
            value.removeprefix("CERT_").lower() if name == "ssl_cert_reqs" else value,
        )
        for name, value in parse_qsl(query, keep_blank_values=True)
    ]
    return f"{scheme}://{where}" + (f"?{urlencode(options)}" if options else "")


def _cluster(url: str, options: dict[str, Any]) -> redis.cluster.RedisCluster:
    scheme = url.partition("://")[0]
    plain, addresses = cluster_parts(url)  # the credentials, db and query options: the first node's
    nodes = []
    for address in addresses:
        host, _, port = address.strip().rpartition(":")
        if not host or not port.isdigit():
            raise LockConfigurationError(f"{masked(url)!r}: each node must be host:port, got {address!r}")
        nodes.append(redis.cluster.ClusterNode(host, int(port)))  # type: ignore[no-untyped-call]
    kwargs: dict[str, Any] = redis.connection.parse_url(plain)  # type: ignore[no-untyped-call]
    if kwargs.pop("db", 0) not in (0, "0"):
        raise LockConfigurationError(f"{masked(url)!r}: a Redis Cluster has only db 0")
    for name in ("host", "port", "connection_class"):
        kwargs.pop(name, None)
    if scheme == "rediss-cluster":
        kwargs["ssl"] = True
    return redis.cluster.RedisCluster(startup_nodes=nodes, **{**options, **kwargs})


def _sentinel(url: str, transport_options: Mapping[str, Any], options: dict[str, Any]) -> redis.Redis:
    master_name = transport_options.get("master_name")
    if not isinstance(master_name, str) or not master_name:
        raise LockConfigurationError(
            f"{masked(url)!r}: a sentinel:// URL needs the master name, "
            "e.g. redislock_transport_options={'master_name': 'mymaster'}"
        )
    sentinels: list[tuple[str, int]] = []
    parts = listed(url)
    for part in parts:
        parsed = urlsplit(part.strip())
        if parsed.scheme != "sentinel" or not parsed.hostname:
            raise LockConfigurationError(
                f"{masked(url)!r}: {masked(part.strip())!r} is not a sentinel://host:port URL"
            )
        sentinels.append((parsed.hostname, parsed.port or 26379))
    first = urlsplit(parts[0].strip())  # the primary's credentials and db, as kombu reads them
    master: dict[str, Any] = {"db": int(first.path.strip("/") or 0)}
    if first.username:
        master["username"] = unquote(first.username)
    if first.password:
        master["password"] = unquote(first.password)
    # The sentinels' own options as redis-py makes them (``sentinel_kwargs``, else the client's
    # socket options), but not retried unless they say so: redis-py's default policy tries a
    # failing sentinel again for seconds before the next one listed, which is the lock's retry.
    given = transport_options.get("sentinel_kwargs")
    if given is not None and not isinstance(given, Mapping):  # its type only: it may hold a password
        raise LockConfigurationError(
            f"{masked(url)!r}: the transport option sentinel_kwargs is not valid; allowed: a dict, "
            f"got {type(given).__name__}"
        )
    minimum = transport_options.get("min_other_sentinels", 0)
    try:
        minimum = int(minimum)  # a number, or its digits (as kombu passes it on)
    except (TypeError, ValueError):
        raise LockConfigurationError(
            f"{masked(url)!r}: the transport option min_other_sentinels={minimum!r} is not valid; "
            "allowed: an int"
        ) from None
    own = {k: v for k, v in options.items() if k.startswith("socket_")} if given is None else given
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        sentinels,
        min_other_sentinels=minimum,
        sentinel_kwargs={"retry": None, **own},
        **options,
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        master_name, redis_class=redis.Redis, **master
    )
    return client


def redis_client(url: str, transport_options: Mapping[str, Any] | None = None, **options: Any) -> Client:
    """A client for ``url`` (any kind in the module docstring), with redis-py ``options``."""
    scheme = url.partition("://")[0]
    if scheme in ("redis-cluster", "rediss-cluster"):
        return _cluster(url, options)
    if scheme == "sentinel":
        return _sentinel(url, transport_options or {}, options)
    return redis.Redis.from_url(url, **options)


def client_location(client: Client) -> str:
    """Where ``client`` points, read from it without connecting and without credentials:
    ``redis://host:port/db`` (``rediss://`` over TLS), a socket, a Sentinel service or Cluster nodes."""
    if isinstance(client, redis.cluster.RedisCluster):
        nodes = client.get_nodes()  # type: ignore[no-untyped-call]
        return "Redis Cluster " + ",".join(node.name for node in nodes)
    pool = client.connection_pool
    service = getattr(pool, "service_name", None)
    if service is not None:
        return f"Sentinel service {service}"
    kwargs = pool.connection_kwargs
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


def client_for(app: Any) -> tuple[Client, str]:
    """The app's lock client in this process, and where it points (a URL with the password
    masked, or ``client_location(client)`` for the ``redislock_client``).

    Made on first use, and again in a forked child, which must not share its
    parent's sockets: from the URL, or by calling ``redislock_client``'s
    callable again. A client given as ``redislock_client`` is the same object
    in the child; its connection pool resets itself there (redis-py compares
    the pid). Where it points is logged once per process. A callable that
    raises, or a Cluster unreachable as its client is made: ``ClientUnavailable`` (callers apply
    ``redislock_on_error``).
    """
    made = app_state(app).client
    if made is None or made.pid != current_pid():
        with _making:  # two threads needing it at once make one
            made = _made(app)
    return made.client, made.where


def _made(app: Any) -> LockClient:
    """The app's lock client in this process: made, stored and logged unless it is already."""
    state = app_state(app)
    if state.client is not None and state.client.pid == current_pid():
        return state.client
    given = app_settings(app).client  # an instance was checked with the settings
    if given is None:
        try:
            client, where, source = _url_client(app)
        except redis.exceptions.RedisClusterException as exc:  # RedisCluster() connects: no RedisError
            url = masked(lock_url(app)[0])
            raise ClientUnavailable(f"app {app.main or app!r}: Redis at {url}: {exc}") from exc
    else:
        client = _called(app, given) if callable(given) else given
        where, source = client_location(client), "redislock_client"
    # the package closes what it made (``forget_client``), never a client it was given
    state.client = LockClient(current_pid(), client, where, given is None or callable(given))
    connected = log_fields(outcome="connected")
    logger.info("celery-redislock: locks in Redis at %s (from %s)", where, source, extra=connected)
    return state.client


def _called(app: Any, make: Any) -> Client:
    """The client that the ``redislock_client`` callable ``make`` returns for ``app``, checked. Its
    exception counts as Redis unreachable (``ClientUnavailable``), but for a soft time limit
    landing in it (an ``Exception`` too), which propagates: the run must not go on, unlocked."""
    where = f"app {app.main or app!r}"
    try:
        client = make(app)
    except SoftTimeLimitExceeded:
        raise
    except Exception as exc:
        raise ClientUnavailable(
            f"{where}: the redislock_client callable failed: {type(exc).__name__}"
        ) from exc
    check_client(where, client, "what the redislock_client callable returned", callable_allowed=False)
    return client  # type: ignore[no-any-return]


def _url_client(app: Any) -> tuple[Client, str, str]:
    """A client for the app's lock URL: (client, the URL with the password masked, where it came from)."""
    url, source = lock_url(app)
    options: dict[str, Any] = {"socket_connect_timeout": SOCKET_TIMEOUT, "socket_timeout": SOCKET_TIMEOUT}
    ssl = app.conf.get("broker_use_ssl")
    if source == "broker_url" and url.startswith("rediss://") and isinstance(ssl, dict):
        options.update(ssl)
    transport_options = app_settings(app).transport_options or app.conf.get("broker_transport_options") or {}
    try:
        client = redis_client(url, transport_options, **options)
    except LockConfigurationError:
        raise
    except ValueError as exc:  # a broker URL: a redislock_url was checked with the settings
        where = f"app {app.main or app!r}"
        raise LockConfigurationError(
            f"{where}: {source}={masked(url)!r} is not a URL redis-py reads: {exc}"
        ) from None
    return client, masked(url), source
