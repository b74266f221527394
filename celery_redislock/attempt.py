"""The lock core: what a lock's arguments may be, and what an acquire does next, without I/O.

An acquire is a run of attempts (the ``ACQUIRE`` script, see ``_scripts``)
by one waiter member. ``Attempt`` decides each one's mode (``try``, ``wait``,
``again``, ``last``) from the deadline and whether the waiter is queued,
reads its reply (a fence: granted; else the holder and its TTL), says how
long to sleep before the next one and reads a wake message (a fair
hand-over's fence). The sync lock (``primitive``, over one server or a
Redlock's quorum) and the asyncio lock (``aio``) drive it, each with its
own I/O. ``LockCore`` is the settings and hold count they all keep; the
argument checks, ``companion_key`` and ``ending_block`` (the release that
ends a ``with`` block) are shared by both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import time as mod_time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._durations import Duration, seconds, to_ms
from ._process import current_pid
from .exceptions import LockConfigurationError, LockLost, LockNotOwned
from .protocol import parse_value, text
from .telemetry import log_fields

if TYPE_CHECKING:
    import asyncio
    import threading

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_REPLICAS",
    "MAX_TTL",
    "MIN_WATCHDOG_TTL",
    "SHORTEST_PAUSE",
    "Attempt",
    "Busy",
    "LockCore",
    "busy_reply",
    "check_holder",
    "companion_key",
    "flag",
    "hostname",
    "is_replica_count",
    "is_utf8",
    "lease_seconds",
    "lock_name",
    "owns",
    "seconds_left",
    "waiter_member",
]

#: Shortest lease the watchdog renews (every ttl/3, so at least every 0.1 s).
MIN_WATCHDOG_TTL = 0.3
#: Longest lease accepted (Redis refuses expiry times past its range).
MAX_TTL = 365 * 24 * 3600.0

#: Most replicas an acquisition may wait for: the largest count Redis's ``WAIT`` takes.
MAX_REPLICAS = 2**63 - 1


def is_replica_count(value: object) -> bool:
    """Whether ``value`` is a count of replicas an acquisition can wait for: an int (not a bool)
    from 0 to ``MAX_REPLICAS``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_REPLICAS


#: (holder description, its TTL in seconds) of a lock an attempt found busy; (None, None) before.
Busy = tuple[str | None, float | None]


def companion_key(name: str, suffix: str) -> str:
    """A key in ``name``'s Redis Cluster hash slot, for data that belongs to the lock.

    Raises ``LockConfigurationError`` for a name whose slot no companion can
    share: one with a ``}`` but no hash tag (Redis hashes the first non-empty
    ``{...}``); and for a name that is a hash tag alone, ``{x}``, whose companions
    would be the lock ``x``'s (``{x}:<suffix>``), so that the two locks would share
    their waiters.
    """
    start = name.find("{")
    if start != -1:
        end = name.find("}", start + 1)
        if end > start + 1:  # ``name`` has a hash tag: the companion reuses it
            if start == 0 and end == len(name) - 1:
                raise LockConfigurationError(
                    f"name {name!r} is a hash tag alone, whose waiters would be those of the lock "
                    f"{name[1:-1]!r}; add to it, e.g. {name + ':lock'!r}"
                )
            return f"{name}:{suffix}"
    if "}" in name:
        raise LockConfigurationError(
            f"name {name!r} has a '}}' but no hash tag; use a name without '}}' or with a {{tag}}"
        )
    return f"{{{name}}}:{suffix}"


def lease_seconds(ttl: object, watchdog: bool) -> float:
    """A lease length in seconds, or ``LockConfigurationError`` saying what is allowed."""
    # a float in range (the common case, as every task's lock_ttl is) needs no conversion;
    # anything else goes through ``seconds``, whose errors say what is wrong (NaN, infinities)
    value = ttl if type(ttl) is float and 0 < ttl <= MAX_TTL else seconds(ttl, "ttl")
    if not 0 < value <= MAX_TTL:
        raise LockConfigurationError(f"ttl must be > 0 and <= {MAX_TTL:.0f} seconds, got {ttl!r}")
    if watchdog and value < MIN_WATCHDOG_TTL:
        raise LockConfigurationError(
            f"ttl must be >= {MIN_WATCHDOG_TTL} seconds for the watchdog to renew it "
            f"(every ttl/3), got {ttl!r}; use a longer ttl or watchdog=False"
        )
    return value


