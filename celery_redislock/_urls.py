"""Redis URLs as the package shows them: in logs, errors and ``celery redislock``'s output."""

from __future__ import annotations

import functools
import re
from urllib.parse import urlsplit

import redis
from redis.connection import parse_url

from .attempt import MAX_TTL

__all__ = ["cluster_parts", "listed", "masked", "url_problem"]

#: A ';' that starts the next URL of a list (sentinels'); one inside a password does not.
_NEXT_URL = re.compile(r";(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)")


def listed(url: str) -> list[str]:
    """The URLs of a list joined with ';' (sentinels'), as given: a ';' in a password stays."""
    return _NEXT_URL.split(url)


def masked(url: str) -> str:
    """``url`` with every password shown as ``**``: before each host (one per listed URL), and
    in the query (``?password=``, which redis-py reads as well)."""
    return ";".join(_masked_one(part) for part in listed(url))


def _masked_one(url: str) -> str:
    """One URL, masked. Its password runs to the host's '@': the last one before the query when a
    path comes before it (redis-py's reading: a password may hold '@', ';' or '/'), else the last
    one of all (a password holding '?'). Where that '@' is in fact the query's, more than the
    password is hidden, never less."""
    scheme, sep, rest = url.partition("://")
    head = rest.partition("?")[0]
    end = head.rfind("@") if "/" in head else rest.rfind("@")
    user, colon, _ = rest[: max(end, 0)].partition(":")
    if colon:
        url = f"{scheme}{sep}{user}:**{rest[end:]}"
    return re.sub(r"([?&]password=)[^&#]*", r"\1**", url)


def cluster_parts(url: str) -> tuple[str, list[str]]:
    """A ``redis-cluster://`` (``rediss-cluster://``) URL as the ``redis://`` (``rediss://``) URL
    of its first node, which holds its credentials, db and query options as redis-py reads
    them, and its nodes' ``host:port``."""
    scheme, _, rest = url.partition("://")
    where, _, query = rest.partition("?")  # a query may hold a path (ssl_ca_certs=/...)
    userinfo, _, located = where.rpartition("@")
    hosts, slash, tail = located.partition("/")
    nodes = hosts.split(",")
    plain = f"{scheme.removesuffix('-cluster')}://{userinfo + '@' if userinfo else ''}{nodes[0]}"
    return plain + (slash + tail if tail else "") + ("?" + query if query else ""), nodes


@functools.lru_cache(maxsize=16)
def url_problem(url: str) -> str | None:
    """Why redis-py cannot use ``url`` (a ``redis``, ``rediss`` or ``unix`` URL) as given, or
    ``None``: it does not parse; its connections refuse an option of its query (an unknown one:
    redis-py keeps it, and its first connection raises ``TypeError``; a bad value: a
    ``RedisError``, ``protocol=4`` say); a timeout there is one no socket takes (set as given at
    the first connection: NaN, 0, which makes reads non-blocking, a negative or huge one); its
    database is no number (redis-py would quietly use db 0). Cached: making the pool and
    connection (nothing is sent) costs about 0.6 ms, and the settings are read for every task bound."""
    try:
        parsed = parse_url(url)  # type: ignore[no-untyped-call]
        redis.Redis.from_url(url).connection_pool.make_connection()
    except (TypeError, ValueError, redis.RedisError) as exc:
        return str(exc)
    for option in ("socket_timeout", "socket_connect_timeout"):
        if option in parsed and not 0 < parsed[option] <= MAX_TTL:  # NaN, too
            return (
                f"{option}={parsed[option]!r} must be > 0 and <= {MAX_TTL:.0f} seconds (none: leave it out)"
            )
    database = urlsplit(url).path.strip("/")
    if not url.startswith("unix:") and database and "db" not in parsed:
        return f"the database {database!r} is not a number"
    return None
