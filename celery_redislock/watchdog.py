"""One renewer per process for every held lock that asked for one.

Contract:

* A lease is renewed every ``interval`` (``ttl / 3``) counted from the send
  time of its last successful renewal; leases that fall due close together are
  renewed together: one round trip per server (each Cluster node, each
  Redlock server), carrying one script call per Cluster hash slot and
  ``BATCH`` leases. A call that a Cluster node redirects (MOVED, ASK: the
  slot is moving) is sent again through the Cluster client, which follows it.
  Renewals use connections of the watchdog's own whose
  connect and read timeouts are half an interval (each tried once, not under
  the client's retry policy), and several servers are
  renewed side by side (a thread each, for the tick), so a stalled server or
  network can neither stop the thread from reporting a loss nor starve the
  leases held on other servers, however many clients of it the leases came
  with: they are still renewed well within their TTL.
  An exchange that ends early, however, drops its connection, so that a late
  reply is never read as the answer to the next tick's renewals.
* A renewal checks only the token, so it must never reach Redis after its
  owner changed the hold. It is *in flight* from the moment the watchdog picks
  its lease until its reply is read or the exchange failed. An owner changing
  the hold first waits until no renewal of it is in flight, and keeps it from
  being picked meanwhile: ``discard()`` before a release or a hand-over (a task
  parking its lock for a retry, keeping it for its period), ``changing()``
  around ``extend()``. So a renewal lands before the change, never after it,
  and cannot reset a parked, settled or extended hold to the lease. The wait
  is short (a renewal on the watchdog's connections ends within half an
  interval) and bounded: after one interval the owner logs a WARNING and goes
  on, the one case (a server stalled that long) where a late renewal may still
  be applied after the change. A renewal of a discarded lease is owner-checked
  in Redis, so it can neither resurrect nor extend a released lock, and its
  result is ignored.
* A lease whose renewal answers "not owned" is lost at once; one whose
  renewals fail (Redis unreachable) until ``last success + ttl`` is lost then.
  A lost lease is renewed no more; its owner's ``lost`` event is set by the
  renewing thread, after the tick's renewals have landed (no owner waits for
  them). Then the ERROR log naming the key and the ``lock_lost`` signal are
  sent, in order, by a thread of their own (started with the first report,
  gone when none is left), so that a slow receiver or log handler never holds
  up the renewal of other locks, nor the ``lost`` event of later losses.
* The threads never raise; the renewing thread exits when nothing is left to renew and starts
  again with the next lease, also after a start that raised (no thread could be made, or an
  interrupt such as a soft time limit landed in it); one renews at a time. After ``fork()``
  the child starts with no leases and its own thread: a lease is renewed only by the process
  that took it.
* A lease whose lock object was garbage-collected is dropped (left to expire),
  so renewal never outlives what it guards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time as mod_time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import signals, telemetry
from ._process import current_pid
from ._scripts import RENEW, bulk, read_replies

__all__ = [
    "BATCH",
    "Lease",
    "LeaseOwner",
    "LeaseSet",
    "Watchdog",
    "announce_loss",
    "failed_renewal",
    "get_watchdog",
    "landing_late",
    "mark_lost",
    "renewal_answered",
]

logger = logging.getLogger(__name__)

#: Most leases renewed by one script call (one round trip).
BATCH = 2000
#: Seconds after which an unused renewal connection is closed.
_IDLE = 120.0


class LeaseOwner(Protocol):
    """The lock object a lease renews a hold of (``RedisLock``, ``Redlock``, ``AsyncRedisLock``)."""

    def lease_lost(self, lease: Lease) -> bool:
        """The watchdog found ``lease`` lost and renews it no more: whether that loses the owner's
        hold (it then set its ``lost``), which the watchdog logs and signals."""


class Lease:
    """One hold to renew: ``key`` owned by ``token`` on ``client`` for ``ttl`` seconds.

    ``owner`` refers to the lock object (a ``LeaseOwner``; a weak reference, so
    None once it is gone), whose ``lease_lost(lease)`` says whether a loss of
    this lease is its loss.
    """

    __slots__ = (
        "cancelled",
        "changing",
        "client",
        "due",
        "expires",
        "group",
        "in_flight",
        "interval",
        "key",
        "owner",
        "packed",
        "token",
        "ttl",
    )

    def __init__(
        self, client: Any, key: str, token: str, ttl: float, owner: Callable[[], LeaseOwner | None]
    ) -> None:
        self.client, self.key, self.token, self.ttl, self.owner = client, key, token, ttl, owner
        #: seconds between renewals (ttl / 3)
        self.interval = 0.0
        #: monotonic time of the next renewal
        self.due = 0.0
        #: monotonic time at which the hold runs out unless renewed
        self.expires = 0.0
        #: set by ``discard()``; results of a renewal in flight are then ignored
        self.cancelled = False
        #: picked for a renewal whose reply is not read yet (set and cleared by the watchdog)
        self.in_flight = False
        #: its owner is changing the hold (``extend()``): not picked for renewal meanwhile
        self.changing = False
        #: key and token as RESP bulk strings, packed by the first renewal
        self.packed: tuple[bytes, bytes] | None = None
        #: (id of client, Cluster hash slot or 0, ttl in ms): the leases renewed
        #: by one script call share it; set by the watchdog, reset with ``ttl``
        self.group: tuple[int, int, int] | None = None

    def renewed(self, ttl: float, sent_at: float) -> None:
        """Redis set the lease to ``ttl`` on a request sent at ``sent_at``."""
        self.ttl, self.interval, self.group = ttl, ttl / 3, None
        self.due, self.expires = sent_at + self.interval, sent_at + ttl

    def maybe_renewed(self, ttl: float, sent_at: float) -> None:
        """Redis may have set the lease to ``ttl`` on a request sent at ``sent_at`` (interrupted,
        or failed, after its send): renewed (to its own ``ttl``) in time for either TTL."""
        self.due, self.expires = min(self.due, sent_at + ttl / 3), min(self.expires, sent_at + ttl)

    def pack(self, encoder: Any) -> tuple[bytes, bytes]:
        """Key and token as RESP bulk strings, encoded by ``encoder`` (the client's), kept in ``packed``."""
        self.packed = (bulk(encoder.encode(self.key)), bulk(self.token.encode()))
        return self.packed


class LeaseSet:
    """The leases one renewer renews (a thread, or an asyncio task), and its choices that do not
    depend on how it waits: when it must wake, which leases to renew now and together, what a
    reply means. Only its renewer and the owners of its leases call it, never two at once (the
    thread renewer and owners hold its condition's lock around each call that changes it)."""

    def __init__(self) -> None:
        self.leases: set[Lease] = set()
        #: when the sleeping renewer will wake by itself (-inf or inf while it is busy: an owner
        #: adding a lease then need not wake it)
        self.wake_at = -math.inf

    def __len__(self) -> int:
        return len(self.leases)

    def track(self, lease: Lease, sent_at: float) -> bool:
        """Renew ``lease``, acquired by a request sent at monotonic ``sent_at``; whether the
        renewer must be woken to renew it on time."""
        lease.renewed(lease.ttl, sent_at)
        self.leases.add(lease)
        return lease.due < self.wake_at

    def retime(self, lease: Lease, ttl: float, sent_at: float, known: bool = True) -> bool:
        """``lease`` was set to ``ttl`` by a request sent at ``sent_at``: renew it to that from now
        on (if still renewed); ``known=False``: it may have been (the request's outcome is
        unknown), renew it in time for either. Whether the renewer must be woken for it."""
        if lease not in self.leases:
            return False
        if known:
            lease.renewed(ttl, sent_at)
        else:
            lease.maybe_renewed(ttl, sent_at)
        return lease.due < self.wake_at

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``; the results of a renewal in flight are then ignored."""
        lease.cancelled = True
        self.leases.discard(lease)

    def next_due(self) -> float:
        """When the first lease that may be picked falls due (monotonic; inf: none may)."""
        return min((lease.due for lease in self.leases if not lease.changing), default=math.inf)

    def pick(self, now: float) -> list[Lease]:
        """The leases to renew at ``now``: due within half their interval, not being changed by
        their owner. They are marked in flight until the renewer lands them."""
        batch = [
            lease for lease in self.leases if not lease.changing and lease.due - lease.interval / 2 <= now
        ]
        for lease in batch:
            lease.in_flight = True
        return batch

    def batches(self, leases: list[Lease]) -> dict[tuple[int, int, int], list[list[Lease]]]:
        """``leases`` in batches one RENEW call renews: one client, Cluster hash slot and lease
        length (the key), at most ``BATCH`` leases. A lease whose lock object is gone is dropped
        (left to expire)."""
        groups: dict[tuple[int, int, int], list[Lease]] = defaultdict(list)
        for lease in leases:
            if lease.owner() is None:
                self.drop(lease)
                continue
            groups[lease.group or _group(lease)].append(lease)
        return {
            key: [group[start : start + BATCH] for start in range(0, len(group), BATCH)]
            for key, group in groups.items()
        }


class Watchdog(LeaseSet):
    """Renews leases in batches on a daemon thread; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = current_pid()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: losses to log and signal (lock, reason), and the thread doing it
        self._reports: deque[tuple[Any, str]] = deque()
        self._reporter: threading.Thread | None = None
        #: the thread's own connections: (id of client or Cluster node, timeout)
        #: -> (that client, connection, monotonic time of last use)
        self._connections: dict[tuple[int, float], tuple[Any, Any, float]] = {}

    def add(self, lease: Lease, sent_at: float) -> None:
        """Renew ``lease``, acquired by a request sent at monotonic ``sent_at``.

        Raises what starting the renewing thread raised (``RuntimeError``: no thread could be
        made; an interrupt such as a soft time limit): the lease is kept, and renewed once a
        later ``add`` starts the thread."""
        with self._cond:
            late = self.track(lease, sent_at)
            if self._thread is None:  # recorded once started: after a start that raised, none is
                self._thread = self._started_thread()
            elif late:  # wake the thread only when it would be late
                self._cond.notify_all()

    def discard(self, lease: Lease) -> None:
        """Stop renewing ``lease``, before its owner releases or hands over the hold: returns once
        no renewal of it is in flight."""
        with self._cond:
            self.drop(lease)
            self._await_landing(lease)

    @contextlib.contextmanager
    def changing(self, leases: Iterable[Lease]) -> Iterator[None]:
        """While the owner changes the hold of ``leases`` (``extend()``): no renewal of them is in
        flight, and none is picked. Interrupted while it waits (a soft time limit), they are
        picked again: a lease left marked would never be renewed, nor found lost."""
        leases = list(leases)
        try:
            with self._cond:
                for lease in leases:
                    lease.changing = True
                    self._await_landing(lease)
            yield
        finally:
            with self._cond:
                for lease in leases:
                    lease.changing = False
                self._cond.notify_all()  # one may be due: the thread did not count it

    def reschedule(self, lease: Lease, ttl: float, sent_at: float, known: bool = True) -> None:
        """``lease`` was (``known=False``: may have been) set to ``ttl`` by a request sent at
        ``sent_at``: renew it accordingly from now on (``LeaseSet.retime``)."""
        with self._cond:
            if self.retime(lease, ttl, sent_at, known):
                self._cond.notify_all()

    def _await_landing(self, lease: Lease) -> None:
        """Holding ``_cond``: wait until no renewal of ``lease`` is in flight (see the module docstring)."""
        if lease.in_flight and not self._cond.wait_for(lambda: not lease.in_flight, lease.interval):
            landing_late(lease)

    def _run(self) -> None:
        with self._cond:
            # ``add`` records the thread once started: one whose start raised after it began (an
            # interrupt) finds none recorded and renews, unless ``add`` started another since
            if self._thread is None:
                self._thread = threading.current_thread()
            if self._thread is not threading.current_thread():
                return
        try:
            self._renew_until_idle()
        finally:  # ended by what no loop catches (a BaseException): another thread takes over
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                    with contextlib.suppress(RuntimeError):  # the interpreter is shutting down
                        self._thread = self._started_thread()

    def _started_thread(self) -> threading.Thread:
        """A renewing thread (``_run``), started."""
        return _started(self._run, "celery-redislock-watchdog")

    def _renew_until_idle(self) -> None:
        """Renew the leases as they fall due, until none is left."""
        while True:
            try:
                batch = self._next_batch()
                if batch is None:
                    return
                try:
                    self._renew(batch)
                finally:
                    self._land(batch)  # also when renewing failed unexpectedly
            except Exception:  # the thread must survive anything
                logger.exception(
                    "celery-redislock watchdog: unexpected error; carrying on",
                    extra=telemetry.log_fields(outcome="error"),
                )
                with self._cond:
                    self._cond.wait(0.1)

    def _next_batch(self) -> list[Lease] | None:
        """Waits until a lease is due; returns every lease due within half its interval."""
        with self._cond:
            now = mod_time.monotonic()
            while True:
                if not self.leases:
                    self._thread = None
                    return None
                earliest = self.next_due()
                if earliest <= now:
                    break
                self.wake_at = earliest
                notified = self._cond.wait(None if earliest == math.inf else earliest - now)
                now = mod_time.monotonic()
                if not notified:  # the earliest lease is due, even if the clock reads a hair early
                    now = max(now, earliest)
                    break
            self.wake_at = -math.inf
            return self.pick(now)

    def _land(self, leases: Iterable[Lease]) -> None:
        """The renewals of ``leases`` are answered (or given up): their owners may go on."""
        with self._cond:
            for lease in leases:
                lease.in_flight = False
            self._cond.notify_all()

    def _renew(self, leases: list[Lease]) -> None:
        # Per server and lease length: its batches (one hash slot each, at most BATCH leases).
        nodes: dict[tuple[int, int], tuple[Any, list[list[Lease]]]] = {}
        lost: list[tuple[Lease, str]] = []
        for (_, slot, ttl_ms), batches in self.batches(leases).items():
            try:
                node = _node(batches[0][0].client, slot)
            except redis.exceptions.RedisError as exc:  # its slot is not covered (a Cluster changing)
                lost += failed_renewal([lease for batch in batches for lease in batch], exc)
                continue
            nodes.setdefault((id(node), ttl_ms), (node, []))[1].extend(batches)
        exchanges = []
        for (_, ttl_ms), (node, batches) in nodes.items():
            try:
                exchanges.append((self._connection(node, batches[0][0].interval / 2), batches, ttl_ms))
            except Exception as exc:  # no connection could be made: that server's renewal failed
                lost += failed_renewal([lease for batch in batches for lease in batch], exc)
        lost += [found for each in _side_by_side(self._renew_server, exchanges) for found in each]
        self._land(leases)  # all answered: the losses are reported with no renewal in flight
        for lease, reason in lost:
            self._report(lease, reason)

    def _renew_server(self, connection: Any, batches: list[list[Lease]], ttl_ms: int) -> _Found:
        """``_renew_node``, its leases landed as soon as it is over (not held up by other servers')."""
        try:
            return self._renew_node(connection, batches, ttl_ms)
        finally:
            self._land(lease for batch in batches for lease in batch)

    def _renew_node(self, connection: Any, batches: list[list[Lease]], ttl_ms: int) -> _Found:
        """Renews ``batches``, all on the server of ``connection`` (the watchdog's, ``_connection``),
        in one round trip: one script call per batch, sent in one write. Returns the leases found
        lost, with why."""
        sent_at = mod_time.monotonic()
        try:
            replies = _exchange(connection, batches, ttl_ms)
        except Exception as exc:  # Redis unreachable, stalled, or refusing: retry until the leases run out
            connection.disconnect()  # a reply may still be on its way: the next tick must not read it
            return failed_renewal([lease for batch in batches for lease in batch], exc)
        except BaseException:
            connection.disconnect()
            raise
        found: list[tuple[Lease, str]] = []
        for batch, reply in zip(batches, replies, strict=True):
            if isinstance(reply, redis.exceptions.ResponseError):  # e.g. MOVED, ASK: a Cluster resharding
                found += self._renew_through_client(batch, ttl_ms, sent_at, reply)
                continue
            found += renewal_answered(batch, ttl_ms, sent_at, reply)
        return found

    def _renew_through_client(
        self, batch: list[Lease], ttl_ms: int, sent_at: float, error: Exception
    ) -> list[tuple[Lease, str]]:
        """Renews ``batch`` through its client, which follows redirects (MOVED, ASK) and learns the
        Cluster's new layout; for a call refused by the node the watchdog asked directly."""
        logger.info(
            "celery-redislock watchdog: %r; renewing %d lock(s) through the client",
            error,
            len(batch),
            extra=telemetry.log_fields(outcome="redirected"),
        )
        try:
            keys, tokens = [lease.key for lease in batch], [lease.token for lease in batch]
            not_owned = RENEW(batch[0].client, keys, [ttl_ms, *tokens])
        except Exception as exc:
            return failed_renewal(batch, exc)
        return renewal_answered(batch, ttl_ms, sent_at, not_owned)

    def _connection(self, client: Any, timeout: float) -> Any:
        """The thread's connection to the server of ``client``, with ``timeout`` for connect and reads,
        each tried once: not under the client's retry policy, whose tries and backoffs (redis-py
        8.1's default: 11 tries) would hold a connect never answered up for many timeouts.

        Connections unused for ``_IDLE`` seconds are closed, and with them the
        reference to their client (which keeps ids from being reused meanwhile).
        """
        now = mod_time.monotonic()
        for slot, (_, idle, last_used) in list(self._connections.items()):
            if now - last_used > _IDLE:
                idle.disconnect()
                del self._connections[slot]
        slot = (id(client), timeout)
        if slot in self._connections:
            connection = self._connections[slot][1]
        else:
            pool = client.connection_pool
            kwargs = {
                **pool.connection_kwargs,
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "retry": Retry(NoBackoff(), 0),
            }
            connection = pool.connection_class(**kwargs)
        self._connections[slot] = (client, connection, now)
        return connection

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (the watchdog's own ``discard()``, with no wait)."""
        with self._cond:
            super().drop(lease)

    def _report(self, lease: Lease, reason: str) -> None:
        with self._cond:
            if lease.cancelled:  # released meanwhile: nothing was lost
                return
            self.drop(lease)
        lock = mark_lost(lease)
        if lock is None:
            return
        with self._cond:
            self._reports.append((lock, reason))
            if self._reporter is None:  # as in ``add``: none recorded if it could not start
                self._reporter = _started(self._announce, "celery-redislock-loss-reports")

    def _announce(self) -> None:
        """The reporting thread: logs and signals the losses in order, until none is left."""
        while True:
            with self._cond:
                if not self._reports:
                    self._reporter = None
                    return
                lock, reason = self._reports.popleft()
            try:
                announce_loss(lock, reason)
            # the thread must survive what a receiver raises, its sys.exit() too; not an exit
            # thrown into it (gevent's GreenletExit, killing the greenlet it is under gevent)
            except (Exception, SystemExit):
                logger.exception(
                    "celery-redislock watchdog: reporting a lost lock failed; carrying on",
                    extra=telemetry.log_fields(outcome="error"),
                )


def landing_late(lease: Lease) -> None:
    """An owner waited a whole interval for a renewal of ``lease`` to land, and goes on."""
    logger.warning(
        "lock %r: a renewal is still unanswered after %.1fs; changing the hold anyway",
        lease.key,
        lease.interval,
        extra=telemetry.log_fields(lease.key),
    )


def mark_lost(lease: Lease) -> Any:
    """Tell ``lease``'s lock it lost its hold (once taken out of its watchdog); the lock if it
    counts it as its loss (its ``lost`` is set), else None."""
    lock = lease.owner()
    return lock if lock is not None and lock.lease_lost(lease) else None


def announce_loss(lock: Any, reason: str) -> None:
    """The ERROR log and the ``lock_lost`` signal of ``lock``'s loss of its hold, both naming the
    lock (``lock.name``, the key its other signals name), not the key its lease renewed (a
    semaphore's permit)."""
    logger.error(
        "lock %r lost (%s): it is no longer held by this owner",
        lock.name,
        reason,
        extra=telemetry.log_fields(lock.name, holder=getattr(lock, "holder", None), outcome=reason),
    )
    # an execution lock names its task; a lock of no task counts as ""
    telemetry.lost(getattr(lock, "task_name", ""), reason)
    signals.lock_lost.send(sender=lock, key=lock.name, reason=reason)


def renewal_answered(
    batch: list[Lease], ttl_ms: int, sent_at: float, not_owned: list[int]
) -> list[tuple[Lease, str]]:
    """A RENEW call of ``batch`` sent at ``sent_at`` answered ``not_owned`` (1-based positions):
    the leases are renewed to ``ttl_ms`` from then; returns those found lost (rescheduled too,
    harmlessly: they are dropped when reported)."""
    due, expires = sent_at + ttl_ms / 3000, sent_at + ttl_ms / 1000
    for lease in batch:
        lease.due, lease.expires = due, expires
    telemetry.renewals(len(batch) - len(not_owned), "renewed")
    telemetry.renewals(len(not_owned), "failed")
    return [(batch[position - 1], "not owned") for position in not_owned]


def failed_renewal(
    leases: list[Lease], error: Exception, watchdog: str = "celery-redislock watchdog"
) -> list[tuple[Lease, str]]:
    """A renewal of ``leases`` by ``watchdog`` failed (``error``: Redis unreachable, stalled,
    refusing, or a Cluster slot not covered): logged, retried soon; those past their lease are
    lost."""
    logger.warning(
        "%s: renewing %d lock(s) failed: %r",
        watchdog,
        len(leases),
        error,
        extra=telemetry.log_fields(outcome="renewal-failed"),
    )
    now = mod_time.monotonic()
    for lease in leases:
        lease.due = now + min(lease.interval / 3, 1.0)
    telemetry.renewals(len(leases), "failed")
    return [(lease, "expired") for lease in leases if now >= lease.expires]


def _exchange(connection: Any, batches: list[list[Lease]], ttl_ms: int) -> list[Any]:
    """Sends one RENEW call per batch on ``connection`` in one write; returns each call's reply,
    or its own error (e.g. MOVED)."""
    encoder = connection.encoder
    commands = []
    for batch in batches:
        packed = [lease.packed or lease.pack(encoder) for lease in batch]
        keys, tokens = [key for key, _ in packed], [token for _, token in packed]
        commands.append(RENEW.pack(keys, [bulk(b"%d" % ttl_ms), *tokens]))
    connection.send_packed_command(commands)
    return read_replies(connection, RENEW, commands)


#: The leases a renewal found lost, each with why (``"not owned"``, ``"expired"``).
_Found = list[tuple[Lease, str]]


def _side_by_side(renew: Callable[..., _Found], exchanges: list[tuple[Any, ...]]) -> list[_Found]:
    """``renew(*exchange)`` for each of ``exchanges`` (one per server), their results in order:
    each server's in a thread of its own when there are several, so that a stalled server (its
    connect, its reply: up to half an interval each) holds up no other server's renewals, however
    many clients of it the leases came with. Daemon threads of the tick's own, not a thread pool,
    which refuses work once the interpreter shuts down (and locks held by a thread it waits for
    still need renewing then); one that cannot start renews on this thread. An exception one
    raised is raised here, once all are over."""
    if len(exchanges) < 2:
        return [renew(*exchange) for exchange in exchanges]
    outcomes: list[tuple[_Found, BaseException | None]] = [([], None)] * len(exchanges)

    def run(index: int) -> None:
        try:
            outcomes[index] = (renew(*exchanges[index]), None)
        except BaseException as exc:  # raised on the watchdog's thread, once all are over
            outcomes[index] = ([], exc)

    threads = []
    for index in range(len(exchanges)):
        try:
            threads.append(_started(functools.partial(run, index), "celery-redislock-renewal"))
        except RuntimeError:  # no thread could be started: renewed here, after the others'
            run(index)
    for thread in threads:
        thread.join()
    for _, exc in outcomes:
        if exc is not None:
            raise exc
    return [found for found, _ in outcomes]


def _started(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running ``target``, started."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _node(client: Any, slot: int) -> Any:
    """The plain client of the server that serves ``slot``: ``client`` itself, or its Cluster node."""
    if isinstance(client, redis.cluster.RedisCluster):
        return client.nodes_manager.get_node_from_slot(slot).redis_connection
    return client


def _group(lease: Lease) -> tuple[int, int, int]:
    """Sets and returns ``lease.group``: (client, Cluster hash slot, lease length), renewed together."""
    client = lease.client
    cluster = isinstance(client, redis.cluster.RedisCluster)
    lease.group = (id(client), client.keyslot(lease.key) if cluster else 0, round(lease.ttl * 1000))
    return lease.group


# The one per-process watchdog (by contract) and what guards its creation;
# both are replaced in a forked child, whose inherited ones belong to the parent.
_watchdog: Watchdog | None = None
_create = threading.Lock()
_fork_hook_registered = False


def _forget_after_fork() -> None:
    global _watchdog, _create
    _watchdog = None
    _create = threading.Lock()


def get_watchdog() -> Watchdog:
    """This process's watchdog, created on first use and again after ``fork()``."""
    global _watchdog, _fork_hook_registered
    watchdog = _watchdog
    if watchdog is not None and watchdog.pid == current_pid():
        return watchdog
    with _create:
        if _watchdog is None or _watchdog.pid != current_pid():
            if not _fork_hook_registered:
                os.register_at_fork(after_in_child=_forget_after_fork)
                _fork_hook_registered = True
            _watchdog = Watchdog()
        return _watchdog
