"""The connections the package's exchanges run on, and commands with a deadline of their own,
whatever the client's socket_timeout."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import redis
import redis.cluster
import redis.sentinel

from ._process import current_pid

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # redis-py depends on async-timeout there, for the same reason
    from async_timeout import timeout as _timeout
#: ``async with deadline(seconds)``: the block, in this task, is cancelled after ``seconds``
#: (``None``: never) and raises ``asyncio.TimeoutError``. Not ``asyncio.wait_for``, which before
#: Python 3.12 runs its awaitable in a task of its own and, when that one has just finished as
#: the caller is cancelled, returns its result and drops the cancellation: a cancelled acquire
#: would go on and take the lock.
deadline = _timeout

try:  # redis-py's private reply buffer (``_stale``): where a release moved it, ``can_read`` answers
    from redis._parsers.socket import SocketBuffer as _SocketBuffer
except ImportError:  # pragma: no cover - tests/test_redis_internals.py runs this branch in a subprocess
    _SOCKET_BUFFER: type[Any] | None = None
else:
    _SOCKET_BUFFER = _SocketBuffer


def node_client(client: redis.Redis | redis.cluster.RedisCluster, key: str) -> redis.Redis:
    """The plain client that serves ``key``: ``client`` itself, or its Cluster node."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return node.redis_connection  # type: ignore[no-any-return]
    return client