def flag(value: object, what: str) -> bool:
    """``value``'s truth (``blocking=1``, as ``threading.Lock`` takes it), but for a str or bytes:
    ``LockConfigurationError`` naming ``what`` (a ``"no"`` or ``"false"`` would be true)."""
    if isinstance(value, (str, bytes)):
        raise LockConfigurationError(f"{what} must be True or False, got {value!r}")
    return bool(value)


def lock_name(name: object) -> str:
    """``name`` as a non-empty str that is UTF-8 text, or ``LockConfigurationError`` saying what
    is allowed (a str with lone surrogates can be no Redis key: it failed at the first call)."""
    if type(name) is str and name and (name.isascii() or is_utf8(name)):
        return name
    if isinstance(name, bytes):
        try:
            name = name.decode()
        except UnicodeDecodeError:
            raise LockConfigurationError(f"name must be UTF-8, got {name!r}") from None
    if not isinstance(name, str) or not name:
        raise LockConfigurationError(f"name must be a non-empty str or bytes, got {name!r}")
    if not is_utf8(name):
        raise LockConfigurationError(f"name must be UTF-8, got {name!r}")
    return name


def check_holder(holder: object) -> None:
    """``LockConfigurationError`` unless ``holder`` is None or a str that is UTF-8 text."""
    if holder is not None and not isinstance(holder, str):
        raise LockConfigurationError(f"holder must be a str, got {holder!r}")
    if holder is not None and not is_utf8(holder):
        raise LockConfigurationError(f"holder must be UTF-8, got {holder!r}")


def is_utf8(text: str) -> bool:
    """Whether ``text`` can be sent as UTF-8 (no lone surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@functools.cache
def hostname() -> str:
    """This machine's host name, asked once per process (``socket.gethostname`` is a syscall)."""
    return socket.gethostname()


def waiter_member(ttl_ms: int, token: str, fair: bool, holder: str | None) -> str:
    """The waiter member (see ``_scripts``) describing an acquisition by ``token``; the holder
    is ``"<host>:<pid>"`` by default."""
    holder = holder if holder is not None else f"{hostname()}:{current_pid()}"
    return f"{ttl_ms}:{token}:{'1' if fair else '0'}:{holder}"


def owns(value: Any, token: str | None) -> bool:
    """Whether the lock stored as ``value`` (a GET reply) is owned by ``token``."""
    found = parse_value(value)
    return found is not None and found.token == token


def busy_reply(reply: Any) -> tuple[str | None, int | None]:
    """A script's answer that the lock is someone else's, ``{PTTL in ms, holder or false}``, as
    (holder, PTTL; -2: the key is gone; None: no server said, as when a Redlock's all failed)."""
    pttl_ms, holder = reply
    return None if holder is None else text(holder), None if pttl_ms is None else int(pttl_ms)


def seconds_left(pttl_ms: int | None) -> float | None:
    """A busy reply's PTTL in ms (``busy_reply``) as the seconds the holder has left: 0 for a key
    gone or without expiry (-2, -1), ``None`` when no server said."""
    return None if pttl_ms is None else max(pttl_ms, 0) / 1000


#: A waiter's shortest sleep (seconds): its BLPOP's timeout. Redis 6.2 reads a timeout as whole
#: milliseconds rounded down from its floating-point value, where "0.001" is 0 (block until
#: woken); the servers time blocked clients out about every 100 ms anyway (their ``hz``).
SHORTEST_PAUSE = 0.01


