"""One run of a ``LockedTask``'s body: take its lock, deal with a busy one, let it go.

Where each outcome is handled:

* the body ends (SUCCESS, FAILURE, RETRY, IGNORED, REJECTED): ``LockedTask.__call__``
  lets go (``Execution.let_go``) in a ``finally``, before Celery stores the
  result (a worker's run sends its release there and ``receivers.after_run``
  reads the reply: ``run_lock.release_later``; after ``Retry``, ``Ignore`` or
  ``Reject``, for which Celery calls no ``after_return``, it waits for the reply); the
  end of the run's trace (its request popped: ``receivers.RunRequests``) reads a reply
  left unread and lets go of a lock an asynchronous exception (a soft time limit)
  kept that ``finally`` from letting go, as the mode says (``Execution.finish``): kept
  or released; a direct call, which has no trace, does that in its ``__call__``
  (``Execution.cut_short``), for an interrupt in ``begin`` too;
* a step between taking the lock and running the body fails (a Redis error
  freeing the message's enqueue lock): the lock is released on the way out; with
  ``redislock_on_error="run"`` the body runs unlocked, and the enqueue lock is freed as it
  ends (``Execution._free_kept_ticket``);
* the run fails before its body (refused, a timed-out or interrupted wait, a failed
  republish): the message's enqueue lock is freed where the mode frees it;
* the lock is lost while the body runs: see ``run_lock.ExecutionLock``;
* the pool child dies (SIGKILL, OOM, hard time limit, ``revoke(terminate=True)``,
  ``lock_on_lost="terminate"``): the worker's main process releases the lock, and
  the message's enqueue lock if still there, once the child is gone, owner-checked
  (``celery_redislock.request.LockedRequest``);
* the whole worker dies: nothing renews the lease, and it expires within
  ``lock_ttl``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, suppress
from typing import Any, NoReturn

import redis
from celery.exceptions import Ignore, Reject, Retry

from . import signals, state, telemetry
from ._durations import to_ms
from ._process import current_pid
from ._task_scripts import CLAIM, LET_GO, SETTLE
from .attempt import hostname, seconds_left
from .busy import when_busy
from .config import AppSettings, LockOptions, check_task_id, run_key
from .connection import ClientUnavailable, client_for
from .enqueue import checked_delay, dropped_as_superseded, enqueue_retry, give_up_ticket, superseded
from .exceptions import LockKeyError, LockNotReplicated, RedisLockError
from .found import Found
from .inventory import release_token
from .protocol import (
    HEADER,
    holder_for,
    parse_holder,
    replaced_nesting,
    request_continues_hold,
    request_slot,
    request_ticket,
    sent_attempt,
    slot_republished,
    text,
)
from .run_lock import (
    EMPTY_BLOCK,
    ExecutionLock,
    acquired,
    adopt,
    announce_released,
    finish_release,
    park,
    release,
    release_later,
)
from .state import app_state

__all__ = ["Execution", "continued_run", "send_continuation"]

logger = logging.getLogger(__name__)

#: The retry or replacement a run sent, which it parks its hold for (``request.lock_retry``):
#: the key, the token its message carries, its delay (s) and its (retries, replacement depth).
Continuation = tuple[str, str, float, tuple[int, int]]


def continued_run(task: Any, task_id: str | None, options: Mapping[str, Any]) -> Any:
    """The request of the locked run of ``task`` under way here that a message for ``task_id``
    sent with ``options`` continues, whatever its arguments: its retry (``self.retry``,
    autoretry: the next retry count) or its replacement (``task.replace()``: one replacement
    deeper), if any. ``task.request`` is read only for a message that names its task id."""
    if task_id is None:  # the common send: no need to read the request (a few µs, Celery's)
        return None
    running = task.request
    if running.id != task_id or not hasattr(running, "lock_key"):
        return None
    retries, depth = sent_attempt(options)
    if retries == (running.retries or 0) + 1 or depth > replaced_nesting(running):
        return running
    return None


def send_continuation(
    task: Any,
    running: Any,
    key: str,
    options: Mapping[str, Any],
    headers: dict[str, Any],
    send: Callable[[str | None], Any],
    in_canvas: bool,
) -> Any:
    """Send (``send``, with ``headers``) the message that continues the run ``running`` (its
    retry or replacement, ``continued_run``), for the lock ``key``: never refused as a duplicate
    of that run, nor of another message.

    * The key ``running`` holds, in a mode that keeps the lock between runs: the message carries
      a token of its own, for which the run parks its hold when it lets go (``keep``), and which
      only that message adopts;
    * another key (other arguments): the run lets go of its own hold as after any run, and the
      ticket the message inherited from it (Celery copies a retry's headers) is dropped. It
      takes that key's enqueue lock (not as a member of a canvas), or goes without it when
      another message holds it: its worker then finds the key held (``enqueue_retry``).

    Where a lock is taken or parked for it, a ``countdown``, ``eta`` or ``expires`` that is no time
    raises ``LockConfigurationError`` naming it before anything is sent (``checked_delay``)."""
    rules = task.lock_options.rules
    if running.lock_key == key and rules.parks_for_retry and running.lock_fence is not None:
        delay = checked_delay(task, options)  # an eta that is no time: raised, nothing sent
        token = secrets.token_hex(16)
        headers[HEADER] = {"key": key, "token": token}
        result = send(running.id)
        # once sent: the run parks its hold for it as it lets go
        running.lock_retry = (key, token, delay, sent_attempt(options))
        return result
    if running.lock_key != key:
        headers.pop(HEADER, None)
        if rules.enqueue_lock and not in_canvas:
            return enqueue_retry(task, key + rules.queued_suffix, running.id, options, headers, send)
    return send(running.id)


class Execution:
    """The run of ``task`` with ``args``/``kwargs`` under the lock ``key``.

    ``request`` is the worker's (or apply()'s) request, ``None`` for a direct
    call. ``lock`` is ``None`` in a mode without an execution lock, and once a
    Redis error made the run go on unlocked (``redislock_on_error="run"``).
    """

    __slots__ = (
        "args",
        "client",
        "key",
        "kwargs",
        "lock",
        "node",
        "options",
        "outer",
        "request",
        "retries",
        "settings",
        "slot",
        "task",
        "task_id",
        "ticket",
        "unreturned",
        "url",
        "went_unlocked",
    )

    #: the run this one was started in (``state.run_started``), once in ``state.running``
    outer: state.Run | None
    #: what the body raised of ``Retry``, ``Ignore`` or ``Reject`` (Celery calls no ``after_return``)
    unreturned: BaseException | None
    #: a Redis error as the run began made it go on unlocked (``redislock_on_error="run"``)
    went_unlocked: bool

    def __init__(
        self,
        task: Any,
        options: LockOptions,
        settings: AppSettings,
        key: str,
        request: Any,
        args: Any,
        kwargs: Any,
    ) -> None:
        self.task, self.options, self.settings, self.key = task, options, settings, key
        self.request, self.args, self.kwargs = request, args, kwargs
        self.task_id: str | None = None if request is None else request.id
        self.retries: int = 0 if request is None else request.retries or 0
        self.node: str = (None if request is None else request.hostname) or hostname()
        self.lock: ExecutionLock | None = None
        self.unreturned, self.went_unlocked = None, False
        if not settings.enabled:  # redislock_enabled=False: no ticket, slot, lock; ``client``, ``url`` unset
            self.ticket = self.slot = None
            return
        check_task_id(task, self.task_id)  # a holder names it; send_task checks none
        self.ticket = None if request is None else request_ticket(request)
        slot = None if request is None else request_slot(request)
        # a beat slot counts only if the task or its schedule entry opted in
        self.slot = slot if slot is not None and (options.beat or slot.get("claimed")) else None
        try:
            self.client, self.url = client_for(task.app)
        except ClientUnavailable as exc:  # as Redis unreachable: ``redislock_on_error``
            self.ticket = self.slot = None  # ``client``, ``url`` unset: nothing reads them unlocked
            self.unlocked(f"task {task.name!r}[{self.task_id}]: could not lock {key!r}: {exc}", exc)
            return
        if options.rules.execution_lock:
            self.lock = ExecutionLock(
                self.client,
                key,
                options.ttl,
                holder_for(
                    self.task_id, self.retries, self.node, current_pid(), replaced=replaced_nesting(request)
                ),
                settings,
                task_name=task.name,
                raise_on_lost=options.on_lost != "log",
                stop_child=options.on_lost == "terminate" and self._stops_child(),
                limit=options.limit,
            )
            self.lock.request = request
            # From here on, what an asynchronous exception leaves held is the trace's end's to let go
            # (``finish``).
            if self.task_id is not None:
                state.run_started((threading.get_ident(), self.task_id), self)

    def begin(self) -> bool:
        """Everything before the body: whether it runs (``False``: skipped, or a duplicate).

        Raises for ``lock_busy="raise"``, ``"retry"``, a timed-out ``"wait"``; a
        Redis error raises ``RedisLockError``, or with ``redislock_on_error="run"``
        the body runs unlocked.
        """
        try:
            return self._begin()
        except (redis.RedisError, LockNotReplicated) as exc:  # not replicated: as unreachable
            where = (
                f"task {self.task.name!r}[{self.task_id}]: "
                f"could not lock {self.key!r} in Redis at {self.url}: {exc}"
            )
            self.unlocked(where, exc)
            self._over()  # unlocked: nothing left to finish
            self.lock, self.went_unlocked = None, True
            return True

    def unlocked(self, where: str, exc: Exception) -> None:
        """The lock could not be taken (``where`` says why): raise ``RedisLockError``, or with
        ``redislock_on_error="run"`` log that the body runs unlocked."""
        if self.settings.on_error == "fail":
            raise RedisLockError(where) from exc
        logger.warning(
            "%s; running unlocked (redislock_on_error='run')",
            where,
            extra=telemetry.log_fields(self.key, self.task_id, outcome="unlocked"),
        )

    def _begin(self) -> bool:
        """Claim the beat slot, take the lock, free the message's enqueue lock where the mode says."""
        if self.options.duplicate == "replace" and superseded(self.task, self.client, self.request):
            return False  # a later call took its enqueue lock over: that call's message runs instead
        if self.slot is not None and not self._claim_slot(self.slot):
            if self.ticket is not None:  # a duplicate never runs: its enqueue lock, if any, goes
                release_token(self.client, *self.ticket)
            return False
        # Where the mode frees it, the message's enqueue lock goes once the message is dealt with
        # here: run, skipped or failed (refused, a failed wait or republish, an interrupt such as a
        # soft time limit while waiting); not when it is republished (Retry) or ignored as a twin,
        # nor, with ``acks_late``, when the process is exiting (not an ``Exception``: a pool child
        # stopped at its hard time limit), its message maybe requeued: the worker's main process
        # frees it then if the message is acknowledged for good (``LockedRequest``).
        ticket_to_free = self.ticket if self.options.rules.frees_ticket else None
        try:
            taken = self.lock is None or self.take(self.lock, ticket_to_free)
        except (Retry, Ignore):
            raise
        except BaseException as exc:
            if not getattr(self.request, "lock_republished", False):
                # The failure is the outcome: an error freeing the enqueue lock must not turn it
                # into an unlocked run beside the holder (redislock_on_error="run").
                with suppress(redis.RedisError):
                    if ticket_to_free is not None:
                        if isinstance(exc, Exception) or not getattr(self.task, "acks_late", False):
                            self._free_message_lock(ticket_to_free, None)
                    else:
                        self._free_unadopted_hold(exc)
            raise
        if self.lock is None and ticket_to_free is not None and self._free_message_lock(ticket_to_free, None):
            return False  # superseded since the check above: dropped
        return taken

    def _free_unadopted_hold(self, failure: BaseException) -> None:
        """Where the mode adopts the message's enqueue lock (or the hold parked for a retry's or a
        replacement's message), and the run failed (``failure``) before adopting it (an interrupt
        such as a soft time limit before ``ADOPT`` was sent, or as a retry adopts the hold its
        previous attempt parked and handed it, or as a retry gives up waiting for that attempt to
        park it): free the hold still queued for the message, owner-checked by its token, never
        one a run adopted; a hold not parked yet is let go of by the park (``give_up_ticket``).
        Nothing will adopt it any more: left, it would refuse every ``delay()`` for
        ``lock_queue_ttl``.

        Kept: after a Redis error that ``redislock_on_error="run"`` turns into an unlocked run
        (it keeps duplicates out while that runs; freed as it ends, ``_free_kept_ticket``), and
        after an exception that is not an ``Exception`` (the worker exiting, a hard time limit
        in a gevent pool): with ``acks_late`` such a message comes back, and its hold is still
        its own."""
        if not isinstance(failure, Exception):
            return
        if isinstance(failure, (redis.RedisError, LockNotReplicated)) and self.settings.on_error == "run":
            return
        ticket, adopts = self.ticket, self.options.rules.adopts_ticket and self.lock is not None
        if not (adopts and ticket is not None and ticket[0] == self.key):
            return
        why = f"task {self.task.name}[{self.task_id}] failed before adopting its hold"
        give_up_ticket(self.client, ticket, request_continues_hold(self.request), self.options, why)

    def take(self, lock: ExecutionLock, ticket_to_free: tuple[str, str] | None) -> bool:
        """Take ``lock`` (adopting the message's enqueue lock where the mode keeps it), then free
        ``ticket_to_free`` (the message's enqueue lock, where the mode frees it): ``False`` to skip
        the body; raises for ``raise``, ``retry``, a timed-out ``wait``. The acquisition's outcome
        is the run's one: ``superseded`` where the message was dropped as superseded, found so at
        any step here (its lock let go of at once), not also ``acquired`` or ``busy-skip``."""
        spans = self.settings.spans
        with telemetry.Acquisition(self.task.name, self.options.mode, lock, spans) as acquisition:
            taken = self._take(lock, acquisition)
            if ticket_to_free is not None and self._free_message_lock(ticket_to_free, lock):
                if taken:  # superseded since the check in ``_begin``: dropped
                    release(self.task, lock, self.task_id)
                taken = False
            acquisition.taken = taken
            if dropped_as_superseded(self.request):
                acquisition.outcome = "superseded"
        return acquisition.taken

    def _take(self, lock: ExecutionLock, acquisition: telemetry.Acquisition) -> bool:
        ticket, started = self.ticket, acquisition.started
        if self.options.rules.adopts_ticket and ticket is not None and ticket[0] == lock.name:
            busy = adopt(lock, ticket[1])
            if busy is not None and busy[1] != -2 and self.options.duplicate == "replace":
                # Refused: a replacing call took the lock over, or did and gave it back since (its
                # send failed: UNREPLACE). Dropped if still superseded (DROP marks it dropped, so
                # the lock cannot come back to it), else the lock may be this message's again.
                if superseded(self.task, self.client, self.request, count=False):  # counted by ``take``
                    return False
                busy = adopt(lock, ticket[1])
            if busy is None:
                return acquired(self.task, lock, self.task_id, started)
            if busy[1] != -2:  # held, not for this message: busy (gone: take it afresh below)
                acquisition.busy = True
                return self.when_busy(lock, started, busy[0], seconds_left(busy[1]))
        if lock.acquire(blocking=False):
            return acquired(self.task, lock, self.task_id, started)
        acquisition.busy = True
        return self.when_busy(lock, started, *lock.busy)

    def when_busy(self, lock: ExecutionLock, started: float, holder: str | None, ttl: float | None) -> bool:
        """``lock`` is held by ``holder``, ``ttl`` s left as just read by a request sent after
        monotonic ``started`` (the run's first attempt): apply ``lock_busy`` (``celery_redislock.busy``)."""
        found = Found(
            self.task,
            self.options,
            lock,
            self.request,
            self.args,
            self.kwargs,
            holder,
            ttl,
            started=started,
            asked=started,
            seen=time.monotonic(),
        )
        return when_busy(found)

    def body(self) -> AbstractContextManager[None]:
        """The block the body runs in (``ExecutionLock.body``)."""
        return EMPTY_BLOCK if self.lock is None else self.lock.body()

    def fields(self) -> dict[str, Any]:
        """The ``lock_*`` fields of the request the body sees."""
        return {
            "lock_key": self.key,
            "lock_fence": None if self.lock is None else self.lock.fence,
            "lock_lost": False,
            "lock_slot": None if self.slot is None else self.slot["slot"],
        }

    def let_go(self) -> None:
        """After the body: release, or keep the lock as the mode says (``keep``). Nothing for a run
        that holds nothing (skipped, failed before the body, unlocked)."""
        lock = self.lock
        if lock is None or not lock.held():
            self._over()
            if lock is None:
                self._free_kept_ticket()
            return
        if self._parked_for(lock) is None and not self._settles() and self._released_later(lock):
            return  # the entry in ``running`` stays: ``receivers.after_run`` reads the release's reply
        with telemetry.Release(self.task.name, self.options.mode, lock, self.settings.spans) as ending:
            ending.outcome = self.keep() or release(self.task, lock, self.task_id)
        self._over()  # only once let go: an interrupted let-go is the trace's end's

    def _free_kept_ticket(self) -> None:
        """After a run that went on unlocked (a Redis error as it began,
        ``redislock_on_error="run"``): the message's enqueue lock, owner-checked, where the error
        may have left it held (a Redis error leaves it to expire within ``lock_queue_ttl``).

        Where the mode frees it as the run starts (``until_executing``, swapped for the execution
        lock in ``until_and_while_executing``), and that failed: it goes now, Redis being back, not
        an hour later. Where the mode adopts it: the hold still queued for the message, kept while
        the body ran to keep duplicates out (``_free_unadopted_hold``), goes now
        (``give_up_ticket``), as the run's lock would; ``until_expired`` keeps it, to run out
        within ``lock_queue_ttl``, no sooner than ``lock_period``, and so does a run that raised its
        retry, whose message carries the ticket on (Celery copies its headers) and adopts it."""
        ticket, rules = self.ticket, self.options.rules
        if ticket is None or not self.went_unlocked:
            return
        if rules.frees_ticket:
            with suppress(redis.RedisError):
                release_token(self.client, *ticket)
            return
        if ticket[0] != self.key or not rules.adopts_ticket or rules.settles:
            return
        if isinstance(self.unreturned, Retry):
            return
        why = f"task {self.task.name}[{self.task_id}] ran unlocked"
        with suppress(redis.RedisError):
            give_up_ticket(self.client, ticket, request_continues_hold(self.request), self.options, why)

    def _over(self) -> None:
        """Nothing of the run is left to finish: out of ``running``, where a run with a lock and a
        task id (a worker's, ``apply()``'s) was put as it was made."""
        if self.lock is not None and self.task_id is not None:
            state.run_over((threading.get_ident(), self.task_id), self)

    def finish(self) -> None:
        """After the run (``receivers.after_run``, or ``receivers.RunRequests`` as its trace ends, for
        a run still in ``running``): read and report
        its release's reply if still unread; let go of what an asynchronous exception kept
        ``let_go`` from letting go: kept where the mode keeps it (``keep``), else released."""
        assert self.lock is not None  # only a run with a lock is in ``running``
        finish_release(self.task, self.lock, self.task_id, self.keep)

    def cut_short(self) -> None:
        """An exception (an interrupt such as a soft time limit) cut ``begin`` or ``let_go`` short:
        what it left held is a worker's run's trace's end to let go of (``finish``); a direct
        call has no run of its own there, so it is let go of now, as ``finish`` would."""
        if self.request is None and self.lock is not None:
            self.finish()

    def keep(self) -> str | None:
        """Keep the lock, still held, where the mode says: parked for the retry or replacement on
        its way, or kept for ``lock_period``. The outcome (``"parked"``, ``"taken-over"``,
        ``"settled"``, ``"error"``; ``"released"``: that message declined it, ``_park``), or
        ``None``: not kept, the caller releases it.

        A run that sent its retry or replacement (``send_continuation``) parks its hold for the
        token that message carries, whether the body then raised the ``Retry`` or not; one whose
        message Celery requeues (``_requeued``), for the token that message carries. Also
        the trace's end's (``finish``), for a hold an asynchronous exception
        kept ``let_go`` from letting go: a lock the mode keeps is never released there.
        """
        lock = self.lock
        if lock is None or not lock.held():
            return None
        then = self._parked_for(lock)
        if then is not None:
            return self._park(lock, then)
        if self._settles():
            return self._settle(lock)
        return None

    def _parked_for(self, lock: ExecutionLock) -> Continuation | None:
        """The retry or replacement sent by this run that ``lock`` is parked for, if any; else the
        run's own message, when it comes back (``_requeued``)."""
        if not self.options.rules.parks_for_retry:
            return None
        then: Continuation | None = getattr(lock.request, "lock_retry", None)
        if then is not None and then[0] == lock.name:
            return then
        return self._requeued(lock)

    def _requeued(self, lock: ExecutionLock) -> Continuation | None:
        """The run's message, carrying the ticket of ``lock``, when the body rejected it for a
        requeue (``Reject(requeue=True)``) and Celery puts it back in the queue: a worker's run
        of an ``acks_late`` task (without it, the message was acknowledged as it was received).
        Its next delivery adopts the hold, as a retry's message does; nothing comes back for
        ``apply()`` or a direct call, nor takes a lock the message did not carry."""
        exc, ticket = self.unreturned, self.ticket
        requeue = isinstance(exc, Reject) and getattr(exc, "requeue", False)  # the stubs omit the attribute
        if not (requeue and getattr(self.task, "acks_late", False)):
            return None
        if ticket is None or ticket[0] != lock.name or getattr(self.request, "is_eager", False):
            return None
        return (lock.name, ticket[1], 0.0, (self.retries, replaced_nesting(self.request)))

    def _settles(self) -> bool:
        """Whether the mode keeps the lock for ``lock_period`` after the run: not for a retry of
        this key that ``apply()`` (or ``task_always_eager``) runs next, at once in this thread,
        with no message to park the hold for: it takes the lock again, its period counted from
        then. A retry with arguments of another key (or none it can key) leaves this one kept."""
        if not (self.options.rules.settles and self.options.period is not None):
            return False
        eager = getattr(self.request, "is_eager", False)
        sig = getattr(self.unreturned, "sig", None) if eager and isinstance(self.unreturned, Retry) else None
        if sig is None:  # no retry that apply() runs next
            return True
        try:
            return run_key(self.task, self.options, self.settings, sig.args, sig.kwargs) != self.key
        except LockKeyError:
            return True

    def _released_later(self, lock: ExecutionLock) -> bool:
        """Send the release without waiting for its reply, where a worker's trace follows whose
        ``after_return`` reads it (``run_lock.release_later``; an interrupt past the body leaves it
        to the trace's end, ``receivers.RunRequests``): a run the worker or ``apply()`` started
        (a direct call has no trace) whose body did not raise ``Retry``, ``Ignore`` or ``Reject``
        (Celery calls no ``after_return`` then: the reply is read now, in the task's span), and
        whose loss at release raises nothing (``lock_on_lost="log"``: else ``__call__`` must know
        it before returning). ``False``: nothing sent (not such a run, or the lock cannot leave
        its reply, see ``run_lock.release_later``)."""
        waits = self.request is None or self.task_id is None or self.unreturned or lock.raise_on_lost
        if waits or not lock.held():
            return False
        ending = telemetry.Release(self.task.name, self.options.mode, lock, self.settings.spans)
        return release_later(self.task, lock, self.task_id, ending)

    def _park(self, lock: ExecutionLock, then: Continuation) -> str:
        """Keep ``lock`` for the retry or replacement ``then`` sent by this run: ``"parked"``,
        ``"released"`` (announced, as a release is) or ``"settled"`` (that message will not
        adopt it: ``enqueue.give_up_ticket``), ``"taken-over"`` (usually adopted by that message
        already), ``"error"``."""
        current, fence = lock.holder or "", lock.fence
        running = lock.stop_renewing()
        held = time.monotonic() - lock.taken_at  # until PARK is sent: the hold may end there
        try:  # once PARK is sent, the hold is forgotten, whatever its outcome
            message = (self.task_id, *then[3])
            parked = park(lock.client, lock.name, (running, current), then[1], message, self.options, then[2])
        except redis.RedisError as exc:
            logger.warning(
                "task %s[%s]: could not keep lock %s for its retry or replacement: %s",
                self.task.name,
                self.task_id,
                lock.name,
                exc,
                extra=telemetry.log_fields(lock.name, self.task_id, current, fence, "error"),
            )
            return "error"
        finally:
            lock.forget()
        if parked == 1:
            return "parked"
        outcome = LET_GO.get(parked)  # freed, or kept for what is left of its period
        if outcome == "released":
            announce_released(self.task, lock.name, self.task_id, held, fence)
        if outcome is not None:
            logger.info(
                "task %s[%s]: its retry or replacement will not adopt lock %s; %s",
                self.task.name,
                self.task_id,
                lock.name,
                outcome,
                extra=telemetry.log_fields(lock.name, self.task_id, current, fence, outcome),
            )
            return outcome
        logger.info(  # usually that message already adopted it; else it was lost
            "task %s[%s]: lock %s was already taken over at its retry or replacement",
            self.task.name,
            self.task_id,
            lock.name,
            extra=telemetry.log_fields(lock.name, self.task_id, current, fence, "taken-over"),
        )
        return "taken-over"

    def _settle(self, lock: ExecutionLock) -> str | None:
        """Keep ``lock`` for ``lock_period`` after it was taken: ``"settled"``, ``"error"`` (a Redis
        error: the hold, forgotten, runs out within its lease), or ``None``: the period is over (or
        the hold lost), it is to be released now."""
        assert self.options.period is not None
        try:
            token, fence = lock.stop_renewing(), lock.fence or 0
            left = int(SETTLE(lock.client, [lock.name], [token, to_ms(self.options.period), fence]))
        except redis.RedisError as exc:
            logger.warning(
                "task %s[%s]: could not keep lock %s: %s",
                self.task.name,
                self.task_id,
                lock.name,
                exc,
                extra=telemetry.log_fields(lock.name, self.task_id, lock.holder, lock.fence, "error"),
            )
            lock.forget()
            return "error"
        if left > 0:
            lock.forget()
            return "settled"
        return None

    def _stops_child(self) -> bool:
        """With ``lock_on_lost="terminate"``: whether a lost lock stops this process (a prefork pool child).

        Anywhere else (threads, solo, gevent or eventlet pools, a direct call)
        the process is the worker itself: ``"terminate"`` acts as ``"raise"``,
        with a WARNING the first time (per task).
        """
        app = app_state(self.task.app)
        if app.pool_child == current_pid():
            return True
        if self.task.name not in app.terminate_warned:
            app.terminate_warned.add(self.task.name)
            logger.warning(
                "task %s: lock_on_lost='terminate' stops a prefork pool child, and this process is "
                "not one (threads, solo, gevent or eventlet pool, or a direct call): a lost lock "
                "raises LockLost instead, as with lock_on_lost='raise'",
                self.task.name,
                extra=telemetry.log_fields(self.key, self.task_id),
            )
        return False

    def _free_message_lock(self, ticket: tuple[str, str], lock: ExecutionLock | None) -> bool:
        """Free the message's enqueue lock, the run being under way (``lock``: its execution lock);
        ``True``: it was superseded instead (``lock_duplicate="replace"``), and is to be dropped.

        If that fails, nothing stays held: ``lock`` is released, the enqueue
        lock is tried once more (owner-checked), and the error propagates.
        """
        try:
            if self.options.duplicate == "replace":  # checked and freed in one step
                # counted here only for a run without an execution lock: else by its acquisition
                return superseded(self.task, self.client, self.request, free=True, count=self.lock is None)
            if not release_token(self.client, *ticket):
                logger.debug(
                    "task %s[%s]: its enqueue lock had already gone",
                    self.task.name,
                    self.task_id,
                    extra=telemetry.log_fields(ticket[0], self.task_id),
                )
        except BaseException:
            if lock is not None:
                release(self.task, lock, self.task_id)
            try:
                release_token(self.client, *ticket)
            except redis.RedisError as exc:
                logger.warning(
                    "task %s[%s]: could not release its enqueue lock %s (%s); it expires within its ttl",
                    self.task.name,
                    self.task_id,
                    ticket[0],
                    exc,
                    extra=telemetry.log_fields(ticket[0], self.task_id, outcome="error"),
                )
            raise
        return False

    def _claim_slot(self, slot: dict[str, Any]) -> bool:
        """Claim the beat slot the message was sent for; ``False`` if another message has it.

        The sender's claim (same token) is taken over, naming this task; a slot
        nobody claimed (beat's ``send_task`` fallback) goes to the first
        message of it that starts here. A copy of a message whose run has the slot (kombu's
        publish retry sent it twice) or a stale copy of an earlier attempt is ignored
        (``Ignore``: the result of that run stands); a redelivered copy claims it again, its
        execution lock deciding whether its first delivery died (it runs) or runs still.
        """
        holder = holder_for(
            self.task_id, self.retries, self.node, current_pid(), "claimed", replaced_nesting(self.request)
        )
        again = slot_republished(slot)
        if again:  # queued again by a busy lock's retry: later than the run it repeats
            holder += f" again={again}"
        holder += f" claim={secrets.token_hex(4)}"  # this claim's, sent again after a lost reply
        redelivered = (getattr(self.request, "delivery_info", None) or {}).get("redelivered")
        args = [slot["token"], holder, slot["ttl"], 1 if redelivered else 0]
        reply = CLAIM(self.client, [slot["key"]], args)
        if isinstance(reply, int):
            logger.info(
                "task %s[%s]: runs slot %s of beat entry %r (sent by %s)",
                self.task.name,
                self.task_id,
                slot["slot"],
                slot["entry"],
                slot.get("beat"),
                extra=telemetry.log_fields(slot["key"], self.task_id, holder, outcome="slot-run"),
            )
            return True
        other = text(reply)
        if parse_holder(other).get("task") == self.task_id:
            self._ignore_copy(slot, other)
        logger.info(
            "task %s[%s]: not run, a duplicate: slot %s of beat entry %r went to %s (marker %s)",
            self.task.name,
            self.task_id,
            slot["slot"],
            slot["entry"],
            other,
            slot["key"],
            extra=telemetry.log_fields(slot["key"], self.task_id, other, outcome="slot-dropped"),
        )
        telemetry.counted(self.task.name, self.options.mode, "slot-dropped")
        signals.task_deduplicated.send(
            sender=self.task, key=slot["key"], existing_task_id=parse_holder(other).get("task")
        )
        return False

    def _ignore_copy(self, slot: dict[str, Any], run: str) -> NoReturn:
        """The message is a copy of the one whose run ``run`` has its beat slot ``slot``: ignored."""
        logger.info(
            "task %s[%s]: a copy of a message whose run has slot %s of beat entry %r (%s); ignored",
            self.task.name,
            self.task_id,
            slot["slot"],
            slot["entry"],
            run,
            extra=telemetry.log_fields(slot["key"], self.task_id, run, outcome="slot-dropped"),
        )
        telemetry.counted(self.task.name, self.options.mode, "slot-dropped")
        raise Ignore()
