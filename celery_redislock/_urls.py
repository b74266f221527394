"""Redis URLs as the package shows them: in logs, errors and ``celery redislock``'s output."""

from __future__ import annotations

import re

__all__ = ["cluster_parts", "listed", "masked"]

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