class _Loan:
    """A connection one thread keeps out of ``pool`` between its exchanges (``PooledConnection``),
    given back when the thread ends or the loan is replaced; dropped with a pool that is gone."""

    __slots__ = ("__weakref__", "connection", "fresh_until", "in_use", "pending", "pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.connection: Any = None  # until made: its place among the pool's loans is claimed first
        self.pool = weakref.ref(pool)
        self.pid = current_pid()
        self.in_use = False
        #: the reply ``send_later`` left to read on ``connection`` before anything else is
        self.pending: _Pending | None = None
        #: monotonic time until which ``connection`` counts as fresh (``_connect_clean``): its last
        #: reply was read, completely, less than ``FRESH_FOR`` seconds before
        self.fresh_until = 0.0

    def __del__(self) -> None:
        pool = self.pool()
        # not a forked child's (its pool reset itself), nor one whose connection was never made
        if pool is not None and self.connection is not None and self.pid == current_pid():
            with contextlib.suppress(Exception):  # at interpreter exit, or the pool closed
                if self.pending is not None:  # its late reply must reach no other user of the pool
                    self.connection.disconnect()
                pool.release(self.connection)

    def settle(self) -> None:
        """Read the reply still pending on the connection (if any, ``send_later``) and hand it over.

        The connection stays in use until ``then`` (user code: ``lock_released`` receivers) is
        over, so that an exchange started meanwhile (by ``then``, or a signal handler during the
        read) lends a connection of its own, and a ``send_later`` returns ``False``: nothing new
        is left pending here for the exchange this settle precedes to read as its own. An error
        reply is the reply (the connection is clean); any other exception reading it drops the
        connection (a late reply must reach no one) and is handed over, then propagates unless
        a Redis error.
        """
        pending = self.pending
        if pending is None:
            return
        reply: Any = None
        try:
            self.in_use, self.pending = True, None
            reply = pending.read(self.connection)
            self.fresh_until = time.monotonic() + FRESH_FOR
        except redis.exceptions.ResponseError as exc:
            reply = exc
        except BaseException as exc:
            self.connection.disconnect()
            reply = exc
            if not isinstance(exc, redis.exceptions.RedisError):
                raise
        finally:
            try:
                pending.then(reply)
            finally:
                self.in_use = False


class _Pending:
    """A reply sent for on a loaned connection and not read yet: ``read(connection)`` reads it,
    ``then(reply)`` gets it (or the exception reading it raised)."""

    __slots__ = ("read", "then")

    def __init__(self, read: Callable[[Any], Any], then: Callable[[Any], None]) -> None:
        self.read, self.then = read, then


class _Loans(threading.local):
    """Per thread: pool -> the thread's ``_Loan`` of it."""

    def __init__(self) -> None:
        self.by_pool: weakref.WeakKeyDictionary[Any, _Loan] = weakref.WeakKeyDictionary()


class _Lending:
    """Per pool, the loans of it alive in this process's threads (a weak set each: a loan leaves
    it when its thread ends), at most half the pool's ``max_connections``, so that threads that
    keep one (a gevent worker's greenlets, by the hundred) never exhaust it: the others lend per
    exchange. A place is claimed, under a lock, before its connection is made: threads whose
    first calls start together cannot all find room while they connect."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lent: weakref.WeakKeyDictionary[Any, weakref.WeakSet[_Loan]] = weakref.WeakKeyDictionary()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # A forked child lends afresh (its pools reset themselves); another thread may have
        # held the lock at the fork.
        self._lock = threading.Lock()
        self._lent = weakref.WeakKeyDictionary()

    def claim(self, pool: Any) -> _Loan | None:
        """A loan of ``pool`` with its place claimed, its connection not made yet; ``None``: no room."""
        with self._lock:
            lent = self._lent.setdefault(pool, weakref.WeakSet())
            if len(lent) >= pool.max_connections // 2:
                return None
            loan = _Loan(pool)
            lent.add(loan)
            return loan

    def give_up(self, pool: Any, loan: _Loan) -> None:
        """Free ``loan``'s place (its connection could not be made)."""
        with self._lock:
            self._lent.get(pool, weakref.WeakSet()).discard(loan)


#: Per thread, its loans (a cache of connections, never shared between threads or processes).
_LOANS = _Loans()
#: Per pool, how many loans of it there are.
_LENDING = _Lending()
#: The pools a thread keeps a connection of; any other (``BlockingConnectionPool``, a subclass)
#: lends one per exchange.
_LOANABLE = (redis.ConnectionPool, redis.sentinel.SentinelConnectionPool)
#: redis-py's default ``max_connections`` (2**31 before redis-py 8, 100 since): a pool left at
#: it has no bound of the user's, and its threads keep a connection each (up to half of it:
#: ``_Lending``); a pool given a ``max_connections`` of its own lends one per exchange, so idle
#: threads never exhaust it.
_DEFAULT_MAX_CONNECTIONS = redis.ConnectionPool().max_connections


def _loan(pool: Any) -> _Loan | None:
    """This thread's loan of ``pool``, marked in use; ``None`` when ``pool`` lends per exchange
    (another kind, one with a client-side cache, or one bounded by a ``max_connections``
    of its own, which idle threads' loans would exhaust), when half of it is lent to other threads
    already (``_Lending``), or the loan is in use (an exchange started by a signal handler inside
    another, or while a pending reply is read or handed over). A reply ``send_later`` left pending
    on it is read first and handed over (``_Loan.settle``): that runs its ``then`` callbacks, user
    code (``lock_released`` receivers), here."""
    if type(pool) not in _LOANABLE or getattr(pool, "cache", None) is not None:
        return None
    if pool.max_connections != _DEFAULT_MAX_CONNECTIONS:  # bounded by the user: each exchange checks out
        return None
    loans = _LOANS.by_pool
    loan = loans.get(pool)
    if loan is not None and loan.pid != current_pid():  # inherited over a fork: the pool reset itself
        del loans[pool]  # with any reply pending on it: the parent's to read, never this process's
        loan = None
    if loan is None:
        loan = _LENDING.claim(pool)
        if loan is None:
            return None
        try:
            loan.connection = checkout(pool)
        except BaseException:
            _LENDING.give_up(pool, loan)
            raise
        loans[pool] = loan
    elif loan.in_use:
        return None
    else:
        loan.settle()  # a reply left to read comes first: no exchange reads it as its own
    loan.in_use = True
    return loan


class PooledConnection:
    """``with PooledConnection(client) as connection``: a connection of the pool of ``client`` (a
    plain ``redis.Redis``) for one exchange.

    A thread keeps the same connection between its exchanges (a ``ConnectionPool``
    or Sentinel's left at redis-py's default ``max_connections``; any other pool
    lends one per exchange, as redis-py does), so that
    an exchange costs no checkout: one per thread and pool, given back when the
    thread ends. As the pool does, each exchange starts on a connected one with
    nothing to read (else it is connected afresh); a reply ``send_later`` left
    pending on it is read, and handed over, first. It is dropped unless the
    exchange ended cleanly (a reply, or a complete error reply): an exception
    between a send and its read (a timeout, a ``KeyboardInterrupt``, a Celery
    time limit) would otherwise leave a late reply for its next exchange to read
    as its own.

    ``resends=True``: the caller's command answers a second run as it answered the
    first (``Script(idempotent=True)``), and is sent once more, on a new connection,
    when its first send finds the connection broken and ``unpolled`` is set; a
    fresh loaned connection is then not polled first (``_stale``).
    """

    __slots__ = ("connection", "loan", "pool", "resends", "unpolled")

    def __init__(self, client: Any, resends: bool = False) -> None:
        self.pool = client.connection_pool
        self.resends = resends
        #: the connection was not polled before the exchange (``resends``, and fresh: ``_stale``)
        self.unpolled = False

    def __enter__(self) -> Any:
        self.loan = loan = _loan(self.pool)
        if loan is None:
            self.connection = checkout(self.pool)
            return self.connection
        self.connection = connection = loan.connection
        try:
            fresh = self.resends and time.monotonic() < loan.fresh_until
            self.unpolled = not _connect_clean(connection, fresh)
        except BaseException:
            loan.in_use = False
            raise
        return connection

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        clean = kind is None or issubclass(kind, redis.exceptions.ResponseError)
        if not clean:
            self.connection.disconnect()  # interrupted between send and read: a late reply must reach no one
        if self.loan is None:
            self.pool.release(self.connection)
        else:
            if clean:
                self.loan.fresh_until = time.monotonic() + FRESH_FOR
            self.loan.in_use = False


def send_later(client: Any, command: bytes, read: Callable[[Any], Any], then: Callable[[Any], None]) -> bool:
    """Send ``command`` (packed RESP) on this thread's loaned connection of the pool of ``client``
    (a plain ``redis.Redis``) and return without its reply; ``False``, nothing sent, where the pool
    lends per exchange (``PooledConnection``: the connection would go back to the pool).

    The reply is read (``read(connection)``) and handed to ``then`` (the reply, an error reply
    as its exception) at the first of ``settle_later(client)`` and the next exchange this thread
    starts on that connection, which reads it first (``_Loan.settle``). A forked child never
    reads its parent's pending reply, and a thread that ends with one drops the connection.
    ``False`` also where connecting failed (a Redis error; the caller sends it the way that
    waits, with the client's retry policy); an interrupt then raises, nothing sent. Once the
    send began, an exception (the send failed, or an interrupt right after it) leaves the
    outcome unknown: the connection is dropped and ``then`` gets the exception, which then
    propagates unless a Redis error.
    """
    loan = _loan(client.connection_pool)
    if loan is None:
        return False
    try:
        connection = loan.connection
        try:
            _connect_clean(connection)
        except BaseException as exc:
            connection.disconnect()
            if isinstance(exc, redis.exceptions.RedisError):
                return False
            raise
        loan.pending = pending = _Pending(read, then)  # from here on, the command may have been sent
        try:
            connection.send_packed_command([command])
        except BaseException as exc:
            loan.pending = None
            connection.disconnect()
            pending.then(exc)
            if not isinstance(exc, redis.exceptions.RedisError):
                raise
    finally:
        loan.in_use = False
    return True


def settle_later(client: Any) -> None:
    """Read and hand over the reply ``send_later`` left pending on this thread's loaned connection
    of the pool of ``client``, if it is still unread (else nothing: also for a ``RedisCluster``,
    which has no pool of its own and never sends later)."""
    pool = getattr(client, "connection_pool", None)
    loan = None if pool is None else _LOANS.by_pool.get(pool)
    if loan is not None and loan.pid == current_pid() and not loan.in_use:
        loan.settle()


def _connect_clean(connection: Any, fresh: bool = False) -> bool:
    """Connect ``connection`` if it is not, afresh if it has something to read (``_stale``; ``fresh``:
    see there). Returns whether it was polled (``False``: fresh, and only the bytes read ahead
    were looked at). A connected one is not asked to connect: redis-py 8's ``connect()`` runs its
    retry policy even then."""
    if getattr(connection, "_sock", None) is None:  # its private socket (see ``_stale``)
        _connect(connection)
    stale = _stale(connection, fresh)
    if stale:
        connection.disconnect()
        _connect(connection)
    return stale is not None


def checkout(pool: Any) -> Any:
    """``pool.get_connection()``: a connection of ``pool``, connected. Cut short in its handshake
    by anything but a Redis error (an interrupt, a soft time limit: redis-py cleans up after a
    Redis error only), the pool's idle connections are dropped, connected afresh on their next
    use: redis-py put the half-connected one back among them, where it counts as connected, the
    handshake's reply maybe unread (the next exchange on it would read it as its own) or its
    database not selected yet."""
    try:
        return pool.get_connection()
    except redis.exceptions.RedisError:
        raise
    except BaseException:
        pool.disconnect(inuse_connections=False)
        raise


def _connect(connection: Any) -> None:
    """``connection.connect()``; cut short in its handshake by anything but a Redis error (see
    ``checkout``), it is dropped, not left counting as connected."""
    try:
        connection.connect()
    except BaseException:
        connection.disconnect()
        raise


def _stale(connection: Any, fresh: bool = False) -> bool | None:
    """Whether ``connection`` (connected, between exchanges) has something to read before a send:
    the server closed it (a restart, an idle timeout), or sent what no request asked for;
    ``None``: not polled (``fresh``, below), and nothing read ahead is held.

    Where redis-py's own parser reads (its private ``_parser._buffer`` a ``SocketBuffer``), bytes
    it read ahead and holds unread tell, else one ``poll`` of its private ``_sock`` (a plain TCP
    or Unix socket; ``tests/test_redis_internals.py`` checks both are there) instead of
    ``can_read``'s three syscalls (saves ~2 µs CPU per exchange, measured). Any other socket
    (TLS keeps decrypted bytes of its own), parser (hiredis), a redis-py that no longer has
    that buffer class where it is looked for, and a platform without ``poll`` ask ``can_read``.

    A ``fresh`` connection (its last reply read completely less than ``FRESH_FOR`` seconds
    ago) is not polled when its caller asks so (``PooledConnection(resends=True)``: a script
    whose second run answers as its first, ``ACQUIRE``): the ``poll`` is the costliest step of
    a busy worker's exchange (about 4 µs of a pool child's CPU, measured in a worker's tracer),
    and what it looks for is a connection closed while idle. One the server closed since breaks
    the send or its read, and the script is sent again on a new connection; its answer is the
    one the first send would have had. Any other exchange is polled: after a broken connection
    a second run of a release finds 0 whether the first freed the key or the key was lost
    meanwhile, where a poll would have sent the first on a new connection and known.
    """
    sock = getattr(connection, "_sock", None)
    buffer: Any = getattr(getattr(connection, "_parser", None), "_buffer", None)
    if type(sock) is socket.socket and type(buffer) is _SOCKET_BUFFER and _POLL is not None:
        if buffer.unread_bytes():
            return True
        if fresh:
            return None
        poller = _POLL()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))  # readable, hung up or in error: stale alike
    try:
        return bool(connection.can_read())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
        return True


