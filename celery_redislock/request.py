"""The worker main process's side of ``LockedTask``: freeing the lock of a pool child that died,
and the enqueue lock of a message whose body cannot be decoded (``strategy``).

When a prefork child dies mid-task (SIGKILL, OOM, a hard time limit,
``revoke(terminate=True)``, ``lock_on_lost="terminate"``), nothing in it can
release its lock; the main process learns of the death through the task's
``Request`` and releases the lock at once, so the next duplicate does not
wait for the lease to expire (``until_expired`` keeps it, as after any run,
for what is left of ``lock_period``, unless the message comes back). The
release is owner-checked against the holder the child wrote (task id, node
name and child pid), so a lock taken over meanwhile is left alone. The
enqueue lock the message carries goes too (owner-checked by its token: a
no-op once the child adopted or freed it), where the message was
acknowledged and will not come back, so that a message that died waiting for
its execution lock, or (``until_executing``, which has none) before its run
freed it, is not kept as the one every later ``delay()`` is a duplicate of.
A child that died waiting for the lock (or a permit) leaves the waiter queue
(``inventory.leave_queue_of``), so that the next release wakes a live waiter.
Where Celery retries the task instead (``task_retry_on_worker_lost``), a mode
that keeps the lock across retries has the dead run's hold parked for the
retry as it is sent (``lost_retry``).

Never while the child still runs: billiard reports a hard time limit
(``on_timeout``) *before* it stops the child (SIGTERM, then SIGKILL 0.1 s
later, and a body may ignore SIGTERM), so that release waits on a thread of
its own until the child has terminated (``os.pidfd_open``). Where pidfds do
not exist, the lock is left to its lease, which the dead child no longer renews.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request
from celery.worker.strategy import default as default_strategy
from kombu.exceptions import DecodeError

from ._process import current_pid
from .config import LockOptions, bound_options
from .connection import client_for
from .enqueue import give_up_ticket
from .inventory import leave_queue_of, release_held_by, settle_held_by
from .lost_retry import LostRun, retrying
from .protocol import holder_for, message_continues_hold, message_ticket, sent_attempt
from .receivers import free_dropped_ticket
from .semaphore import release_permit_held_by
from .task import task_lock_key
from .telemetry import crash_released, log_fields

__all__ = ["LockedRequest", "strategy"]

logger = logging.getLogger(__name__)

#: What the pool reports when the child running a task is gone.
CHILD_GONE = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)
#: Longest wait (seconds) for a child past its hard time limit to terminate (SIGKILL follows 0.1 s
#: after it is told); past it, its lock is left to its lease.
CHILD_EXIT_TIMEOUT = 60.0


def strategy(task: Any, app: Any, consumer: Any, **options: Any) -> Callable[..., Any]:
    """``LockedTask.Strategy``: Celery's default strategy for the messages of ``task`` in the
    worker's main process, but a message whose body cannot be decoded (corrupt: ``DecodeError``)
    frees the enqueue lock its headers carry (``free_dropped_ticket``), then goes on to Celery's
    consumer, which logs it and acknowledges it (``on_decode_error``, which sends no signal): it
    will never run, and must not hold its arguments' lock for ``lock_queue_ttl``. (A content
    type the worker does not accept is rejected with ``task_rejected``, whose receiver frees it.)"""
    handle = default_strategy(task, app, consumer, **options)

    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **more: Any) -> Any:
        try:
            return handle(message, body, ack, reject, callbacks, **more)
        except DecodeError:
            free_dropped_ticket(consumer, message)
            raise

    return on_message


class LockedRequest(Request):
    """``Request`` of a ``LockedTask``: releases the lock of a dead child's task."""

    #: Whether Celery sent a retry in the message's stead after its pool child was lost
    #: (``task_retry_on_worker_lost``, Celery 5.7 and later: ``_retry_worker_lost``).
    _retried_instead = False
    #: Whether Celery rejected the message for a requeue (``reject(requeue=True)``).
    _requeued = False

    def reject(self, requeue: bool = False) -> None:
        if not self.acknowledged:  # Celery's first decision is the one its event loop acts on
            self._requeued = requeue
        super().reject(requeue)

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> Any:
        """Celery's retry of a task whose pool child was lost (not past ``max_retries``, not a
        ``Terminated`` or a time limit); noted, since the retry carries the message's enqueue lock,
        also when what Celery does once it sent it (the task's ``on_retry``, storing ``RETRY``) raises."""
        pid = self._locking_pid()
        holder = None if pid is None else self._holder(pid)
        run = LostRun(self.id, self._attempt()[0], holder)
        with retrying(run):  # its hold parked for it (lost_retry)
            try:
                retried = super()._retry_worker_lost(exc, exc_info)  # type: ignore[misc]
            except BaseException:
                self._retried_instead = run.sent
                raise
        self._retried_instead = bool(retried)
        return retried

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            exc = exc_info.exception
            if isinstance(exc, ExceptionWithTraceback):
                exc = exc.exc
            if isinstance(exc, CHILD_GONE):
                self._release_orphaned_lock(type(exc).__name__)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        pid = self._locking_pid()
        if not soft and pid is not None:
            self._release_once_gone(pid, "hard time limit")

    def _locking_pid(self) -> int | None:
        """The pid of the process that ran the task under a lock of the run (``None``: no such
        lock): an execution lock, or the enqueue lock its message carries, which the run frees
        as it starts where the mode has no execution lock (``until_executing``)."""
        options = bound_options(self.task)
        if options is None or self.worker_pid is None:
            return None
        if not (options.rules.execution_lock or options.rules.frees_ticket):
            return None
        return int(self.worker_pid)

    def _release_once_gone(self, pid: int, why: str) -> None:
        """Release the lock once the child ``pid`` that ran the task has terminated (the pool
        stops it after this returns). A task that ran in this process (gevent, eventlet) was
        stopped in its own greenlet before the pool reports the time limit: released at once."""
        if pid == current_pid():
            self._release_orphaned_lock(why)
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone
            self._release_orphaned_lock(why)
            return
        except (AttributeError, OSError) as exc:  # no pidfd here: the lease runs out unrenewed
            logger.warning(
                "task %s[%s]: pool child %s past its %s; its lock expires within lock_ttl once it is "
                "gone (%r)",
                self.name,
                self.id,
                pid,
                why,
                exc,
                extra=log_fields(task_id=self.id, outcome="left-to-lease"),
            )
            return
        threading.Thread(
            target=self._release_when_terminated,
            args=(pidfd, why),
            name="celery-redislock-release",
            daemon=True,
        ).start()

    def _release_when_terminated(self, pidfd: int, why: str) -> None:
        """Wait until the process of ``pidfd`` has terminated (readable), then release."""
        try:
            poller = select.poll()  # not select(): a worker's descriptors may pass FD_SETSIZE
            poller.register(pidfd, select.POLLIN)
            terminated = poller.poll(CHILD_EXIT_TIMEOUT * 1000)
        finally:
            os.close(pidfd)
        if terminated:
            self._release_orphaned_lock(why)
        else:
            logger.warning(
                "task %s[%s]: pool child %s still runs %.0fs after its %s; its lock is left to its lease",
                self.name,
                self.id,
                self.worker_pid,
                CHILD_EXIT_TIMEOUT,
                why,
                extra=log_fields(task_id=self.id, outcome="left-to-lease"),
            )

    def _attempt(self) -> tuple[int, int]:
        """(retries so far, replacement depth) of this request's message: the attempt its run is."""
        return sent_attempt(self.request_dict)

    def _holder(self, pid: int) -> str:
        """The holder the lock of this request's run names, run in the pool child ``pid``."""
        retries, replaced = self._attempt()
        return holder_for(self.id, retries, self.hostname, pid, replaced=replaced)

    def _delivered_for_good(self) -> bool:
        """Whether the message will not be delivered again: acknowledged (at receipt, or by Celery
        after the failure: ``acks_on_failure``), or rejected without a requeue, and no retry sent
        in its stead (``retry_on_worker_lost``: only for a lost worker within ``max_retries``, and
        only once sent, which ``_retry_worker_lost`` notes). Not a message Celery requeues
        (``acks_late`` with ``reject_on_worker_lost``, a time limit without ``acks_on_timeout``),
        nor one left unacknowledged for redelivery: those keep their enqueue lock, until its ttl.
        Read from Celery's decision (``acknowledged``, ``reject``), not from kombu's message,
        which its event loop acknowledges soon after (``call_soon``), after this has run."""
        return self.acknowledged and not self._requeued and not self._retried_instead

    def _release_orphaned_lock(self, why: str) -> None:
        """Release the execution lock the dead child held for the task, and the enqueue lock its
        message carries if the child died before freeing or adopting it (waiting for the execution
        lock, say); take the waits it queued for the execution lock out of the queue. All
        owner-checked: a hold taken over meanwhile, or adopted, is left alone. A mode that keeps
        its lock for ``lock_period`` after a run (``until_expired``) keeps the dead run's for
        what is left of it, as after any run, unless the message comes back."""
        pid = self._locking_pid()
        options = bound_options(self.task)
        if pid is None or options is None:
            return
        task, locked = self.task, options.rules.execution_lock
        try:
            key = task_lock_key(task, self.args, self.kwargs)
            client, _ = client_for(task.app)
            holder = self._holder(pid)
            outcome = self._let_go(client, key, holder, options) if locked else None
            ticket = message_ticket(self.request_dict)  # the message's headers
            if ticket is not None and self._delivered_for_good():
                gone = f"task {self.name}[{self.id}]: pool child {self.worker_pid} gone ({why})"
                give_up_ticket(client, ticket, message_continues_hold(self.request_dict), options, gone)
            if locked:  # died waiting: the next waiter gets the wake
                leave_queue_of(client, key, holder, options.limit)
        except Exception:  # the main process's event loop must go on
            logger.exception(
                "task %s[%s]: could not release its dead pool child's lock",
                self.name,
                self.id,
                extra=log_fields(task_id=self.id, outcome="error"),
            )
            return
        if outcome is None:
            return
        if outcome == "released":
            crash_released(self.name)
            done = "released its lock %s"
        else:
            done = "its lock %s kept for what is left of lock_period"
        logger.warning(
            "task %s[%s]: pool child %s gone (%s); " + done,
            self.name,
            self.id,
            self.worker_pid,
            why,
            key,
            extra=log_fields(key, self.id, holder, outcome=f"crash-{outcome}"),
        )

    def _let_go(self, client: Any, key: str, holder: str, options: LockOptions) -> str | None:
        """Let go of the dead run's hold of ``key``, owner-checked by its ``holder``: ``"released"``,
        ``"settled"`` (kept for what is left of ``lock_period``: no run of the message will follow),
        or ``None`` (not the dead run's any more, or kept for its period already: the run ended
        before its child died, and its message, if it comes back, is ignored within the period)."""
        if options.limit > 1:  # the run held a permit of the key
            return "released" if release_permit_held_by(client, key, options.limit, holder) else None
        if options.period_ms and self._delivered_for_good():
            return settle_held_by(client, key, holder, options.period_ms)
        return "released" if release_held_by(client, key, holder) else None
