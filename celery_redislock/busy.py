"""What a run does when it finds its execution lock held: the ``lock_busy`` policies.

``when_busy`` first decides whose hold it is (``policy_for``): the run's own
message delivered again, a stale copy of an earlier attempt or replaced run,
the run it continues (its previous attempt, or the run it replaces) letting
go (not an earlier attempt of other arguments, over, keeping the lock for
its ``lock_period``: that one is met as any call's, also once the wait for
it sees it kept), or a group or chord member, which is never skipped. Only
then does the task's ``lock_busy`` (``skip``, ``retry``, ``wait``, ``raise``) apply, with
``retry`` as ``wait`` where the run cannot be retried later (an eager or
direct call). Each outcome is a small policy object: ``True`` runs the body
(the lock is now held), ``False`` skips it; the others raise (``Ignore``,
``Retry``, ``LockNotAcquired``). How a copy of a message learns how its first delivery's
hold ends, before it is ignored or run, is ``redelivery``'s; what the run knows of the hold it
found is a ``found.Found``.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NoReturn, Protocol, cast

import redis
from celery.exceptions import Ignore, Reject, Retry

from . import signals
from ._durations import to_ms
from ._scripts import RENEW
from .attempt import seconds_left
from .enqueue import superseded
from .exceptions import LockNotAcquired
from .found import Found
from .inventory import hold_of, leave_queue_of, release_token
from .protocol import (
    BEAT_HEADER,
    REPUBLISH,
    held_attempt,
    parse_holder,
    replaced_nesting,
    request_slot,
    request_ticket,
    slot_republished,
)
from .redelivery import first_delivery
from .run_lock import KEPT, PARKED, adopt, watch_end

__all__ = ["OUTCOMES", "POLICIES", "BusyPolicy", "policy_for", "skipped", "when_busy"]

logger = logging.getLogger(__name__)


class BusyPolicy(Protocol):
    def __call__(self, found: Found) -> bool:
        """``True``: the lock is held now, run the body; ``False``: skip it; or raise."""


def when_busy(found: Found) -> bool:
    """Apply the policy for ``found`` (``lock_busy``, after the overrides of ``policy_for``); the
    ``lock_busy`` signal's ``outcome`` is the policy's (``OUTCOMES``: ``busy-wait`` for an override)."""
    policy = policy_for(found)
    signals.lock_busy.send(
        sender=found.task,
        key=found.lock.name,
        task_id=found.task_id,
        holder=found.holder,
        outcome=OUTCOMES.get(policy, "busy-wait"),
    )
    return policy(found)


def policy_for(found: Found) -> BusyPolicy:
    """The policy for ``found``: an override where the hold is this task's own or the run must not
    be skipped (or cannot be retried), else the task's ``lock_busy``."""
    request = found.request
    held_by = parse_holder(found.holder)
    if request is not None and held_by.get("task") == request.id:
        held, this = held_attempt(held_by), (replaced_nesting(request), request.retries or 0)
        if held == this and held_by.get("state") == "running":
            return _redelivered
        if held > this:
            return _stale_copy
        if held < this:  # an earlier run of its task id: the one it continues, letting go now
            ticket = request_ticket(request)
            if found.options.rules.parks_for_retry and ticket is not None and ticket[0] == found.lock.name:
                return AdoptParked(ticket[1])
            if not _kept(found):
                return _earlier_run
            # over, and keeping these arguments' lock for its period (a retry with other arguments
            # came back to them): as for any call of them within the period, ``lock_busy`` applies
    if request is not None and (request.group or request.chord):
        return _wait  # a group or chord member is never skipped: its chord would never complete
    if found.options.rules.adopts_ticket and found.options.duplicate == "replace" and _superseded(found):
        return _dropped  # taken over after the run checked, before it adopted its lock: as superseded
    if request is None or request.is_eager:  # an eager or direct call has no message to act on
        if found.options.busy == "retry":
            return _wait  # it cannot be retried later
        if found.options.busy == "reject":
            return _raise  # nor rejected
    return POLICIES[found.options.busy]