#: How long (seconds) after its last reply a loaned connection counts as fresh: not polled before
#: an idempotent script (``_stale``). Half of Redis's shortest idle ``timeout`` (1 s); one closed
#: within it anyway (a restart, a failover) costs a second send.
FRESH_FOR = 0.5
#: ``select.poll`` where the platform has it (not Windows).
_POLL = getattr(select, "poll", None)


#: What a failed exchange with Redis raises (unreachable, refused, timed out, an error reply):
#: a handler that means Redis failures catches these, and lets anything else (an interrupt: a
#: Celery soft time limit is an ``Exception`` too) propagate.
FAILURES = (redis.exceptions.RedisError, OSError)


#: ``reply_grace`` of a client without a ``socket_timeout`` (one that would wait forever).
REPLY_GRACE = 5.0


def reply_grace(client: Any) -> float:
    """How late past its own timeout a blocking command's reply (BLPOP's) may come before the
    server counts as gone (seconds): as long as the client waits for any other reply, its
    ``socket_timeout``, else ``REPLY_GRACE``. A server busy with another client's long command
    (a script, a big ``KEYS``) answers everyone late, its blocked clients too."""
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    return float(timeout) if timeout else REPLY_GRACE


def call_with_timeout(client: redis.Redis, timeout: float, *command: str | int) -> Any:
    """Send ``command`` and wait at most ``timeout`` seconds for the reply to start.

    The wait is a ``select`` on the socket, so it neither polls nor depends on
    ``socket_timeout`` (which may be None: wait forever). No reply in time
    raises ``redis.TimeoutError`` (the connection is dropped, see ``PooledConnection``).
    """
    with PooledConnection(client) as connection:
        connection.send_command(*command)
        if not connection.can_read(timeout):
            raise redis.exceptions.TimeoutError(f"no reply to {command[0]} within {timeout:.3f}s")
        return connection.read_response()


async def call_with_timeout_async(client: Any, timeout: float, *command: str | int) -> Any:
    """``call_with_timeout`` for a ``redis.asyncio.Redis``: the reply must start within ``timeout``.

    The connection is dropped when the exchange did not end cleanly (no reply
    in time, cancelled, broken), so a late reply is never read by its next user.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_command(*command)
        try:  # math.inf: no socket_timeout for this read; the deadline is ``deadline``'s
            async with deadline(timeout):
                return await connection.read_response(timeout=math.inf)
        except asyncio.TimeoutError:
            raise redis.exceptions.TimeoutError(f"no reply to {command[0]} within {timeout:.3f}s") from None
    except redis.exceptions.ResponseError:
        raise  # a complete error reply: the connection is clean
    except BaseException:
        await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)