class Attempt:
    """One acquire's attempts by ``member`` (for ``token``), until granted or past ``deadline``.

    Call ``mode()`` before sending each attempt, ``granted(reply)`` with its
    reply; when not granted and ``waiting``, sleep ``pause()`` seconds (on the
    wake list where waiters ``queue``) and read what woke it with ``handed()``.
    ``sent_at`` is a monotonic time no later than the grant; ``sent`` whether
    an attempt may have reached Redis (an interrupted acquire then undoes it);
    ``busy`` the holder the last reply named.
    """

    __slots__ = (
        "blocking",
        "busy",
        "deadline",
        "member",
        "pttl_ms",
        "queue",
        "queued",
        "sent",
        "sent_at",
        "token",
        "ttl",
        "waiting",
    )

    def __init__(
        self, token: str, member: str, ttl: float, blocking: bool, deadline: float | None, queue: bool = True
    ) -> None:
        self.token, self.member, self.ttl = token, member, ttl
        self.blocking, self.deadline = blocking, deadline
        #: whether waiters join the server's queue (one server) or just try again (Redlock)
        self.queue = queue
        self.queued = self.sent = self.waiting = False
        self.sent_at = 0.0
        #: the PTTL the last busy reply gave the holder (-2: gone, -1: no expiry; None: unknown)
        self.pttl_ms: int | None = None
        self.busy: Busy = (None, None)

    def mode(self) -> str:
        """The mode of the attempt about to be sent: ``try`` (once), ``wait`` (join the queue),
        ``again`` (stay queued) or ``last`` (leave the queue: the deadline is past)."""
        self.sent_at = mod_time.monotonic()
        self.waiting = self.blocking and (self.deadline is None or self.sent_at < self.deadline)
        self.sent = True
        if not self.queue:
            return "try"
        if self.queued:
            return "again" if self.waiting else "last"
        return "wait" if self.waiting else "try"

    def granted(self, reply: Any) -> int | None:
        """The fence if ``reply`` (to ``ACQUIRE``) grants the lock; else None, ``busy`` set."""
        if isinstance(reply, int):
            return reply
        holder, pttl_ms = busy_reply(reply)
        self.pttl_ms = pttl_ms
        self.busy = (holder, seconds_left(pttl_ms))
        self.queued = self.queue and self.waiting
        return None

    def pause(self) -> float:
        """How long a waiter sleeps: until the holder's TTL (at most our own ``ttl``) runs out,
        or until the deadline. A holder in its last millisecond (PTTL 0) or gone (-2): the
        shortest sleep, ``SHORTEST_PAUSE``; one whose TTL is unknown, or a key without expiry
        (-1): our own ``ttl``."""
        pttl_ms = self.pttl_ms
        waits = [self.ttl, self.ttl if pttl_ms is None or pttl_ms == -1 else max(pttl_ms, 0) / 1000]
        if self.deadline is not None:
            waits.append(self.deadline - mod_time.monotonic())
        return max(min(waits), SHORTEST_PAUSE)

    def handed(self, message: Any) -> int | None:
        """The fence a wake ``message`` (None: none came) hands over, sent after the last
        attempt; None when it only says "retry"."""
        if message is None:
            return None
        found = text(message)
        return None if found == "retry" else int(found)


@contextlib.contextmanager
def ending_block(name: str, exc: BaseException | None) -> Iterator[None]:
    """Around the release that ends a lock's ``with`` block: a ``LockNotOwned`` propagates after
    a block that ended normally, and is logged after one that raised (its exception is the one
    to see)."""
    try:
        yield
    except LockNotOwned:
        if exc is None:
            raise
        logger.warning(
            "lock %r was not held any more when its with-block raised",
            name,
            extra=log_fields(name, outcome="lost"),
        )