def _kept(found: Found) -> bool:
    """Whether ``found``'s hold is one its run, over, keeps for the rest of ``lock_period`` (one
    round trip, in the modes that keep one). A Redis error here is not one: waited for, as before."""
    if not found.options.rules.settles or found.holder is None:
        return False
    with suppress(redis.RedisError):
        value = hold_of(found.lock.client, found.lock.name, found.holder)
        return value is not None and value.kept
    return False


def _superseded(found: Found) -> bool:
    """Whether ``found``'s message was superseded meanwhile (counted once: as the run's outcome).
    A Redis error here is not one: the busy policy still applies, never an unlocked run."""
    with suppress(redis.RedisError):
        return superseded(found.task, found.lock.client, found.request, count=False)
    return False


def _dropped(found: Found) -> bool:
    """The message was superseded (``enqueue.superseded`` logged it): its body does not run."""
    return False


def _skip(found: Found) -> bool:
    logger.info(
        "task %s[%s] skipped: lock %s is held by task %s (%s)",
        found.task.name,
        found.task_id,
        found.lock.name,
        parse_holder(found.holder).get("task"),
        found.holder,
        extra=found.log_fields("busy-skip"),
    )
    return False


def _retry(found: Found) -> bool:
    """Republish the message after ``lock_retry_delay`` (with jitter), with the same retry count:
    a busy lock is not one of the task's own retries."""
    task, lock, request, options = found.task, found.lock, found.request, found.options
    delay = options.retry_delay * random.uniform(0.5, 1.5)
    logger.info(
        "task %s[%s] retries in %.1fs: lock %s is held by task %s",
        task.name,
        found.task_id,
        delay,
        lock.name,
        parse_holder(found.holder).get("task"),
        extra=found.log_fields("busy-retry"),
    )
    signature = task.signature_from_request(
        request, found.args, found.kwargs, countdown=delay, retries=request.retries
    )
    slot = request_slot(request)
    if slot is not None:  # its run has the slot: the message queued again takes it over (``CLAIM``)
        again = {**slot, "again": slot_republished(slot) + 1}
        signature.options["headers"] = {**(signature.options.get("headers") or {}), BEAT_HEADER: again}
    ticket = request_ticket(request)
    if ticket is not None and options.rules.frees_ticket:
        # Queued again, with the same enqueue lock: it lives as long as at enqueue (owner-checked).
        # A Redis error leaves it as it is: republished is the outcome, never an unlocked run beside
        # the holder (``redislock_on_error="run"``).
        with suppress(redis.RedisError):
            RENEW(lock.client, [ticket[0]], [to_ms(options.queue_ttl + delay), ticket[1]])
    # The same message queued again, never refused as a duplicate (one sent without an enqueue
    # lock, by ``send_task`` say, would be, by the queued message's: nothing sent, RETRY forever).
    signature.apply_async(**{REPUBLISH: True})
    # Queued again: whatever ends this run now (the Retry below, or a soft time limit landing
    # before it), the message's enqueue lock is the queued copy's (``Execution._begin``).
    request.lock_republished = True
    raise Retry(f"lock {lock.name} is held by {found.holder}", when=cast(Any, delay), sig=signature)


def _wait(found: Found) -> bool:
    """Wait for the lock (woken by its release) up to ``lock_wait_timeout`` (``Found.wait_ends``);
    then as ``raise``."""
    if found.lock.acquire(timeout=max(found.wait_ends() - time.monotonic(), 0.0)):
        return found.took()
    raise LockNotAcquired(found.lock.name, *found.lock.busy)


