"""Redlock: one lock over N independent Redis primaries, held while a majority agrees.

``Redlock([client_or_url, ...], name, ...)``, or ``RedisLock`` given such a list, runs
the single-server scripts (``_scripts``) on every server, multiplexed: the
commands are sent to all servers first, then the replies read, all within one
per-server deadline (``ttl / 10``, at least 0.1 s, from the last send; each
connect is bounded by it too), so N servers cost about one round trip, not N.

* acquire: the attempt goes to every server; the lock is held when at least
  ``quorum = N // 2 + 1`` granted it and the validity ``ttl - elapsed -
  drift`` (elapsed from the send, monotonic; drift ``0.01 * ttl + 2 ms``) is
  still positive. Otherwise it is released at once on every server, unless
  every server refused it (one whose reply was lost or late may have granted
  it), and a blocking acquire tries again after a random delay (up to
  ``RETRY_DELAY``: waiters are not queued or woken across servers, as the
  Redlock algorithm prescribes). An unreachable server counts as a refusal.
* release: on every server, owner-checked. ``LockNotOwned`` when fewer than a
  quorum still held it; when errors made that unknown (the servers that failed
  could make a quorum with those that freed it), the first error is raised and
  the hold kept, so ``release()`` can be tried again.
* extend: likewise, ``LockNotOwned`` (and ``lost``) when fewer than a quorum
  still held it, the first error (the hold kept, renewed in time for either
  TTL) when the servers that failed could make a quorum with those that
  extended it.
* the watchdog renews the hold on every server (one lease per server, each
  batched with that server's other leases) and reports the lock lost when
  fewer than a quorum of servers still hold it; a loss on a minority is
  logged at WARNING and the lock stays held.
* ``fence`` is the largest of the granting servers' fences (their clocks in
  microseconds): greater than the previous holder's as long as the servers'
  clocks differ by less than the time between the two holds. A majority of
  servers always saw both holds, but no server orders holds it did not see:
  Redlock cannot give the strictly ordered fence one server gives.
* ``fair=True`` is refused: a fair queue needs one server to order waiters.
"""

from __future__ import annotations

import logging
import random
import time as mod_time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis

from ._durations import Duration, to_ms
from ._redis import FAILURES, checkout
from ._scripts import ACQUIRE, RELEASE, RENEW, Script, bulks
from ._urls import masked, url_problem
from .attempt import Attempt, flag, lease_seconds, owns
from .exceptions import LockConfigurationError
from .primitive import LeaseLock
from .protocol import text
from .telemetry import log_fields
from .watchdog import Lease

__all__ = ["RETRY_DELAY", "Quorum", "Redlock"]

logger = logging.getLogger(__name__)

#: Longest random pause (seconds) between two attempts of a blocking acquire.
RETRY_DELAY = 0.05
#: Clock drift allowed for, as a fraction of the ttl (plus 2 ms), as in the Redlock spec.
DRIFT_FACTOR = 0.01


def _clients(servers: object, timeout: float) -> list[redis.Redis]:
    """The servers as clients (URLs get one of their own, with ``timeout`` for connects and
    reads), or ``LockConfigurationError`` naming what is wrong."""
    if not isinstance(servers, (list, tuple)) or not servers:
        shown = repr(masked(servers)) if isinstance(servers, str) else repr(servers)
        raise LockConfigurationError(f"client must be a non-empty list of clients or URLs, got {shown}")
    clients: list[redis.Redis] = []
    for server in servers:
        if isinstance(server, str):
            problem = url_problem(server)
            if problem is not None:
                raise LockConfigurationError(f"client: bad Redis URL {masked(server)!r}: {problem}")
            server = redis.Redis.from_url(server, socket_timeout=timeout, socket_connect_timeout=timeout)
        if type(server) is not redis.Redis:
            raise LockConfigurationError(
                f"client: each server must be a redis.Redis or a redis:// URL, got {type(server).__name__}"
            )
        clients.append(server)
    if len({_address(client) for client in clients}) < len(clients):
        listed = ", ".join(masked(server) if isinstance(server, str) else repr(server) for server in servers)
        raise LockConfigurationError(f"client: the servers must be distinct, got {listed}")
    return clients


def _address(client: redis.Redis) -> tuple[str, int | str, int]:
    """Where ``client`` points, one tuple however it was spelled: a URL without its port or db,
    or a client made without them, gets redis-py's defaults; a host name's case is not its own."""
    given = client.connection_pool.connection_kwargs
    db = int(given.get("db") or 0)
    if given.get("path"):
        return "unix", given["path"], db
    return str(given.get("host") or "localhost").lower(), int(given.get("port") or 6379), db