class LockCore:
    """A lock's checked settings and its hold count, as every lock (sync, asyncio, Redlock) keeps
    them; no I/O. A subclass provides ``lost``, the event set when the hold is found lost."""

    lost: threading.Event | asyncio.Event

    def __init__(
        self,
        name: str | bytes,
        ttl: Duration,
        *,
        watchdog: bool,
        fair: bool,
        timeout: Duration | None,
        holder: str | None,
    ) -> None:
        self.watchdog, self.fair = flag(watchdog, "watchdog"), flag(fair, "fair")
        self.name = lock_name(name)
        self.ttl = lease_seconds(ttl, watchdog)
        self.timeout = None if timeout is None else seconds(timeout, "timeout")
        check_holder(holder)
        #: what a waiter's wake list is named after its token (raises for a name that can have no companions)
        self.wake_prefix = companion_key(self.name, "wake:")
        self.holder = holder
        self.token: str | None = None
        self.fence: int | None = None
        self._ttl_ms = to_ms(self.ttl)
        self._count = 0
        self._pid = 0
        #: (holder, ttl in seconds) seen by the last failed attempt
        self.busy: Busy = (None, None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ttl={self.ttl} held={self._count}>"

    def held(self) -> bool:
        """Held by this object in this process (a forked child holds nothing it inherited)."""
        return self._count > 0 and self._pid == current_pid()

    @property
    def hold_count(self) -> int:
        """How many times this object holds the lock (re-entry raises it)."""
        return self._count

    def record_hold(self, token: str, fence: int) -> None:
        """Record a hold granted to ``token`` (``fence``) as this object's, held once, in this process."""
        self.token, self.fence, self._count, self._pid = token, fence, 1, current_pid()

    def clear_hold(self) -> None:
        """Forget the hold (freed or handed on by the caller)."""
        self.token, self.fence, self._count = None, None, 0

    # The last release of a hold, from its send to its reply, as a lock shared by threads (or
    # asyncio tasks) sees it: not held, so that an acquire meanwhile takes a hold of its own
    # rather than re-enter one Redis is freeing.

    def freeing(self) -> None:
        """The hold's last release is about to be sent: no longer held (its token kept)."""
        self._count = 0

    def kept_after_freeing(self, token: str) -> None:
        """The release of ``token``'s hold failed, its outcome unknown: held again, unless
        another hold was taken meanwhile."""
        if self.token == token and self._count == 0:
            self._count = 1

    def freed(self, token: str) -> bool:
        """The release of ``token``'s hold is over: forgotten, unless another hold was taken
        meanwhile. Whether it was."""
        if self.token != token or self._count:
            return False
        self.clear_hold()
        return True

    def member(self, token: str) -> str:
        """The waiter member (see ``_scripts``) describing an acquisition by ``token``."""
        return waiter_member(self._ttl_ms, token, self.fair, self.holder)

    def deadline(self, blocking: bool, timeout: Duration | None) -> float | None:
        """The monotonic deadline of an acquire given ``blocking`` and ``timeout`` (None: none);
        ``LockConfigurationError`` for a ``blocking`` that is no bool."""
        flag(blocking, "blocking")
        if timeout is not None and not blocking:
            raise LockConfigurationError("timeout cannot be given with blocking=False")
        wait = self.timeout if timeout is None else seconds(timeout, "timeout")
        return None if wait is None else mod_time.monotonic() + wait

    def reenter(self) -> bool:
        """Whether this object holds the lock already: then held once more (``LockLost`` when the
        watchdog found the hold lost)."""
        if not self.held():
            return False
        if self.lost.is_set():
            raise LockLost(self.name)
        self._count += 1
        return True

    def drop_hold(self) -> bool:
        """Lower the hold count (``LockNotOwned`` when not held); whether it was the last hold,
        which the caller then frees."""
        if not self.held():
            raise LockNotOwned(self.name)
        if self._count > 1:
            self._count -= 1
            return False
        return True

    def new_attempt(self, token: str, blocking: bool, deadline: float | None, queue: bool) -> Attempt:
        """A new acquire's attempts for ``token``, described by this lock's waiter member."""
        return Attempt(token, self.member(token), self.ttl, blocking, deadline, queue)