def _earlier_run(found: Found) -> bool:
    """An earlier run of this task id holds the lock, still running (the run this message
    continues, letting go now, or an attempt of these arguments before a retry of other ones came
    back to them): wait for it as ``_wait`` does. Where the mode keeps a hold for its period, the
    wait watches the hold (``run_lock.watch_end``): a run that ends and keeps it, or parks it for
    its retry or replacement, wakes this one, which then meets it as any run does
    (``_met_again``); its release hands it over here, taken with a fence of the run's own."""
    lock, token, sent_at = found.lock, secrets.token_hex(16), time.monotonic()
    if not found.options.rules.settles:
        return _wait(found)
    found = replace(found, deadline=found.wait_ends())  # the hold met next is waited for until then too
    try:  # ``token``, which nothing else knows, may be granted the lock: given back if this is cut short
        watched, fence = watch_end(lock, found.holder or "", token, found.wait_ends())
        if fence is not None and fence == watched:  # handed over by its release, that run's fence kept
            return _adopt(found, token)
        if fence is not None and fence not in (KEPT, PARKED):
            lock.take_hold(token, fence, sent_at)  # free, taken here (that run's lease ran out)
    except BaseException:  # an interrupt (a soft time limit) before it was adopted or recorded
        lock.give_back(token)
        raise
    if KEPT in (watched, fence) or fence == PARKED:  # over already and kept, or woken by the keep or the park
        return _met_again(found)
    if fence is not None:  # taken free above
        return found.took()
    if not watched:  # 0: a copy of that run's message watches it; None: that run let go of it
        return _wait(found)
    raise LockNotAcquired(lock.name, *lock.busy)


def _met_again(found: Found) -> bool:
    """The hold ``found`` waited for changed meanwhile (kept for its period, parked): the lock is
    taken if free now, else met as any run meets a held lock (``when_busy``, its holder read
    afresh), a wait for it ending by ``found.deadline``."""
    lock, asked = found.lock, time.monotonic()
    if lock.acquire(blocking=False):
        return found.took()
    (holder, ttl), seen = lock.busy, time.monotonic()
    return when_busy(replace(found, holder=holder, ttl=ttl, asked=asked, seen=seen))


def _adopt(found: Found, token: str) -> bool:
    """Adopt the hold ``token`` owns now (parked or handed over to it, or taken free), or the one
    the run a retry or replacement continues kept for its period instead of parking it for
    ``token`` (``ADOPT`` takes that over), under a token and a fence of the run's own
    (``run_lock.adopt``). Gone since (a copy of the message that gave
    it up freed it): taken afresh, as a run whose message's hold is gone is; else
    ``LockNotAcquired``."""
    lock = found.lock
    busy = adopt(lock, token)
    if busy is None:
        return found.took()
    holder, ttl = busy[0], seconds_left(busy[1])
    if busy[1] == -2:
        if lock.acquire(blocking=False):
            return found.took()
        holder, ttl = lock.busy
    raise LockNotAcquired(lock.name, holder, ttl)


def _raise(found: Found) -> bool:
    raise LockNotAcquired(found.lock.name, found.holder, found.ttl)


def _reject(found: Found) -> bool:
    """Reject the message, not requeued (``Reject``): dead-lettered where the broker does it (with
    ``acks_late``; else it was acknowledged when received). Its enqueue lock, if any, goes."""
    lock, holder = found.lock, found.holder
    logger.info(
        "task %s[%s] rejected: lock %s is held by task %s",
        found.task.name,
        found.task_id,
        lock.name,
        parse_holder(holder).get("task"),
        extra=found.log_fields("busy-reject"),
    )
    ticket = request_ticket(found.request)
    if ticket is not None and found.options.rules.frees_ticket:
        with suppress(redis.RedisError):  # rejected is the outcome, never an unlocked run (on_error)
            release_token(lock.client, *ticket)
    raise Reject(f"lock {lock.name} is held by {holder}", requeue=False)


#: ``lock_busy`` -> its policy.
POLICIES: Mapping[str, BusyPolicy] = MappingProxyType(
    {"skip": _skip, "retry": _retry, "wait": _wait, "raise": _raise, "reject": _reject}
)


def skipped(task: Any, request: Any) -> None:
    """What a run whose body did not run returns (skipped, a duplicate, superseded): ``None``
    (``SUCCESS`` with ``None``); with ``redislock_skip_state`` set, a worker's run stores that
    state as its result and raises ``Ignore``, so that Celery stores nothing over it (not a
    member of a group or chord, whose ``Ignore`` would leave it waiting forever, nor a chain's
    member with members after it, which ``Ignore`` would leave unsent, nor a run whose result
    is ignored: the request's ``ignore_result`` or the task's)."""
    state = task.lock_settings.skip_state
    if state is None or request is None or request.is_eager or request.group or request.chord:
        return
    if request.chain:
        return
    if request.ignore_result or task.ignore_result:
        return
    task.update_state(state=state, meta=None)
    raise Ignore()


