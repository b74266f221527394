"""What ``RedisLock`` (one server) and ``Redlock`` (a quorum) share: holding a lock over its servers.

``LeaseLock`` takes, keeps and gives back a hold: the acquire loop (driving
``attempt.Attempt``), re-entry, release, extend, the watchdog's leases and
the doors the task layer uses (``busy``, ``held()``, ``try_as()``, ``wait_as()``,
``take_hold()``, ``give_back()``, ``stop_renewing()``, ``forget()``, ``renewals_on_time()``,
``lease_lost()``), and ``release_unless_busy()`` for a release from a signal
handler. Where the key lives is its ``servers`` (a ``Servers``): the one server
(``lock.OneServer``) or a quorum of several (``redlock.Quorum``), which run the
scripts and read their replies.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time as mod_time
import weakref
from typing import Any, Protocol, TypeVar

from ._durations import Duration
from .attempt import Attempt, LockCore, ending_block, lease_seconds
from .exceptions import LockNotAcquired, LockNotOwned, LockNotReplicated
from .telemetry import log_fields
from .watchdog import Lease, get_watchdog

__all__ = ["LeaseLock", "Servers"]

logger = logging.getLogger(__name__)

_Lock = TypeVar("_Lock", bound="LeaseLock")
#: held only while a lock's ``lost`` event is made, so that two threads asking at once get one
_MAKING_LOST = threading.Lock()


def _forked() -> None:
    # A thread of the parent may have held it at the fork: the child's first ``lost`` would hang.
    global _MAKING_LOST
    _MAKING_LOST = threading.Lock()


os.register_at_fork(after_in_child=_forked)


class Servers(Protocol):
    """Where a lock's key lives, and how its scripts run there (one server, or a quorum)."""

    #: the client of the (first) server
    client: Any
    #: how many servers must hold the lock for it to be held
    needed: int
    #: whether waiters queue on the server and are woken there (else they try again)
    queues: bool
    #: replicas that must acknowledge a hold (``confirm``); 0: none
    replicas: int

    def __len__(self) -> int:
        """How many servers there are."""

    def acquire(self, attempt: Attempt, mode: str) -> Any:
        """Send ``attempt`` in ``mode``: the fence if granted, else [PTTL in ms or None, holder]."""

    def sleep(self, attempt: Attempt) -> Any:
        """Block before ``attempt``'s next try; the wake message that ended it (None: none)."""

    def abandon(self, token: str, member: str) -> None:
        """Leave the queue, and release the lock if it was granted meanwhile; logs a failure."""

    def free(self, token: str) -> bool:
        """Release ``token``'s hold, owner-checked; whether ``token`` held the lock."""

    def extend(self, token: str, ttl: float) -> bool:
        """Set ``token``'s hold to ``ttl``, owner-checked; whether ``token`` held the lock."""

    def confirm(self, token: str, member: str) -> None:
        """Wait until ``replicas`` replicas have ``token``'s hold; else release it and raise."""

    def leases(self, token: str, ttl: float, owner: weakref.ref[LeaseLock]) -> list[Lease]:
        """The watchdog's leases of the hold just granted to ``token`` (one per server holding it)."""

    def locked(self) -> bool:
        """Whether anyone holds the lock (on enough servers)."""

    def owned(self, token: str | None) -> bool:
        """Whether ``token`` holds the lock (on enough servers), now."""