class Redlock(LeaseLock):
    """A lock over several independent primaries; see the module docstring, and ``RedisLock``
    for the rest of the contract.

    ``clients`` are the servers, ``quorum`` how many must hold the lock,
    ``validity`` the seconds the current hold was valid for when granted
    (without renewal). ``client`` is the first server.
    """

    def __init__(
        self,
        client: Sequence[redis.Redis | str],
        name: str | bytes,
        ttl: Duration = 30.0,
        *,
        watchdog: bool = True,
        fair: bool = False,
        timeout: Duration | None = None,
        holder: str | None = None,
    ) -> None:
        node_timeout = max(lease_seconds(ttl, flag(watchdog, "watchdog")) / 10, 0.1)
        clients = _clients(client, node_timeout)
        if flag(fair, "fair"):
            raise LockConfigurationError("fair=True needs a single server to queue waiters; not with several")
        super().__init__(name, ttl, watchdog=watchdog, fair=fair, timeout=timeout, holder=holder)
        self._quorum = self.servers = Quorum(clients, self.name, self.ttl, node_timeout)
        self.clients = self._quorum.clients
        self.quorum = self._quorum.needed
        #: as a ``RedisLock``'s: a Redlock waits for no replicas (each server is a primary)
        self.replicas, self.replica_timeout = 0, 1.0

    @property
    def validity(self) -> float | None:
        """Seconds the current hold was valid for when granted (None: not held)."""
        return self._quorum.validity if self.held() else None

    def __repr__(self) -> str:
        return f"<Redlock {self.name!r} servers={len(self.clients)} ttl={self.ttl} held={self.hold_count}>"