def _ignored(found: Found, why: str, *args: Any) -> NoReturn:
    """Log that ``found``'s run is ignored, ``why`` (a format of ``args``), and ignore it."""
    logger.info(
        "task %s[%s]: " + why, found.task.name, found.task_id, *args, extra=found.log_fields("busy-skip")
    )
    raise Ignore()


def _stale_copy(found: Found) -> bool:
    """A copy of an earlier attempt (a redelivery): a later attempt is queued or running."""
    _ignored(found, "a later attempt holds %s; this stale copy is ignored", found.lock.name)


def _redelivered(found: Found) -> bool:
    """A redelivered message (acks_late, visibility timeout, a dead consumer's messages), its lock
    held by its own first delivery: ignored while that delivery runs or another copy of the
    message (or a later attempt of its task id) watches its hold, and once it ended (at once
    where the run keeps its hold for ``lock_period``, also when that happens as the copy watches
    it, and where, as the copy watches, the run parks its hold for its retry or replacement: the
    message's continuation); run if its worker died, or, where another run of the key took the
    lock first, handled as any run that finds the lock busy."""
    task, lock = found.task, found.lock
    fate = first_delivery(found)
    if fate == "kept":
        why = "redelivered once its first delivery ran, which keeps lock %s for lock_period; ignored"
        _ignored(found, why, lock.name)
    if fate == "parked":
        why = "redelivered once its first delivery handed lock %s to its retry or replacement; ignored"
        _ignored(found, why, lock.name)
    if fate == "alive":
        _ignored(found, "redelivered while its first delivery runs; ignored")
    if fate == "watched":
        _ignored(
            found, "redelivered while another copy or a later attempt waits for its first delivery; ignored"
        )
    asked = time.monotonic()
    if lock.held() or lock.acquire(blocking=False):
        logger.warning(
            "task %s[%s]: redelivered after its first delivery's worker died (its lease on %s "
            "ran out); running it",
            task.name,
            found.task_id,
            lock.name,
            extra=found.log_fields("busy-wait"),
        )
        return found.took()
    (holder, ttl), seen = lock.busy, time.monotonic()
    logger.warning(
        "task %s[%s]: redelivered after its first delivery's worker died (its lease on %s ran "
        "out); %s took the lock first, lock_busy applies",
        task.name,
        found.task_id,
        lock.name,
        holder,
        extra=found.log_fields("busy-wait"),
    )
    return when_busy(replace(found, holder=holder, ttl=ttl, asked=asked, seen=seen))


@dataclass(frozen=True)
class AdoptParked:
    """A retry or replacement carrying ``token`` found the run it continues still holding the lock."""

    token: str

    def __call__(self, found: Found) -> bool:
        """Wait (at most ``lock_wait_timeout``) until that run parks the hold for ``token`` (its
        park wakes this waiter) or frees it, then adopt it. Not woken in time: adopted all the
        same where ``ADOPT`` can (that run ended and kept the hold for its period without parking
        it, as when an interrupt landed between its send of this message and its record of it:
        taken over; parked or freed just now); else ``LockNotAcquired``. Cut short (an interrupt
        such as a soft time limit), the wait leaves the queue and a hold parked for ``token`` as
        it is: the run's failure gives it up as the mode says, kept for the rest of its period
        where the mode keeps one (``Execution._free_unadopted_hold``: ``DECLINE``)."""
        lock = found.lock
        try:
            lock.wait_as(self.token, found.wait_ends(), keep=True)
        except BaseException:
            with suppress(redis.RedisError):  # else dropped after its deadline, as a dead waiter is
                leave_queue_of(lock.client, lock.name, lock.holder or "")
            raise
        return _adopt(found, self.token)  # woken: ``token`` owns the hold (parked for it, or taken free)


#: A policy -> the outcome it goes for (``telemetry.OUTCOMES``); the others (``_redelivered``,
#: ``AdoptParked``) wait.
OUTCOMES: Mapping[BusyPolicy, str] = MappingProxyType(
    {
        _skip: "busy-skip",
        _retry: "busy-retry",
        _wait: "busy-wait",
        _raise: "busy-raise",
        _reject: "busy-reject",
        _stale_copy: "busy-skip",
        _dropped: "superseded",
    }
)