class LeaseLock(LockCore):
    """A lock on the key ``name`` over ``servers``: see ``lock.RedisLock`` for the contract.

    A subclass checks its own arguments, calls ``__init__`` and sets ``servers``.
    """

    servers: Servers

    def __init__(self, name: str | bytes, ttl: Duration, **settings: Any) -> None:
        """``settings``: ``LockCore``'s (``watchdog``, ``fair``, ``timeout``, ``holder``)."""
        super().__init__(name, ttl, **settings)
        self._lost: threading.Event | None = None
        #: monotonic time the current hold was taken (its ``held`` time counts from it)
        self.taken_at = 0.0
        self._leases: list[Lease] = []
        #: the token of the hold whose release raised (maybe after Redis freed the key), if any
        self._released_maybe: str | None = None
        self._state = threading.Lock()

    @property
    def lost(self) -> threading.Event:  # type: ignore[override]  # LockCore declares it; read-only here
        """Set when the hold is found lost (by the watchdog, a release or an extend); cleared
        when a hold is taken again. Made on first use: a ``threading.Event`` costs 2 µs to make,
        and a task's run that never asks (nothing was lost) makes none."""
        lost = self._lost
        if lost is None:
            with _MAKING_LOST:
                lost = self._lost
                if lost is None:
                    lost = self._lost = threading.Event()
        return lost

    def found_lost(self) -> bool:
        """Whether ``lost`` is set, without making the event where none was made (nothing lost)."""
        lost = self._lost
        return lost is not None and lost.is_set()

    @property
    def client(self) -> Any:
        """The client of the lock's (first) server."""
        return self.servers.client

    # -- acquiring -----------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: Duration | None = None) -> bool:
        """Take the lock; ``True`` once held, ``False`` if not within ``timeout``.

        ``timeout`` (seconds or timedelta; default: the constructor's, where
        ``None`` waits without limit) bounds the wait with one monotonic
        deadline. A waiter sleeps until a release wakes it, or until the
        holder's TTL runs out (a holder that died), never polling. Free lock:
        one round trip. Raises ``LockLost`` when re-entering a hold the
        watchdog found lost.
        """
        deadline = self.deadline(blocking, timeout)
        with self._state:
            if self.reenter():
                return True
        token = secrets.token_hex(16)
        attempt = self.new_attempt(token, blocking, deadline, self.servers.queues)
        fence = self._attempts(attempt)
        if fence is None:
            return False
        try:
            self.take_hold(token, fence, attempt.sent_at)
        except LockNotReplicated:  # given back already
            raise
        except BaseException:  # an interrupt (a soft time limit): nothing else knows the token
            self.give_back(token)
            raise
        return True

    def try_as(self, token: str) -> int | None:
        """One attempt at the lock as ``token``, never queued: the fence once granted (the caller
        records the hold, ``take_hold``), else ``None`` and ``busy`` names the holder. For a hold
        whose token the caller drew first, to give it back owner-checked whatever cuts it short."""
        return self._attempts(self.new_attempt(token, False, None, self.servers.queues))

    def wait_as(self, token: str, deadline: float, *, queued: bool = False, keep: bool = False) -> int | None:
        """Queue for the lock as ``token`` until it is granted or handed over to ``token`` (the
        fence), or until monotonic ``deadline`` (``None``); ``busy`` then names the holder.
        ``queued``: a script queued ``token`` already (``WATCH``); it leaves the queue however
        this ends, also when the deadline passed before the first attempt.

        For a hold prepared for a known token (a retry waiting for its previous attempt to
        park the hold for it): the caller then makes it its own (e.g. ``ADOPT`` re-tokens it,
        and ``take_hold`` records the result). ``keep``: cut short, this leaves a hold granted
        to ``token``, and its place in the queue, as they are: the caller gives them up (a hold
        parked for the token goes as its mode says, maybe kept for the rest of its period).
        """
        attempt = self.new_attempt(token, True, deadline, self.servers.queues)
        attempt.queued = attempt.sent = queued and attempt.queue
        return self._attempts(attempt, keep)

    def take_hold(self, token: str, fence: int, sent_at: float) -> None:
        """Record as this object's the hold ``token`` was granted (``fence``) by a request sent at
        monotonic ``sent_at``: confirmed by ``replicas`` replicas where set (else released and
        ``LockNotReplicated``), then renewed by the watchdog."""
        if self.servers.replicas:
            self.servers.confirm(token, self.member(token))
        with self._state:
            self.record_hold(token, fence)
            self.taken_at = mod_time.monotonic()
            if self._lost is not None:  # none made yet: none set
                self._lost.clear()
            if self.watchdog:
                self._leases = self.servers.leases(token, self.ttl, weakref.ref(self))
                for lease in self._leases:
                    get_watchdog().add(lease, sent_at)

    def give_back(self, token: str) -> None:
        """Free the hold just granted to ``token`` whose recording (``take_hold``) an exception cut
        short, before anything else knows the token. Owner-checked (a no-op if already freed); a
        failure is logged, and the key, unrenewed, expires within ``ttl``, as it does if this is
        interrupted too."""
        with self._state:
            recorded = self.held() and self.token == token
            leases = list(self._leases) if recorded else []
        _discard(leases)
        if recorded:
            self.forget()
        self.servers.abandon(token, self.member(token))

    def _attempts(self, attempt: Attempt, keep: bool = False) -> int | None:
        """Drives ``attempt`` until granted (the fence) or past its deadline (None).

        Interrupted (an exception, KeyboardInterrupt or a Celery time limit
        included) after an attempt may have reached Redis, it leaves the queue
        and releases the lock if it came (not with ``keep``: the caller's, see ``wait_as``).
        """
        try:
            while True:
                fence = attempt.granted(self.servers.acquire(attempt, attempt.mode()))
                if fence is not None:
                    return fence
                self.busy = attempt.busy
                if not attempt.waiting:
                    return None
                fence = attempt.handed(self.servers.sleep(attempt))
                if fence is not None:  # handed over after our last attempt was sent
                    return fence
        except BaseException:
            if attempt.sent and not keep:
                self.servers.abandon(attempt.token, attempt.member)
            raise

    # -- holding -------------------------------------------------------------

    def stop_renewing(self) -> str:
        """Stop renewing the hold (before the caller frees or parks the key) and return its token;
        no renewal of it is in flight any more (see ``watchdog``)."""
        with self._state:
            if not self.held():
                raise LockNotOwned(self.name)
            token, leases = self.token or "", list(self._leases)
        _discard(leases)
        return token

    def forget(self) -> None:
        """Forget the hold, once the caller has freed or parked the key."""
        with self._state:
            self.clear_hold()
            self._leases = []
            self._released_maybe = None

    def renewals_on_time(self) -> bool:
        """Whether the watchdog renews the hold and its last renewal is less than one interval
        late (a late one means this process was paused or cut off: ask Redis, ``extend()``)."""
        with self._state:
            leases = list(self._leases) if self.held() else []
        return bool(leases) and all(mod_time.monotonic() < lease.expires - lease.interval for lease in leases)

    def release(self) -> None:
        """Lower the hold count; at zero, free the key (one round trip, owner-checked).

        Raises ``LockNotOwned`` (changing nothing in Redis) when this object
        does not hold the lock, or no longer does (expired or taken over).
        Renewal stops before the release is sent. On a Redis error, or an
        interrupt (a soft time limit), the outcome is unknown: the exception
        propagates and the hold is kept, so ``release()`` can be retried; a retry
        that finds the key gone counts it as released (the first may have freed
        it), as ``OneServer.free`` counts its client's resends. Unrenewed, the
        key expires within ``ttl`` anyway. While the last release is on its way, the object
        holds nothing: an ``acquire()`` meanwhile (a thread sharing it) takes a hold of its own.
        """
        with self._state:
            if not self.drop_hold():
                return
            token, leases = self.token or "", list(self._leases)
            self.freeing()  # an acquire meanwhile (another thread) takes a hold of its own
        try:
            _discard(leases)  # waits for a renewal in flight: an interrupt may land there too
            released = self._free(token)
        except BaseException:  # maybe sent: a retry finding the key gone counts it as released
            with self._state:
                self._released_maybe = token
                self.kept_after_freeing(token)  # so that release() can be tried again
            raise
        with self._state:
            released = released or self._released_maybe == token
            if self.freed(token):
                self._leases, self._released_maybe = [], None
        if not released:
            raise LockNotOwned(self.name)

    def release_unless_busy(self) -> bool:
        """``release()``, unless this object's state is held at this moment: then nothing, and
        ``False``. For a release from a signal handler: it runs on the thread it interrupted,
        maybe inside a call of this object holding its state (a ``threading.Lock``, not
        re-entrant), which a ``release()`` would wait for forever. Found free, no call on this
        thread holds it, and ``release()`` waits only for other threads, which hold it briefly;
        one holding it at that moment (the watchdog finding the hold lost) also means ``False``.
        """
        if not self._state.acquire(blocking=False):
            return False
        self._state.release()
        self.release()
        return True

    def _free(self, token: str) -> bool:
        """Release ``token``'s hold on the servers; whether ``token`` held the lock."""
        return self.servers.free(token)

    def extend(self, ttl: Duration | None = None) -> None:
        """Set the remaining TTL to ``ttl`` (default: the lock's), replacing it, never adding.

        Owner-checked in one round trip; raises ``LockNotOwned`` (and sets
        ``lost``) when this object does not hold the lock. With the watchdog,
        the hold is renewed to ``ttl`` from then on (every ``ttl/3``); a
        renewal already under way lands first, so it cannot undo the extension.
        """
        new_ttl = self.ttl if ttl is None else lease_seconds(ttl, self.watchdog)
        with self._state:
            if not self.held():
                raise LockNotOwned(self.name)
            token, leases = self.token or "", list(self._leases)
        with get_watchdog().changing(leases):  # no renewal in flight can undo it
            sent_at = mod_time.monotonic()
            try:
                owned = self.servers.extend(token, new_ttl)
                if owned:
                    for lease in leases:
                        get_watchdog().reschedule(lease, new_ttl, sent_at)
            except BaseException:  # interrupted or failed after the send: Redis may have set new_ttl
                for lease in leases:  # (also once it did, before the watchdog was told)
                    get_watchdog().reschedule(lease, new_ttl, sent_at, known=False)
                raise
            if not owned:
                self.lost.set()
                raise LockNotOwned(self.name)

    def locked(self) -> bool:
        """Whether anyone holds the lock (one round trip)."""
        return self.servers.locked()

    def owned(self) -> bool:
        """Whether this object holds the lock, as Redis sees it now (one round trip)."""
        with self._state:
            if not self.held():
                return False
            token = self.token
        return self.servers.owned(token)

    # -- context manager -----------------------------------------------------

    def __enter__(self: _Lock) -> _Lock:
        if not self.acquire():
            holder, ttl = self.busy
            raise LockNotAcquired(self.name, holder, ttl)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        with ending_block(self.name, exc):
            self.release()

    def lease_lost(self, lease: Lease) -> bool:
        """Called by the watchdog: ``lease`` (one server's) is lost; once fewer than the servers
        needed still hold the lock, set ``lost`` and say so (``True``)."""
        with self._state:
            if lease not in self._leases:
                return False
            self._leases.remove(lease)
            if len(self._leases) >= self.servers.needed:
                logger.warning(
                    "lock %r: lost on one server, still held on %d of %d",
                    self.name,
                    len(self._leases),
                    len(self.servers),
                    extra=log_fields(self.name, fence=self.fence),
                )
                return False
            rest, self._leases = self._leases, []
            self.lost.set()
        for other in rest:
            get_watchdog().discard(other)
        return True


def _discard(leases: list[Lease]) -> None:
    """Stop the watchdog renewing ``leases`` (a copy of a hold's); returns once none is in flight."""
    for lease in leases:
        get_watchdog().discard(lease)