class Quorum:
    """The servers of a ``Redlock``: each script runs on all of them at once, and a hold counts
    where a quorum of them agrees (see the module docstring)."""

    queues = False
    replicas = 0

    def __init__(self, clients: list[redis.Redis], name: str, ttl: float, node_timeout: float) -> None:
        self.clients, self.name, self.ttl = tuple(clients), name, ttl
        self.client = clients[0]
        self.needed = len(clients) // 2 + 1
        #: seconds the last hold granted was valid for, when granted
        self.validity = 0.0
        self._node_timeout = node_timeout
        self._drift = ttl * DRIFT_FACTOR + 0.002
        #: the servers that granted the last hold (renewed by the watchdog)
        self._granted: list[redis.Redis] = []

    def __len__(self) -> int:
        return len(self.clients)

    def acquire(self, attempt: Attempt, mode: str) -> Any:
        """The fence when a quorum granted ``attempt`` in time; else the [PTTL, holder] that most
        busy servers report (PTTL None when none answered), after releasing it on every server
        unless all refused it: a server that granted it, or failed to answer (its grant maybe
        lost or late), gives it back."""
        replies = self._on_all(ACQUIRE, [attempt.member, mode])
        fences = [reply for reply in replies if isinstance(reply, int)]
        validity = self.ttl - (mod_time.monotonic() - attempt.sent_at) - self._drift
        if len(fences) >= self.needed and validity > 0:
            self.validity = validity
            granted = zip(self.clients, replies, strict=True)
            self._granted = [client for client, reply in granted if isinstance(reply, int)]
            return max(fences)
        if any(not isinstance(reply, list) for reply in replies):  # a grant, or maybe one
            self._on_all(RELEASE, [attempt.token])  # (its reply lost or late): give them back
        return _busy(replies)

    def sleep(self, attempt: Attempt) -> None:
        """A random pause (up to ``RETRY_DELAY``, and the deadline): waiters are not woken across
        servers, as the Redlock algorithm prescribes."""
        pause = random.uniform(0, RETRY_DELAY)
        if attempt.deadline is not None:
            pause = min(pause, max(attempt.deadline - mod_time.monotonic(), 0.0))
        mod_time.sleep(pause)

    def abandon(self, token: str, member: str) -> None:
        for reply in self._on_all(RELEASE, [token, member]):
            if isinstance(reply, Exception):
                logger.warning(
                    "lock %r: could not undo an attempt on a server: %s",
                    self.name,
                    reply,
                    extra=log_fields(self.name, outcome="error"),
                )

    def free(self, token: str) -> bool:
        """Whether a quorum still held the lock; when errors made that unknown (the servers that
        failed to answer could make a quorum with those that freed it), the first error."""
        replies = self._on_all(RELEASE, [token])
        return self._quorum(replies, sum(1 for reply in replies if reply == 1))

    def extend(self, token: str, ttl: float) -> bool:
        """Set the hold to ``ttl`` on every server; whether a quorum of them still held it; when
        errors made that unknown (the servers that failed to answer could make a quorum with
        those that extended it), the first error."""
        replies = self._on_all(RENEW, [to_ms(ttl), token])
        return self._quorum(replies, sum(isinstance(reply, list) and not reply for reply in replies))

    def _quorum(self, replies: list[Any], done: int) -> bool:
        """Whether ``done`` servers of those that sent ``replies`` make a quorum; when errors made
        that unknown (the servers that failed could make one with them), the first error."""
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if done < self.needed <= done + len(errors):
            raise errors[0]
        return done >= self.needed

    def confirm(self, token: str, member: str) -> None:
        """Nothing to wait for: a Redlock's servers are primaries without replicas to count."""

    def leases(self, token: str, ttl: float, owner: weakref.ref[LeaseLock]) -> list[Lease]:
        return [Lease(client, self.name, token, ttl, owner) for client in self._granted]

    def locked(self) -> bool:
        """Whether a quorum of servers hold the lock (anyone's)."""
        return self._count_servers(lambda value: value is not None) >= self.needed

    def owned(self, token: str | None) -> bool:
        """Whether a quorum of servers hold the lock for ``token``, now."""
        return self._count_servers(lambda value: owns(value, token)) >= self.needed

    def _count_servers(self, test: Callable[[Any], bool]) -> int:
        count = 0
        for client in self.clients:
            try:
                count += bool(test(client.get(self.name)))
            except redis.exceptions.RedisError as exc:
                logger.warning(
                    "lock %r: a server could not be read: %s",
                    self.name,
                    exc,
                    extra=log_fields(self.name, outcome="error"),
                )
        return count

    def _on_all(self, script: Script, args: Sequence[str | int]) -> list[Any]:
        """Run ``script`` on the lock's key on every server at once; each server's reply,
        or the Redis failure it ended with (unreachable, no reply within the deadline, an error:
        a ``RedisError`` or ``OSError``). The deadline counts from the last send: a server whose
        connect hangs (up to its connect timeout) does not leave the others' replies less time to
        come. Anything else (an interrupt: a soft time limit is an ``Exception`` too) is no one
        server's failure: it propagates, every connection that has a reply on its way dropped."""
        sent: list[tuple[Any, Any, bytes | BaseException]] = []
        results: list[Any] = []
        try:
            for client in self.clients:
                pool: Any = client.connection_pool
                try:
                    connection = checkout(pool)  # cut short in its handshake: not left half-connected
                except FAILURES as exc:
                    sent.append((pool, None, exc))
                    continue
                sent.append((pool, connection, b""))  # released by the finally, whatever happens next
                try:
                    encoder = connection.encoder
                    packed = script.pack(bulks(encoder, [self.name]), bulks(encoder, args))
                    connection.send_packed_command([packed])
                    sent[-1] = (pool, connection, packed)
                except FAILURES as exc:
                    sent[-1] = (pool, connection, exc)
            deadline = mod_time.monotonic() + self._node_timeout
            for _, connection, command in sent:
                if isinstance(command, BaseException):
                    results.append(command)
                    continue
                try:
                    if not connection.can_read(max(deadline - mod_time.monotonic(), 0.0)):
                        raise redis.exceptions.TimeoutError(f"no reply within {self._node_timeout:.3f}s")
                    results.append(script.read_reply(connection, command))
                except redis.exceptions.ResponseError as exc:
                    results.append(exc)  # a complete error reply: the connection is clean
                except FAILURES as exc:
                    connection.disconnect()
                    results.append(exc)
        finally:
            for index, (pool, connection, _) in enumerate(sent):
                if connection is not None:
                    if index >= len(results):  # interrupted before its reply was read
                        connection.disconnect()
                    pool.release(connection)
        return results


def _busy(replies: list[Any]) -> list[Any]:
    """[PTTL in ms, holder] that most busy servers report, for ``LockNotAcquired`` (PTTL None
    when no server said: the holder then tells how many failed)."""
    busy = [reply for reply in replies if isinstance(reply, list)]
    if not busy:
        failed = sum(isinstance(reply, Exception) for reply in replies)
        return [None, f"nobody: {failed} of {len(replies)} servers failed" if failed else None]
    holders = [None if reply[1] is None else text(reply[1]) for reply in busy]
    return [max(int(reply[0]) for reply in busy), max(set(holders), key=holders.count)]
