"""``install(app)``: the Celery signal receivers that finish what a message leaves, and
``RunRequests``, the request stack of a ``LockedTask`` that finishes what a run leaves.

* the end of a run's trace (``RunRequests.pop``, which Celery's tracer calls in a
  ``finally`` once ``task_postrun`` is sent, whatever happened; ``after_run``, which
  ``LockedTask.after_return`` calls first where Celery calls it): read the reply of a run's
  release, sent without waiting for it (``run_lock.release_later``), and report it; let go
  of what an asynchronous exception (a soft time limit) kept a run's ``finally`` from
  letting go (``Execution.finish``: kept where the mode keeps it). Not a ``task_postrun``
  receiver: with one connected, Celery sends that signal after every task of the worker,
  locked or not, about 30,000 instructions each (docs/benchmarks.md);
* ``worker_process_init``: note that this process is a prefork pool child
  (``lock_on_lost="terminate"`` stops only those);
* ``task_revoked``, ``task_unknown``, ``task_rejected`` (the worker's main
  process): a message that will never run frees the enqueue lock it carries (a retry or
  a replacement gives up the hold its run parks for it: ``enqueue.give_up_ticket``); so
  does one whose run cannot compute its key (``free_unkeyed_ticket``, called by the run);
* the beat receivers (``celery_redislock.beat.connect``).

Importing the package connects nothing: ``install`` runs when the first
``LockedTask`` is bound to an app.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from ._process import current_pid
from .beat import connect as connect_beat
from .config import LockOptions, app_settings, bound_options
from .connection import client_for
from .enqueue import give_up_ticket
from .exceptions import LockConfigurationError
from .protocol import message_continues_hold, message_ticket, request_continues_hold, request_ticket
from .state import app_state, app_states, run_over, running
from .telemetry import log_fields

__all__ = ["RunRequests", "after_run", "free_dropped_ticket", "free_unkeyed_ticket", "install"]

logger = logging.getLogger(__name__)


def install(app: Any) -> None:
    """Connect the package's signal receivers for ``app``; idempotent.

    Called when the first ``LockedTask`` is bound to ``app``; importing the
    package connects nothing. Receivers are strong references with a
    ``dispatch_uid``, so connecting twice keeps one. In a beat process they
    include the beat guard (``celery_redislock.beat``): call ``install(app)``
    there yourself if that process binds no ``LockedTask``.

    With ``redislock_enabled = False`` it connects nothing (no beat guard, no
    receiver) and logs a WARNING, once per app per process: locks that are off
    must not go unnoticed in production.
    """
    if not isinstance(app, Celery):
        raise LockConfigurationError(f"install(app): app must be a Celery app, got {type(app).__name__}")
    state = app_state(app)
    if state.installed or state.switched_off:
        return
    if not app_settings(app).enabled:  # bad settings fail here, not at the first task
        state.switched_off = True
        logger.warning(
            "celery-redislock: redislock_enabled=False for app %s: every lock is off; tasks run "
            "and are sent unlocked, beat sends every entry, and nothing connects to Redis",
            app.main or app,
            extra=log_fields(outcome="disabled"),
        )
        return
    # Each receiver once per process (its dispatch_uid), for every app, and for good.
    celery_signals.worker_process_init.connect(
        _mark_pool_child, weak=False, dispatch_uid="celery_redislock.mark_pool_child"
    )
    celery_signals.task_revoked.connect(
        _free_revoked, weak=False, dispatch_uid="celery_redislock.free_revoked"
    )
    celery_signals.task_unknown.connect(
        _free_unrunnable, weak=False, dispatch_uid="celery_redislock.free_unknown"
    )
    celery_signals.task_rejected.connect(
        _free_unrunnable, weak=False, dispatch_uid="celery_redislock.free_rejected"
    )
    connect_beat()
    state.installed = True


def after_run(task: Any, task_id: str) -> None:
    """Once ``task``'s run ``task_id`` is over (its result stored): read and report the reply of
    its release if still unread (``run_lock.release_later``); let go of what an asynchronous
    exception kept ``__call__`` from letting go (``Execution.finish``). Called by
    ``LockedTask.after_return``, before any ``task_postrun`` receiver (OpenTelemetry's ends the
    task's span there); ``RunRequests.pop`` then finds nothing left to do."""
    where = threading.get_ident(), task_id
    run = running.get(where)
    if run is not None and run.request is task.request_stack.top:  # not the run an eager one was started in
        run_over(where, run)
        run.finish()


class RunRequests:
    """The request stack of a ``LockedTask`` (its class's ``request_stack``; Celery's own,
    ``celery.utils.threads.LocalStack``, inside): the tracer of a worker's run (and of
    ``apply()``) pushes the run's request as the trace begins and pops it in a ``finally`` as it
    ends, after ``task_postrun``, whatever the run came to. Popping a run's request finishes the
    run (``Execution.finish``, as ``after_run``) where ``after_return`` did not: Celery calls no
    ``after_return`` for a run that retried, was ignored or rejected, nor for one an exception
    cut short after its body (a soft time limit as the result is stored). Only the request the
    run was started with finishes it: a request a direct call pushes (the same task id, inside
    the run) does not."""

    __slots__ = ("_stack",)

    def __init__(self, stack: Any) -> None:
        """``stack``: the task's request stack (Celery's)."""
        self._stack = stack

    def push(self, request: Any) -> Any:
        return self._stack.push(request)

    def pop(self) -> Any:
        try:
            if running:  # else nothing to finish (the common case: after_return did)
                self._finish(self._stack.top)
        finally:
            popped = self._stack.pop()  # whatever finishing raised
        return popped

    def _finish(self, request: Any) -> None:
        task_id: str | None = getattr(request, "id", None)
        if task_id is None:
            return
        key = (threading.get_ident(), task_id)
        run = running.get(key)
        if run is None or run.request is not request:
            return
        try:  # the entry goes once the run is finished: until then, the run is not over
            run.finish()
        except Exception:  # the tracer's ``finally`` must go on: the task's outcome stands
            logger.exception(
                "task %s[%s]: could not let go of its lock after the run",
                run.task.name,
                run.task_id,
                extra=log_fields(run.key, run.task_id, outcome="error"),
            )
        finally:
            run_over(key, run)

    @property
    def top(self) -> Any:
        return self._stack.top

    @property
    def stack(self) -> Any:
        return self._stack.stack

    def __len__(self) -> int:
        return len(self._stack)

    def __call__(self) -> Any:  # a proxy to the request on top (a special method: not __getattr__'s)
        return self._stack()

    def __getattr__(self, name: str) -> Any:  # anything else Celery's stack has
        return getattr(self._stack, name)


def free_unkeyed_ticket(task: Any, request: Any, options: LockOptions) -> None:
    """The run of a worker's message (its ``request``; ``None``: a direct call, or a call inside
    a run, with no message of its own) cannot compute its key (a ``lock_on`` callable that raised
    there, not at ``apply_async``): it fails before taking anything, and nothing would adopt or
    free the enqueue lock its message carries; free it, owner-checked (``give_up_ticket``)."""
    if request is None:
        return
    ticket = request_ticket(request)
    if ticket is not None:
        why = f"task {task.name}[{request.id}] cannot compute its lock key"
        _release_ticket_logged(task.app, ticket, why, request_continues_hold(request), options)


def _mark_pool_child(**_: Any) -> None:
    """``worker_process_init`` (sent in a prefork pool child only): this process is one, for
    every app ``install`` connected (its receivers)."""
    for state in app_states():
        if state.installed:
            state.pool_child = current_pid()


def _free_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    """``task_revoked`` (worker main process): a message revoked or expired before it ran
    frees its enqueue lock. A terminated run's lock is freed once its child is gone
    (``LockedRequest``)."""
    ticket, options = request_ticket(request), bound_options(sender)
    if ticket is None or terminated or options is None:
        return
    why = f"task {sender.name}[{request.id}] {'expired' if expired else 'revoked'}"
    continuation = request_continues_hold(request)  # ``request``: the task's Context
    _release_ticket_logged(sender.app, ticket, why, continuation, options)


def _free_unrunnable(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    """``task_unknown`` / ``task_rejected`` (worker main process; ``sender``: its consumer):
    ``free_dropped_ticket``."""
    free_dropped_ticket(sender, message, name)


def free_dropped_ticket(consumer: Any, message: Any, name: str | None = None) -> None:
    """A message the worker's ``consumer`` drops (it will never run: an unknown task, a message
    rejected, or one whose body cannot be decoded) frees the enqueue lock it carries, or, a
    retry's or a replacement's, gives up the hold of the run it continues (``give_up_ticket``),
    with its task's options (the task its headers name, or ``name``). Read from the message's
    headers alone: its body may be unreadable."""
    headers = getattr(message, "headers", None)
    fields: Mapping[str, Any] = headers if isinstance(headers, Mapping) else {}
    ticket, app = message_ticket(fields), getattr(consumer, "app", None)
    if ticket is None or app is None:
        return
    name = name or fields.get("task")
    # The options of a task this app registers: a rejected message's (invalid, or of a content
    # type the worker does not accept), an undecodable one's, or an unknown one's registered
    # after the worker started. Of a task it does not register (another app's, another
    # release's), the mode, period and queue ttl are unknown: no options (``give_up_ticket``: a
    # hold parked already is let go of with the period its holder names, as its run would; one
    # not parked yet is marked declined, and its run's park lets go of it as its mode says).
    task = app.tasks.get(name) if isinstance(name, str) else None
    why = f"message for {name or 'an invalid task'} dropped"
    _release_ticket_logged(app, ticket, why, message_continues_hold(fields), bound_options(task))


def _release_ticket_logged(
    app: Any,
    ticket: tuple[str, str],
    why: str,
    continuation: bool = False,
    options: LockOptions | None = None,
) -> None:
    """Free ``ticket`` for ``app`` (``enqueue.give_up_ticket``: ``continuation``, maybe the hold
    of the run a retry or a replacement continues, with its task's ``options``); nothing for an
    app switched off (``redislock_enabled=False``), whose receivers are off but another app's,
    connected for every app, are not."""
    try:
        if not app_settings(app).enabled:  # nothing of it connects
            return
        client, _ = client_for(app)
        give_up_ticket(client, ticket, continuation, options, why)
    except Exception:  # the worker's main loop must go on
        logger.exception(
            "%s: could not release its enqueue lock %s",
            why,
            ticket[0],
            extra=log_fields(ticket[0], outcome="error"),
        )
