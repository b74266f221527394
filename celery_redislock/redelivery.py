"""How a message delivered again learns how its first delivery's hold ends (``first_delivery``).

A redelivered copy (``acks_late``, a visibility timeout, a dead consumer's messages) that finds
its lock held by its own first delivery watches that hold (``run_lock.watch_end``) for at most a
renewal interval, or the rest of the lease of a holder that renews no more: the release hands
it the hold, a run that keeps it for its period or parks it for its retry wakes it, and a hold
gone otherwise ran out. ``busy`` acts on the answer (the copy ignored, or run).
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

from .found import Found
from .protocol import held_attempt, parse_holder
from .run_lock import KEPT, PARKED, release, watch_end

__all__ = ["Fate", "first_delivery", "watch_until"]


#: How a redelivered copy's first delivery stands (``first_delivery``).
Fate = Literal["alive", "died", "kept", "parked", "watched"]

#: Seconds: a hold found gone this close to the end of its lease, or later, may have run out.
_MARGIN = 0.1


def first_delivery(found: Found) -> Fate:
    """How the first delivery holding the lock, its lease ending ``found.ttl`` seconds after
    ``found.asked`` at the earliest and ``found.seen`` at the latest, stands: ``"kept"``, its
    run is over and keeps its hold for the rest of ``lock_period``;
    ``"parked"``, its run parked its hold for its retry or replacement, which adopts it;
    ``"died"``, that lease ran out unrenewed (the lock is then held here, or ``lock.busy``
    names the run that took it first); ``"alive"``, it renewed the lease, or let go of it (it
    ran to its end or retried in a mode that keeps nothing, or its pool child died and the
    worker released for it); ``"watched"``, another copy of the message, or a later attempt of
    its task id, watches the hold already, and acts on how it ends.

    This copy watches the hold (``run_lock.watch_end``): its release hands it over here, whoever
    else waits for it, and a run that keeps it for its period or parks it for its retry wakes
    this copy (a kept hold is never watched: the watch answers that at once), so a hold gone
    otherwise ran out (unless it went well before the end of its lease, let go of otherwise). A
    live holder renews every ``lock_ttl/3``, so this waits at most one renewal interval for a
    live holder, and the rest of the lease for a dead one; it is woken at once by a release, a
    keep or a park.
    """
    ends = found.seen + (found.ttl or 0.0)  # at the latest, unless renewed
    interval = min(found.options.ttl / 3, ends - time.monotonic() - _MARGIN)
    fate = watch_until(found, ends, time.monotonic() + interval) if interval > 0 else None
    if fate is None:  # not renewed for an interval: watch it until its lease ends
        fate = watch_until(found, ends, ends + _MARGIN)
    return fate or "alive"


def watch_until(found: Found, ends: float, until: float) -> Fate | None:
    """Watch the first delivery's hold (with ``lock_limit`` above 1, its permit), its lease ending
    at monotonic ``ends`` at the latest unless renewed, until monotonic ``until``: how it stands,
    as ``first_delivery`` says, or ``None`` when it still holds the lock, not renewed."""
    lock, token, sent_at = found.lock, secrets.token_hex(16), time.monotonic()
    try:  # ``token``, which nothing else knows, may be granted the lock: given back if this is cut short
        watched, fence = watch_end(lock, found.holder or "", token, until)
        if fence is not None and fence == watched:  # handed over by its release: the first delivery let go
            lock.servers.free(token)
            return "alive"
        if fence is not None and fence not in (KEPT, PARKED):
            lock.take_hold(token, fence, sent_at)  # free, taken here
    except BaseException:  # an interrupt (a soft time limit) before it was freed or recorded
        lock.give_back(token)
        raise
    if KEPT in (watched, fence):  # over already and kept, or woken by the keep
        return "kept"
    if fence == PARKED:  # woken by the run parking it
        return "parked"
    if watched == 0:
        return "watched"  # another copy (or a later attempt) watches it, and acts on its end
    if watched is None:  # gone already
        return _gone(found)
    if fence is not None:  # taken free above
        if _ran_out(found) == "died":
            return "died"
        release(found.task, lock, None, announce=False)  # let go of early: gone, never handed
        return "alive"
    holder, left = lock.busy
    if holder == found.holder:
        return "alive" if (left or 0.0) > ends - time.monotonic() + _MARGIN else None  # renewed
    return _gone(found)  # another run took it, not handed over


def _gone(found: Found) -> Fate:
    """The fate of a first delivery whose hold is gone, not handed to this copy: ``"parked"`` when
    the message that continues its run has it (``_continued``), else as ``_ran_out`` says."""
    return "parked" if _continued(found) else _ran_out(found)


def _ran_out(found: Found) -> Fate:
    """``"died"`` when the lease of ``found``'s hold, unrenewed, may have run out by now (its
    earliest end: ``found.asked`` on), else ``"alive"``."""
    return "died" if time.monotonic() >= found.asked + (found.ttl or 0.0) - _MARGIN else "alive"


def _continued(found: Found) -> bool:
    """Whether the lock, no longer held by ``found.holder``, went to the message that continues
    that run (its retry or replacement, parked for it, or running since): ``lock.busy`` names a
    later message of its task id."""
    then, now = parse_holder(found.holder), parse_holder(found.lock.busy[0])
    task = then.get("task")
    return task is not None and now.get("task") == task and held_attempt(now) > held_attempt(then)
