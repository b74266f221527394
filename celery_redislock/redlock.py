"""Redlock: one lock over N independent Redis primaries, held while a majority agrees.

``RedisLock([client_or_url, ...], name, ...)`` makes a ``Redlock``. It runs
the single-server scripts (``_scripts``) on every server, multiplexed: the
commands are sent to all servers first, then the replies read, all within one
per-server deadline (``ttl / 10``, at least 0.1 s), so N servers cost about
one round trip, not N.

* acquire: the attempt goes to every server; the lock is held when at least
  ``quorum = N // 2 + 1`` granted it and the validity ``ttl - elapsed -
  drift`` (elapsed from the send, monotonic; drift ``0.01 * ttl + 2 ms``) is
  still positive. Otherwise the servers that granted it are released at
  once, and a blocking acquire tries again after a random delay (up to
  ``RETRY_DELAY``: waiters are not queued or woken across servers, as the
  Redlock algorithm prescribes). An unreachable server counts as a refusal.
* release: on every server, owner-checked. ``LockNotOwned`` when fewer than a
  quorum still held it; when errors made that unknown, the first error is
  raised and the hold kept, so ``release()`` can be tried again.
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
import os
import random
import time as mod_time
import weakref
from collections.abc import Sequence
from typing import Any

import redis

from ._durations import Duration, to_ms
from ._scripts import ACQUIRE, RELEASE, RENEW, Script, bulk, read_replies
from .exceptions import LockConfigurationError
from .lock import RedisLock, _lease_seconds
from .protocol import text
from .watchdog import Lease, get_watchdog

__all__ = ["RETRY_DELAY", "Redlock"]

logger = logging.getLogger(__name__)

#: Longest random pause (seconds) between two attempts of a blocking acquire.
RETRY_DELAY = 0.05
#: Clock drift allowed for, as a fraction of the ttl (plus 2 ms), as in the Redlock spec.
DRIFT_FACTOR = 0.01


def _clients(servers: object, timeout: float) -> list[redis.Redis]:
    """The servers as clients (URLs get one of their own, with ``timeout`` for connects and
    reads), or ``LockConfigurationError`` naming what is wrong."""
    if not isinstance(servers, (list, tuple)) or not servers:
        raise LockConfigurationError(f"client must be a non-empty list of clients or URLs, got {servers!r}")
    clients: list[redis.Redis] = []
    for server in servers:
        if isinstance(server, str):
            try:
                server = redis.Redis.from_url(server, socket_timeout=timeout, socket_connect_timeout=timeout)
            except ValueError as exc:
                raise LockConfigurationError(f"client: bad Redis URL {server!r}: {exc}") from None
        if type(server) is not redis.Redis:
            raise LockConfigurationError(
                f"client: each server must be a redis.Redis or a redis:// URL, got {type(server).__name__}"
            )
        clients.append(server)
    addresses = {
        tuple(client.connection_pool.connection_kwargs.get(k) for k in ("host", "port", "path", "db"))
        for client in clients
    }
    if len(addresses) < len(clients):
        raise LockConfigurationError(f"client: the servers must be distinct, got {servers!r}")
    return clients


class Redlock(RedisLock):
    """``RedisLock`` over several independent primaries; see the module docstring.

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
        lease = _lease_seconds(ttl, watchdog)
        node_timeout = max(lease / 10, 0.1)
        clients = _clients(client, node_timeout)
        if fair:
            raise LockConfigurationError("fair=True needs a single server to queue waiters; not with several")
        super().__init__(clients[0], name, ttl, watchdog=watchdog, timeout=timeout, holder=holder)
        self.clients = tuple(clients)
        self.quorum = len(clients) // 2 + 1
        self.validity: float | None = None
        self._node_timeout = node_timeout
        self._drift = lease * DRIFT_FACTOR + 0.002
        self._leases: list[Lease] = []
        #: the servers that granted the current hold (renewed by the watchdog)
        self._granted: list[redis.Redis] = []

    def __repr__(self) -> str:
        return f"<Redlock {self.name!r} servers={len(self.clients)} ttl={self.ttl} held={self._count}>"

    # -- one script on every server -------------------------------------------

    def _on_all(self, script: Script, args: Sequence[str | int]) -> list[Any]:
        """Run ``script`` on the lock's key on every server at once; each server's reply,
        or the exception it ended with (unreachable, no reply within the deadline, an error)."""
        deadline = mod_time.monotonic() + self._node_timeout
        sent: list[tuple[Any, Any, bytes | BaseException]] = []
        results: list[Any] = []
        try:
            for client in self.clients:
                pool: Any = client.connection_pool
                try:
                    connection = pool.get_connection()
                except Exception as exc:
                    sent.append((pool, None, exc))
                    continue
                sent.append((pool, connection, b""))  # released by the finally, whatever happens next
                try:
                    encode = connection.encoder.encode
                    packed = script.pack([bulk(encode(self.name))], [bulk(encode(arg)) for arg in args])
                    connection.send_packed_command([packed])
                    sent[-1] = (pool, connection, packed)
                except Exception as exc:
                    sent[-1] = (pool, connection, exc)
            for _, connection, command in sent:
                if isinstance(command, BaseException):
                    results.append(command)
                    continue
                try:
                    if not connection.can_read(max(deadline - mod_time.monotonic(), 0.0)):
                        raise redis.exceptions.TimeoutError(f"no reply within {self._node_timeout:.3f}s")
                    results.append(read_replies(connection, script, [command])[0])
                except redis.exceptions.ResponseError as exc:
                    results.append(exc)  # a complete error reply: the connection is clean
                except Exception as exc:
                    connection.disconnect()
                    results.append(exc)
        finally:
            for index, (pool, connection, _) in enumerate(sent):
                if connection is not None:
                    if index >= len(results):  # interrupted before its reply was read
                        connection.disconnect()
                    pool.release(connection)
        return results

    # -- acquiring and releasing ---------------------------------------------------

    def _wait_for(
        self, token: str, member: str, blocking: bool, deadline: float | None
    ) -> tuple[float, int | None]:
        sent = False
        try:
            while True:
                sent_at = mod_time.monotonic()
                waiting = blocking and (deadline is None or sent_at < deadline)
                sent = True
                replies = self._on_all(ACQUIRE, [member, "try"])
                fences = [reply for reply in replies if isinstance(reply, int)]
                validity = self.ttl - (mod_time.monotonic() - sent_at) - self._drift
                if len(fences) >= self.quorum and validity > 0:
                    self.validity = validity
                    granted = zip(self.clients, replies, strict=True)
                    self._granted = [client for client, reply in granted if isinstance(reply, int)]
                    return sent_at, max(fences)
                if fences:  # a minority, or too late: give back what was granted
                    self._on_all(RELEASE, [token])
                self.busy = self._holder(replies)
                if not waiting:
                    return sent_at, None
                pause = random.uniform(0, RETRY_DELAY)
                if deadline is not None:
                    pause = min(pause, max(deadline - mod_time.monotonic(), 0.0))
                mod_time.sleep(pause)
        except BaseException:
            if sent:
                self._abandon(token, member)
            raise

    def _holder(self, replies: list[Any]) -> tuple[str | None, float | None]:
        """(holder, ttl in seconds) that most busy servers report, for ``LockNotAcquired``."""
        busy = [reply for reply in replies if isinstance(reply, list)]
        if not busy:
            failed = sum(isinstance(reply, Exception) for reply in replies)
            return (f"nobody: {failed} of {len(replies)} servers failed", None) if failed else (None, None)
        holders = [None if reply[1] is None else text(reply[1]) for reply in busy]
        holder = max(set(holders), key=holders.count)
        pttl = max(int(reply[0]) for reply in busy)
        return holder, max(pttl, 0) / 1000

    def _abandon(self, token: str, member: str) -> None:
        for reply in self._on_all(RELEASE, [token, member]):
            if isinstance(reply, Exception):
                logger.warning("lock %r: could not undo an attempt on a server: %s", self.name, reply)

    def _free(self, token: str) -> bool:
        replies = self._on_all(RELEASE, [token])
        if sum(reply == 1 for reply in replies) >= self.quorum:
            return True
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if errors:
            raise errors[0]
        return False

    def _extend(self, token: str, ttl: float) -> bool:
        """Set the hold to ``ttl`` on every server; whether a quorum of them still held it."""
        replies = self._on_all(RENEW, [to_ms(ttl), token])
        return sum(isinstance(reply, list) and not reply for reply in replies) >= self.quorum

    def locked(self) -> bool:
        """Whether a quorum of servers hold the lock (anyone's)."""
        return self._count_servers(lambda value: value is not None) >= self.quorum

    def owned(self) -> bool:
        """Whether a quorum of servers hold the lock for this object, now."""
        with self._state:
            if not self.held():
                return False
            token = self.token
        mine = self._count_servers(lambda value: value is not None and text(value)[:32] == token)
        return mine >= self.quorum

    def _count_servers(self, test: Any) -> int:
        count = 0
        for client in self.clients:
            try:
                count += bool(test(client.get(self.name)))
            except redis.exceptions.RedisError as exc:
                logger.warning("lock %r: a server could not be read: %s", self.name, exc)
        return count

    # -- the watchdog: one lease per server ------------------------------------

    def _hold(self, token: str, fence: int, sent_at: float) -> None:
        with self._state:
            self.token, self.fence, self._count, self._pid = token, fence, 1, os.getpid()
            if self.lost.is_set():
                self.lost.clear()
            if self.watchdog:
                owner = weakref.ref(self)
                self._leases = [Lease(client, self.name, token, self.ttl, owner) for client in self._granted]
                for lease in self._leases:
                    get_watchdog().add(lease, sent_at)

    def _held_leases(self) -> list[Lease]:
        return list(self._leases)

    def forget(self) -> None:
        with self._state:
            self.token, self.fence, self._count, self._leases, self.validity = None, None, 0, [], None

    def lease_lost(self, lease: Lease) -> bool:
        """A server lost ``lease``: the lock is lost once fewer than a quorum of servers hold it."""
        with self._state:
            if lease not in self._leases:
                return False
            self._leases.remove(lease)
            if len(self._leases) >= self.quorum:
                logger.warning(
                    "lock %r: lost on one server, still held on %d of %d",
                    self.name,
                    len(self._leases),
                    len(self.clients),
                )
                return False
            rest, self._leases = self._leases, []
            self.lost.set()
        for other in rest:
            get_watchdog().discard(other)
        return True
