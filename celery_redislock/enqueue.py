"""A message's enqueue lock, taken by ``apply_async``, and what a duplicate call gets.

In the modes with an enqueue lock, ``apply_async`` takes the lock before it
sends the message, which carries the lock's ticket (key and token) to the
worker. A call that finds the lock held gets what ``lock_duplicate`` says:

* ``"return"``: the queued (or running) task's ``AsyncResult``, nothing sent;
* ``"raise"``: ``DuplicateTask``, nothing sent;
* ``"replace"``: last one wins. The call takes the lock over from the queued
  message (``REPLACE``, one atomic step: the lock always names exactly one
  message, the last to take it) and is sent. The message it superseded is
  dropped by the worker that meets it (``superseded``), its body never run. A
  run's hold, and one queued for a retry or a replacement, are never taken over:
  a replacing call that finds one gets its ``AsyncResult``, as with ``"return"``.

The retry of a run with other arguments (``enqueue_retry``), and the replacement of a run of
another task (``self.replace(sig)``), are never refused: they continue a message sent
already. Finding the lock held, they are sent without it.
Every ticket taken here is marked ``fresh`` in the message header: no run held it,
so a message that never runs frees it (``give_up_ticket``), a retry's or a
replacement's as a new call's, never keeping it as the hold of a run.

Failure timeline: the lock is taken before the message is sent, for the
token the message carries, drawn before the take. Any exception from the
take to the end of the send (a failed send, a lost reply, an interrupt such
as the soft time limit of a task calling ``apply_async``) undoes the take,
owner-checked by that token, so also a take whose reply never came: a lock
taken afresh is released. With ``"replace"`` (``UNREPLACE``) the lock goes
back to the message it was taken from, no longer superseded, unless a worker
dropped that message already; then it is freed. If a later call took the
lock over meanwhile, that call's message stands, and its own undo would give
the lock back past the unsent message. An undo that fails too (Redis cut
off) leaves the lock to its ttl: under ``redislock_on_error="fail"`` nothing
is sent; under ``"run"`` the message is sent carrying the ticket all the same,
and its worker adopts or frees what the take left. A superseded message is marked until
a worker meets it, for as long as either lock could live: a copy of it
delivered again is dropped too.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import redis
from celery import current_task

from . import signals
from ._durations import to_ms
from ._process import current_pid
from ._redis import FAILURES
from ._task_scripts import DECLINE, DROP, LET_GO, REPLACE, UNREPLACE
from .attempt import MAX_TTL, busy_reply, hostname, seconds_left
from .config import TASK_OPTIONS, LockOptions
from .connection import GIVEN_CLIENT, client_for
from .exceptions import DuplicateTask, LockConfigurationError, LockNotReplicated, RedisLockError
from .inventory import release_token
from .lock import RedisLock
from .protocol import (
    FRESH,
    HEADER,
    canvas_member,
    holder_for,
    message_delay,
    parse_holder,
    parse_value,
    replaced_nesting,
    request_ticket,
    seconds_until,
    sent_attempt,
    text,
)
from .telemetry import counted, log_fields

__all__ = ["checked_delay", "dropped_as_superseded", "duplicate", "enqueue", "enqueue_retry", "superseded"]

logger = logging.getLogger(__name__)


#: (holder, seconds left) of an enqueue lock found held and not taken over.
_Busy = tuple[str | None, float | None]
#: What a take of an enqueue lock came to: ``None``, taken (free); an outcome to count once the
#: message is sent (``"duplicate-replaced"``: taken over from a queued message); or ``_Busy``.
_Taken = _Busy | str | None


def enqueue(
    task: Any,
    key: str,
    task_id: str,
    options: Mapping[str, Any],
    headers: dict[str, Any],
    send: Callable[[str | None], Any],
) -> Any:
    """Take the enqueue lock ``key`` for the message ``task_id``, then ``send`` it carrying the
    lock; a call that finds it held gets what ``lock_duplicate`` says (``duplicate``). The
    replacement of a run of another task (``self.replace(sig)``, its message carrying the
    replaced run's task id, whose result it is) is never refused: sent as ``enqueue_retry``
    sends a retry (one of the task's own runs is ``execution.send_continuation``'s)."""
    sent, busy = _send_locked(task, key, task_id, options, headers, send)
    if busy is None:
        return sent
    if _replaces_run(task_id, options):
        return _sent_unlocked(task, key, task_id, busy, send)
    return duplicate(task, key, *busy, dispatched=_dispatched(options))


def _replaces_run(task_id: str, options: Mapping[str, Any]) -> bool:
    """Whether the message ``task_id`` sent with ``options`` replaces the run under way in this
    thread (``self.replace(sig)``: under that run's task id, one replacement deeper)."""
    running = current_task.request if current_task else None
    if running is None or running.id != task_id:
        return False
    return sent_attempt(options)[1] > replaced_nesting(running)


def enqueue_retry(
    task: Any,
    key: str,
    task_id: str,
    options: Mapping[str, Any],
    headers: dict[str, Any],
    send: Callable[[str | None], Any],
) -> Any:
    """``enqueue`` for the retry of the run under way here with other arguments, another key
    (``self.retry(args=...)``): it continues a message sent already, so it is never refused as
    a duplicate. When another message holds ``key``, it is sent without the lock, and its
    worker finds the key held (``lock_busy``)."""
    sent, busy = _send_locked(task, key, task_id, options, headers, send)
    return sent if busy is None else _sent_unlocked(task, key, task_id, busy, send)


def _sent_unlocked(task: Any, key: str, task_id: str, busy: _Busy, send: Callable[[str | None], Any]) -> Any:
    """Send the retry or replacement ``task_id`` without the enqueue lock ``key``, held (``busy``)
    by another message: its worker finds the key held (``lock_busy`` applies)."""
    logger.info(
        "task %s[%s]: its retry or replacement is sent without enqueue lock %s, held by task %s "
        "(lock_busy applies)",
        task.name,
        task_id,
        key,
        parse_holder(busy[0]).get("task"),
        extra=log_fields(key, task_id, busy[0], outcome="retry-sent"),
    )
    return send(task_id)


def _send_locked(
    task: Any,
    key: str,
    task_id: str,
    options: Mapping[str, Any],
    headers: dict[str, Any],
    send: Callable[[str | None], Any],
) -> tuple[Any, _Busy | None]:
    """Take the enqueue lock ``key`` for the message ``task_id``, then ``send`` it carrying the
    lock: (what ``send`` returned, ``None``), or, the lock held, (``None``, who holds it), unsent.
    Whatever exception comes between the take and the end of the send, the lock is given back:
    it never names a message that was not sent."""
    lock_options: LockOptions = task.lock_options
    retries, depth = sent_attempt(options)
    holder = holder_for(task_id, retries, hostname(), current_pid(), "queued", depth)
    ttl = _queue_ttl(task, lock_options, options)
    if lock_options.duplicate == "replace" and canvas_member(options):
        raise LockConfigurationError(
            f"task {task.name!r}: lock_duplicate='replace' cannot take lock_in_canvas=True: a superseded "
            "group, chord or chain member would leave its canvas waiting forever"
        )
    take = _replace if lock_options.duplicate == "replace" else _acquire
    token = secrets.token_hex(16)  # the message's, drawn first: a take cut off after it ran is undone too
    url, undo, sending = GIVEN_CLIENT, None, False
    try:
        client, url = client_for(task.app)
        undo = _undo_for(lock_options, client, key, token)
        taken = take(task, client, key, ttl, holder, task_id, token)
        if isinstance(taken, tuple):
            return None, taken
        headers[HEADER] = {"key": key, "token": token, FRESH: True}  # no run held it
        sending = True
        sent = send(task_id)
    except BaseException as exc:
        failed = not sending and isinstance(exc, (redis.RedisError, LockNotReplicated))
        if undo is not None and not failed:  # a failed take gave back what it may have taken itself
            _undo(task, key, task_id, undo)  # nothing was sent: the lock must not name it
        if not failed:
            raise
        _take_failed(task, key, task_id, url, exc)  # raises under redislock_on_error="fail"
        # The take may have reached Redis (its reply lost) and its undo failed: the message carries
        # the ticket all the same, so that its worker adopts or frees what it left, owner-checked.
        headers[HEADER] = {"key": key, "token": token, FRESH: True}
        return send(task_id), None
    if taken is not None:  # counted once sent: the take of a call left unsent was undone
        counted(task.name, lock_options.mode, taken)
    return sent, None


def _take_failed(task: Any, key: str, task_id: str, url: str, exc: BaseException) -> None:
    """The take of the enqueue lock ``key`` failed (``exc``: a Redis error, or not replicated: as
    unreachable): as ``redislock_on_error`` says, raise ``RedisLockError`` (``"fail"``), or log
    that the message is sent unlocked (``"run"``)."""
    where = f"task {task.name!r}[{task_id}]: could not take enqueue lock {key!r} at {url}: {exc}"
    if task.lock_settings.on_error == "fail":
        raise RedisLockError(where) from exc
    unlocked = log_fields(key, task_id, outcome="unlocked")
    logger.warning("%s; sending it unlocked (redislock_on_error='run')", where, extra=unlocked)


def _dispatched(options: Mapping[str, Any]) -> bool:
    """Whether a message sent with ``options`` is a callback Celery's worker sends for the task
    that just ended (with its ``parent_id``); not a retry, which carries one too, with its
    ``retries``: a retry refused must not pass for one sent."""
    return bool(options.get("parent_id")) and "retries" not in options


def _undo(task: Any, key: str, task_id: str, undo: Callable[[], object]) -> None:
    """Give back the lock ``key`` taken for the unsent message ``task_id``; a Redis error doing so
    is logged (the lock expires within its ttl), so that the caller raises its own. An interrupt
    (a soft time limit is an ``Exception`` too) propagates, the lock left likewise."""
    try:
        undo()
    except FAILURES as exc:
        logger.warning(
            "task %s[%s]: could not give back enqueue lock %s (%s); it expires within its ttl",
            task.name,
            task_id,
            key,
            exc,
            extra=log_fields(key, task_id, outcome="error"),
        )


#: What each option of a message's timing may be (``checked_delay`` reads them).
_TIMING = {
    "countdown": "seconds (int/float)",
    "eta": "a datetime or an ISO 8601 string",
    "expires": "seconds (int/float), a datetime or an ISO 8601 string",
}


def _queue_ttl(task: Any, lock_options: LockOptions, options: Mapping[str, Any]) -> float:
    """How long the enqueue lock of a message sent with ``options`` lives: while it waits. A
    ``countdown``, ``eta`` or ``expires`` that is no time raises ``LockConfigurationError`` naming it."""
    # Celery's Task.apply_async adds the task's own ``expires`` (``@app.task(expires=...)``, or
    # task_annotations) under the call's: the message expires then, and so must its lock.
    if "expires" not in options and getattr(task, "expires", None) is not None:
        options = {**options, "expires": task.expires}
    ttl = lock_options.queue_ttl + checked_delay(task, options)
    if options.get("expires") is not None:
        ttl = min(ttl, max(seconds_until(options["expires"]), 0.001))
    if lock_options.rules.settles:
        ttl = max(ttl, lock_options.period or 0)
    return min(ttl, MAX_TTL)  # the longest lease a lock takes, whatever the countdown


def checked_delay(task: Any, options: Mapping[str, Any]) -> float:
    """``message_delay(options)``, once the ``countdown``, ``eta`` and ``expires`` of ``options``
    are read as times: one that is none raises ``LockConfigurationError`` naming ``task`` and
    it, before anything is sent or taken."""
    for name, allowed in _TIMING.items():
        value = options.get(name)
        try:
            valid = value is None or math.isfinite(_seconds_from_now(name, value))
        except (TypeError, ValueError, OverflowError, AttributeError):  # AttributeError: a date
            valid = False
        if not valid:
            raise LockConfigurationError(
                f"task {task.name!r}: {name}={value!r} is not valid; allowed: {allowed}"
            )
    return message_delay(options)


def _seconds_from_now(name: str, value: object) -> float:
    """The ``countdown``, ``eta`` or ``expires`` ``value`` as seconds from now, or ``TypeError``,
    ``ValueError`` or ``OverflowError`` where Celery's send would fail on it: seconds (a
    ``countdown``'s, an ``expires``') that are no number, or put the time past Celery's
    datetimes (year 1 to 9999); an ``eta`` in seconds (``expires``' form, not ``eta``'s)."""
    if name == "countdown" or isinstance(value, (int, float)):
        if name == "eta" or not isinstance(value, (int, float)):
            raise TypeError(f"{name} in seconds must be an int or float")
        datetime.now(timezone.utc) + timedelta(seconds=value)  # as Celery adds it: OverflowError past 9999
        return float(value)
    return seconds_until(value)


def _undo_for(lock_options: LockOptions, client: Any, key: str, token: str) -> Callable[[], object]:
    """How to give back the lock ``key`` taken, or maybe taken, for ``token``'s unsent message:
    owner-checked by ``token``, so a no-op if the take did nothing."""
    if lock_options.duplicate == "replace":
        return partial(UNREPLACE, client, [key], [token])
    return partial(release_token, client, key, token)


def _acquire(task: Any, client: Any, key: str, ttl: float, holder: str, task_id: str, token: str) -> _Taken:
    """Take ``key`` for ``token`` if it is free (``lock_duplicate`` ``"return"`` or ``"raise"``):
    ``None`` once taken, else who holds it. A take that raises a Redis error or
    ``LockNotReplicated`` was given back (by ``RedisLock``)."""
    lock = RedisLock(client, key, ttl, watchdog=False, holder=holder, **task.lock_settings.replication)
    sent_at = time.monotonic()
    fence = lock.try_as(token)
    if fence is None:
        return lock.busy
    lock.take_hold(token, fence, sent_at)  # acknowledged by replicas where set, else LockNotReplicated
    return None


def _replace(task: Any, client: Any, key: str, ttl: float, holder: str, task_id: str, token: str) -> _Taken:
    """Take ``key`` for ``token``, free or from the queued message holding it
    (``lock_duplicate="replace"``): ``None`` once taken free, ``"duplicate-replaced"`` once taken
    over, else who holds it. A take that raises a Redis error was given back."""
    try:
        reply = REPLACE(client, [key], [token, holder, to_ms(ttl), task_id])
    except redis.RedisError:  # the script may have run (a lost reply): undo it
        _undo(task, key, task_id, partial(UNREPLACE, client, [key], [token]))
        raise
    status = text(reply[0])
    if status == "busy":
        held_by, pttl_ms = busy_reply(reply[1:])
        return held_by, seconds_left(pttl_ms)
    if status == "replaced":
        old = parse_value(reply[1])
        old_holder = None if old is None else old.holder
        logger.info(
            "task %s[%s]: takes enqueue lock %s over from task %s, which is superseded",
            task.name,
            task_id,
            key,
            parse_holder(old_holder).get("task"),
            extra=log_fields(key, task_id, old_holder, outcome="duplicate-replaced"),
        )
        return "duplicate-replaced"
    return None


def give_up_ticket(
    client: Any, ticket: tuple[str, str], continues: bool, options: LockOptions | None, why: str
) -> str | None:
    """A message carrying ``ticket`` will never adopt the hold queued for it (``why``: it failed
    before adopting it, was revoked, its pool child died). Free that hold, owner-checked by
    the token, and log it: ``"released"``, ``"settled"`` (kept for what is left of
    ``lock_period``), or ``None`` (not the token's, or not parked yet: marked).

    ``continues``: the ticket may be the hold of the run the message continues, a retry or a
    replacement (``protocol.request_continues_hold``: not an enqueue lock its send took
    afresh, which is freed as a first message's), which, in a mode that parks one, may not be
    parked for it yet: ``DECLINE`` then marks its token (for ``lock_queue_ttl``), and the park
    lets go of the hold instead. A parked hold's run ran: it is kept for what is left of
    ``lock_period``, as after any run of an ``until_expired`` task. ``options`` ``None`` (a task
    this app does not register, its mode unknown): marked for the default ``lock_queue_ttl``,
    and a hold parked already is let go of with the period its holder names (the parking run's,
    ``run_lock.park``; none named, by an older version: freed); the park, if one comes, lets go
    with the run's mode."""
    if not continues or (options is not None and not options.rules.parks_for_retry):
        outcome = "released" if release_token(client, *ticket) else None
    else:
        queue_ttl, period_ms = (
            (TASK_OPTIONS["queue_ttl"], 0) if options is None else (options.queue_ttl, options.period_ms)
        )
        done = int(DECLINE(client, [ticket[0]], [ticket[1], to_ms(queue_ttl), period_ms]))
        outcome = LET_GO.get(done)
    if outcome is not None:
        extra = log_fields(ticket[0], outcome=outcome)
        logger.info("%s: its enqueue lock %s %s", why, ticket[0], outcome, extra=extra)
    return outcome


def duplicate(task: Any, key: str, holder: str | None, ttl: float | None, *, dispatched: bool = False) -> Any:
    """An enqueue found ``key`` held: the existing task's result, or ``DuplicateTask``.

    ``dispatched``: the message is one Celery's worker sends for the task that just ended (a
    ``link`` callback, sent with its ``parent_id``, before that task's result is stored): it
    gets the existing task's result (``None`` if unknown) whatever ``lock_duplicate`` says;
    raised there, ``DuplicateTask`` would fail the task that succeeded."""
    existing = parse_holder(holder).get("task")
    fields = log_fields(key, None, holder, None, "duplicate-refused")
    logger.info("task %s: not sent, duplicate of %s (lock %s)", task.name, existing, key, extra=fields)
    counted(task.name, task.lock_options.mode, "duplicate-refused")
    signals.task_deduplicated.send(sender=task, key=key, existing_task_id=existing)
    if dispatched or (task.lock_options.duplicate != "raise" and existing):
        return task.AsyncResult(existing) if existing else None
    raise DuplicateTask(key, existing, holder, ttl)


def dropped_as_superseded(request: Any) -> bool:
    """Whether ``superseded`` found the worker's message ``request`` superseded (it is dropped)."""
    return bool(getattr(request, "lock_superseded", False))


def superseded(task: Any, client: Any, request: Any, *, free: bool = False, count: bool = True) -> bool:
    """Whether the worker's message ``request`` was superseded by a later replacing call (its
    first attempt's enqueue lock taken over): then it is dropped, logged and signalled.

    With ``free``, a message not superseded has its enqueue lock freed in the
    same step (owner-checked): no replacing call can land between the check
    and the free. A retry (``self.retry``, autoretry) is never superseded:
    only a queued first attempt is taken over. A busy retry's republished
    message is the same first attempt, its body not run yet: it is. The mark
    stays, as dropped, as long as the lock could have lived: a copy of the
    message delivered again (``acks_late``) is dropped too. ``count``: record
    the outcome ``superseded`` (not where the caller records the run's own:
    ``dropped_as_superseded`` then tells it).
    """
    ticket = None if request is None else request_ticket(request)
    if ticket is None:
        return False
    if request.retries:
        if free:
            release_token(client, *ticket)
        return False
    reply = DROP(client, [ticket[0]], [ticket[1], "1" if free else "0"])
    if text(reply[0]) != "superseded":
        return False
    by = text(reply[1])
    logger.info(
        "task %s[%s] dropped: superseded by task %s, which took its enqueue lock %s over",
        task.name,
        request.id,
        by,
        ticket[0],
        extra=log_fields(ticket[0], request.id, outcome="superseded"),
    )
    request.lock_superseded = True
    if count:
        counted(task.name, task.lock_options.mode, "superseded")
    signals.task_deduplicated.send(
        sender=task, key=ticket[0], existing_task_id=by, superseded_task_id=request.id
    )
    return True
