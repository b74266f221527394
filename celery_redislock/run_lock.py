"""The execution lock of one run of a ``LockedTask``, and the steps every run takes with it.

A loss never interrupts the body: it is marked (``request.lock_lost``),
raised at the points the package controls (``raise_if_lost``), or, in a
prefork pool child with ``lock_on_lost="terminate"``, ends the child.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import redis

from . import signals, telemetry
from ._durations import to_ms
from ._permit_scripts import WATCH_PERMIT
from ._process import current_pid
from ._redis import settle_later
from ._task_scripts import ADOPT, PARK, WATCH
from .attempt import busy_reply, hostname, seconds_left
from .config import AppSettings, LockOptions
from .connection import Client
from .exceptions import LockLost, LockNotOwned, LockNotReplicated
from .lock import OneServer, RedisLock
from .primitive import LeaseLock
from .protocol import holder_for
from .semaphore import PermitBook, Permits
from .watchdog import Lease

__all__ = [
    "EMPTY_BLOCK",
    "KEPT",
    "PARKED",
    "ExecutionLock",
    "acquired",
    "adopt",
    "announce_released",
    "finish_release",
    "park",
    "raise_if_lost",
    "release",
    "release_later",
    "watch",
    "watch_end",
]

logger = logging.getLogger(__name__)

#: The block of a body that needs no marking: ``nullcontext`` keeps no state, so one serves every run.
EMPTY_BLOCK: AbstractContextManager[None] = nullcontext()

#: What ``watch`` returns, and what the watching copy's ``lock.wait_as`` returns once woken, when
#: the run is over and keeps its hold for the rest of ``lock_period`` (``LockValue.kept``).
KEPT = -1

#: What the copy watching a run's hold gets from ``lock.wait_as`` once woken, when the run
#: parked its hold for the message that continues it, its retry or replacement (``park``).
PARKED = -2


class ExecutionLock(RedisLock):
    """A run's execution lock.

    A loss (found by the watchdog, or by the owner-checked release) sets
    ``lost`` and marks the request (``lock_lost``). It never interrupts the
    thread running the body: an exception injected at an arbitrary instruction
    can be swallowed (``logging`` catches it) or leave a lock of the
    interpreter, ``logging``, redis-py or a driver held, which would hang the
    watchdog thread and with it every renewal of the process. With
    ``raise_on_lost``, the run raises ``LockLost`` at points the package
    controls instead (see ``LockedTask.check_lock``). With ``stop_child`` (a
    prefork pool child, ``lock_on_lost="terminate"``), a loss while the body
    runs also kills this process at once (SIGKILL, as a hard time limit ends);
    the worker's main process then records the failure and releases,
    owner-checked, which leaves a new holder alone.
    """

    def __init__(
        self,
        client: Client,
        key: str,
        ttl: float,
        holder: str,
        settings: AppSettings,
        *,
        task_name: str,
        raise_on_lost: bool,
        stop_child: bool,
        limit: int = 1,
    ) -> None:
        super().__init__(client, key, ttl, holder=holder, **settings.replication)
        if limit > 1:  # up to ``limit`` runs at once: each holds a permit of the key (``semaphore``)
            self.servers = Permits(client, PermitBook(self.name, limit), self.ttl, self.wake_prefix)
        #: the task whose run holds it (the ``task`` of its metrics)
        self.task_name = task_name
        self.request: Any = None  # the request the body sees, once pushed
        self.raise_on_lost = raise_on_lost
        self._stop_child = stop_child
        self._body_running = False
        #: held only to read or flip ``_body_running``: never long, never around a call that blocks
        self._guard = threading.Lock()

    def lease_lost(self, lease: Lease) -> bool:
        if not super().lease_lost(lease):
            return False
        if self.request is not None:
            self.request.lock_lost = True
        if self._stop_child:
            with self._guard:  # the body cannot end meanwhile: a child that finished is never stopped
                if self._body_running:
                    self._stop_this_child("while task {} ran")
        return True

    def _stop_this_child(self, when: str) -> None:
        """Kill this process (a prefork pool child, ``stop_child``): the lock was lost ``when``
        (formatted with the task id), with a body running or about to."""
        task_id = getattr(self.request, "id", None)
        pid = os.getpid()  # asked of the kernel: the process stopped is this one, never another
        logger.error(
            "lock %r lost %s: it is no longer held by this task; stopping pool child %d "
            "(lock_on_lost='terminate')",
            self.name,
            when.format(task_id),
            pid,
            extra=telemetry.log_fields(self.name, task_id, self.holder, self.fence, "terminate"),
        )
        os.kill(pid, signal.SIGKILL)

    def body(self) -> AbstractContextManager[None]:
        """The block the body runs in: only then does a loss stop the pool child (``stop_child``);
        without ``stop_child`` nothing needs marking, and the block is empty."""
        return self._marked_body() if self._stop_child else EMPTY_BLOCK

    def attach(self, request: Any) -> None:
        """The body sees ``request``: a loss found since the hold was taken (before anyone could
        mark it) is marked there now."""
        self.request = request
        if self.found_lost():
            request.lock_lost = True

    @contextmanager
    def _marked_body(self) -> Iterator[None]:
        with self._guard:
            self._body_running = True
            lost_already = self.found_lost()
        if lost_already:  # found before the body started: ``lease_lost`` did not stop the child then
            self._stop_this_child("before task {}'s body started")
        try:
            yield
        finally:
            with self._guard:
                self._body_running = False


def raise_if_lost(locks: Iterable[ExecutionLock | None]) -> None:
    """Raise ``LockLost`` for the first of ``locks`` that raises on a loss and was lost."""
    for lock in locks:
        if lock is not None and lock.raise_on_lost and lock.found_lost():
            raise LockLost(lock.name)


def acquired(task: Any, lock: RedisLock, task_id: str | None, started: float) -> bool:
    """``task``'s run took ``lock``, trying since monotonic ``started``: announce it
    (``lock_acquired``); ``True``."""
    signals.lock_acquired.send(
        sender=task,
        key=lock.name,
        task_id=task_id,
        fence=lock.fence,
        waited=lock.taken_at - started,
        mode=task.lock_options.mode,
    )
    return True


def announce_released(task: Any, key: str, task_id: str | None, held: float, fence: int | None) -> None:
    """``task``'s run freed its hold of ``key`` (``fence``), ``held`` seconds after taking it:
    announce it (``lock_released``), however it was freed (a release, a park that let go)."""
    signals.lock_released.send(sender=task, key=key, task_id=task_id, held=held, fence=fence)


def adopt(lock: RedisLock, token: str) -> tuple[str | None, int] | None:
    """Adopt for ``lock`` the hold queued for the message carrying ``token`` (``ADOPT``), under a
    token of the run's own; ``None`` once held (acknowledged by ``replicas`` replicas where set,
    as every acquisition), else (the holder, its PTTL in ms; -2: gone).

    Raises ``LockNotReplicated`` (the hold released) when too few replicas acknowledge it. An
    exception from ``ADOPT`` on (a lost reply, an interrupt such as a soft time limit) frees what
    ``own`` may hold, owner-checked: nothing else knows it.
    """
    own = secrets.token_hex(16)
    sent_at = time.monotonic()
    try:
        reply = ADOPT(lock.client, [lock.name], [token, own, to_ms(lock.ttl), lock.holder or ""])
        if not isinstance(reply, int):
            holder, pttl_ms = busy_reply(reply)
            return holder, -2 if pttl_ms is None else pttl_ms
        lock.take_hold(own, reply, sent_at)
    except LockNotReplicated:  # given back already
        raise
    except BaseException:
        lock.give_back(own)
        raise
    return None


def park(
    client: Any,
    key: str,
    hold: tuple[str, str],
    token: str,
    then: tuple[str | None, int, int],
    options: LockOptions,
    delay: float,
) -> int:
    """Park the hold of ``key`` (``hold``: its token and the holder it must still name) for the
    message that continues its run, a retry or a replacement (``then``: its task id, retries
    and replacement depth), which carries ``token``, due in ``delay`` s, queued for
    ``lock_queue_ttl`` past that (``PARK``): its reply, 1 once parked. The parked hold's holder
    names the mode's period (``lock_period``, where the mode keeps the lock after a run), so
    that a worker that does not know the task lets go of it as the run would (``DECLINE``)."""
    queued = holder_for(then[0], then[1], hostname(), current_pid(), "queued", then[2], options.period_ms)
    ttl = to_ms(options.queue_ttl + delay)
    return int(PARK(client, [key], [hold[0], hold[1], token, queued, ttl, options.period_ms]))


def watch(lock: LeaseLock, holder: str, token: str) -> int | None:
    """Watch, as ``token``, how the hold of ``lock`` by ``holder`` ends (``WATCH``; a semaphore's
    permit, ``WATCH_PERMIT``), for a copy of the message whose first delivery has it, or a later
    attempt of its task id that waits for it (``busy``): ``token``
    is queued for ``lock`` (wait with ``lock.wait_as(token, ...)``), and is handed the hold, its
    fence kept, if it is released meanwhile; woken with ``KEPT`` if the run ends and keeps it for
    its period (``SETTLE``), with ``PARKED`` if the run parks it for its retry or replacement
    (``PARK``); none of these if its lease runs out. Returns the hold's fence once watched,
    0 when another copy of the message watches it, ``KEPT`` when the run is over and keeps it
    (nothing watched: one round trip), ``None`` when ``holder`` no longer holds it (``lock.busy``
    then names who does, where known). Cut short after its send (a lost reply, an interrupt such
    as a soft time limit), it takes ``token`` out of the queue, so that no release hands the hold
    to a token nothing knows."""
    servers, member = lock.servers, lock.member(token)
    try:
        if isinstance(servers, Permits):
            reply = WATCH_PERMIT(lock.client, [lock.name], [holder, member, servers.book.limit])
        else:
            reply = WATCH(lock.client, [lock.name], [holder, member])
    except BaseException:  # sent, maybe run (a lost reply, an interrupt): ``token``, which nothing
        servers.abandon(token, member)  # else knows, may be queued as the hold's watcher
        raise
    if isinstance(reply, int):
        return reply
    found, pttl_ms = busy_reply(reply)
    lock.busy = (found, seconds_left(pttl_ms))
    return None


def watch_end(lock: LeaseLock, holder: str, token: str, deadline: float) -> tuple[int | None, int | None]:
    """Watch, as ``token``, how the hold of ``lock`` by ``holder`` ends (``watch``), and once watched
    wait for it until monotonic ``deadline`` (``lock.wait_as``): ``(watched, fence)``, ``watched``
    as ``watch`` returns it, ``fence`` what the wait came to: the fence of a hold granted to
    ``token`` (handed over by the release, its fence ``watched``, or taken free), ``KEPT`` or
    ``PARKED`` (woken by the run keeping or parking it), or ``None`` (the deadline passed:
    ``lock.busy`` names the holder; or not waited). ``token`` is out of the queue once this
    returns. Cut short (an interrupt such as a soft time limit, also between the watch and the
    wait, or right after this returns), ``token`` may be queued or hold the lock, which nothing
    else knows: the caller gives it up (``lock.give_back``)."""
    watched = watch(lock, holder, token)
    if not watched or watched == KEPT:
        return watched, None
    fence = lock.wait_as(token, deadline, queued=True)  # ``watch`` queued it
    if fence in (KEPT, PARKED):  # woken out of the queue, where its first attempt queued it again
        lock.servers.abandon(token, lock.member(token))
    return watched, fence


def release(task: Any, lock: RedisLock, task_id: str | None, *, announce: bool = True) -> str | None:
    """Release after the body; a failure is logged, never raised over the task's outcome.
    Returns ``"released"``, ``"lost"`` (no longer held), ``"error"`` (a Redis error), or
    ``None`` when ``lock`` was not held.

    A lock found no longer held is marked ``lost``. ``announce=False``: no
    ``lock_released`` signal (for a hold that was never a run's: a probe).
    """
    if not lock.held():
        return None
    report = _Report(task, lock, task_id, announce)
    try:
        lock.release()
    except LockNotOwned:
        return report.outcome(False)
    except redis.RedisError as exc:
        return report.outcome(exc)
    return report.outcome(True)


def release_later(task: Any, lock: RedisLock, task_id: str | None, ending: telemetry.Release) -> bool:
    """``release``, its reply read later (``_release_sent``): at ``finish_release`` (after
    the run: ``receivers.after_run``) or this thread's next exchange on the connection, whichever comes
    first; the outcome is then reported as ``release`` reports it, and ends ``ending`` (entered
    here). ``False``: nothing done (the lock cannot leave a reply to read later, see
    ``_release_sent``), call ``release``.

    A send that failed, or an exception that interrupts the read or comes right after the send
    (a soft time limit), drops the connection and is reported as ``"error"``, once: the outcome is
    unknown, and the key expires within its lease (never ``"lost"``: the hold is forgotten once
    the send began). One that comes before the send raises, the hold kept for ``finish_release``.
    """
    ending.__enter__()
    report = _Report(task, lock, task_id, announce=True)  # once ``ending`` began: its held ≤ the signal's
    ended = False

    def end(exc: BaseException | None = None) -> None:
        """End ``ending`` once: when the outcome is reported, or the send interrupted. (A flag,
        not an ``ExitStack``: this runs for every task, and the stack's calls cost more.)"""
        nonlocal ended
        if not ended:
            ended = True
            if exc is None:
                ending.__exit__(None, None, None)
            else:
                ending.__exit__(type(exc), exc, exc.__traceback__)

    def then(freed: bool | BaseException) -> None:
        try:
            ending.outcome = report.outcome(freed)
        except BaseException as exc:
            end(exc)
            raise
        end()

    try:
        sent = _release_sent(lock, then)
    except BaseException as exc:  # interrupted: a hold still kept is ``finish_release``'s
        end(exc)  # a no-op if ``then`` ended it
        raise
    if not sent:
        end()  # no outcome: ``ending`` records nothing, the caller releases
    return sent


def _release_sent(lock: RedisLock, then: Callable[[bool | BaseException], None]) -> bool:
    """Release ``lock``'s last hold without waiting for the reply: ``then`` gets whether ``lock``
    still held it (``False``: lost, nothing changed in Redis), or the exception that left the
    outcome unknown (an error reply, a failed send, what interrupted the read or came right
    after the send), once read (``_redis.send_later``). The hold is forgotten once the release
    is sent.

    ``False``, nothing sent, the hold kept (call ``release``): the lock is held more than once
    or not over exactly one server (a semaphore's permits release with a script of their own),
    has ``replicas``, or its client or pool does not let a reply wait (not a plain
    ``redis.Redis``, or its pool lends per exchange), or its connection could not be made
    (a Redis error: ``release`` tries again with the client's retry policy).
    """
    servers = lock.servers
    if not (type(servers) is OneServer and servers.waits_for_reply() and lock.hold_count == 1):
        return False
    token = lock.stop_renewing()

    def freed(reply: Any) -> None:
        lock.forget()  # also if an exception came between the send and the ``forget`` below
        if _connection_lost(reply):
            try:
                reply = _free_again(servers, token)
            except BaseException:  # interrupted (a soft time limit is an Exception too): unknown
                then(reply)
                raise
        then(reply if isinstance(reply, BaseException) else bool(int(reply)))

    if not servers.free_later(token, freed):
        return False
    lock.forget()
    return True


def _connection_lost(reply: Any) -> bool:
    """Whether a release sent without waiting got, instead of its reply, a broken connection
    (a ``ConnectionError``: Redis may never have run it). Not a timeout: a server that took the
    release and is slow most likely ran it, and would be as slow to answer a second one."""
    return isinstance(reply, redis.exceptions.ConnectionError)


def _free_again(servers: OneServer, token: str) -> bool | redis.RedisError:
    """Send again, once, the release of ``token`` whose connection broke: ``True`` once done,
    whatever it found (the first send may have freed the key: a resend's 0 counts as released, as
    ``OneServer.free`` counts its client's resends; a loss found only then goes unreported), or
    the Redis error of that one try (the key then expires within its lease)."""
    try:
        servers.free_once(token)
    except redis.RedisError as exc:
        return exc
    return True


def finish_release(task: Any, lock: RedisLock, task_id: str | None, keep: Callable[[], str | None]) -> None:
    """After a run (``Execution.finish``): read and report the reply of its release left to read
    (``release_later``), if still unread; let go of what an asynchronous exception kept the run
    from letting go: kept where its mode keeps it (``keep``: the outcome, or ``None``), else
    released."""
    settle_later(lock.client)
    if keep() is None:
        release(task, lock, task_id)


class _Report:
    """The report of the release of ``lock`` (its hold as when the release was sent) by ``task``'s
    run ``task_id``: logs, the ``lost`` mark and metric, the ``lock_released`` signal."""

    __slots__ = ("announce", "fence", "held", "holder", "lock", "task", "task_id")

    def __init__(self, task: Any, lock: RedisLock, task_id: str | None, announce: bool) -> None:
        self.task, self.lock, self.task_id, self.announce = task, lock, task_id, announce
        self.fence, self.holder = lock.fence, lock.holder
        #: from the hold's acquisition to the release's send (not its reply)
        self.held = time.monotonic() - lock.taken_at

    def outcome(self, freed: bool | BaseException) -> str:
        """Report what the release came to: ``freed`` says whether the lock was still held, or is
        the exception that left the outcome unknown; returns ``"released"``, ``"lost"``, ``"error"``."""
        task, lock, task_id = self.task, self.lock, self.task_id
        if isinstance(freed, BaseException):
            logger.warning(
                "task %s[%s]: could not release lock %s (%s); it expires within its ttl",
                task.name,
                task_id,
                lock.name,
                freed if isinstance(freed, redis.RedisError) else f"interrupted: {freed!r}",
                extra=telemetry.log_fields(lock.name, task_id, self.holder, self.fence, "error"),
            )
            return "error"
        if not freed:
            if not lock.lost.is_set():  # not reported by the watchdog: lost since its last renewal
                lock.lost.set()
                telemetry.lost(task.name, "not owned at release")
            logger.warning(
                "task %s[%s]: lock %s was no longer held when the task ended",
                task.name,
                task_id,
                lock.name,
                extra=telemetry.log_fields(lock.name, task_id, self.holder, self.fence, "lost"),
            )
            return "lost"
        if self.announce:
            announce_released(task, lock.name, task_id, self.held, self.fence)
        return "released"
