"""LockedTask: a Celery task that takes a per-signature Redis lock around its body.

``@app.task(base=LockedTask)`` makes two calls with the same arguments (the
same *signature*) never run at once: the worker takes the lock
``{prefix}:{task name}:{digest}`` before the body and releases it after,
whatever the outcome, and the watchdog renews it while the body runs. What
a worker does when the lock is held is the task's ``lock_busy`` policy
(``celery_redislock.busy``); what each mode takes and keeps is its row in
``celery_redislock.modes``; one run, from taking the lock to letting it go,
is a ``celery_redislock.execution.Execution``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.uuid import uuid

from .busy import skipped
from .config import (
    AppSettings,
    LockOptions,
    app_settings,
    bound_options,
    call_headers,
    check_call_options,
    run_key,
    task_options,
)
from .django import OnCommit
from .enqueue import enqueue
from .exceptions import LockConfigurationError, LockKeyError, LockLost
from .execution import Execution, continued_run, send_continuation
from .lost_retry import lost_run
from .protocol import HEADER, REPUBLISH, canvas_member
from .receivers import RunRequests, after_run, free_unkeyed_ticket, install
from .run_lock import ExecutionLock, raise_if_lost

__all__ = ["LockedTask", "task_lock_key"]

#: Key -> execution lock (``None`` when running unlocked) of the runs under way in this thread
#: (or task): a task called directly from inside another holding the same key runs under
#: it, and a locked call inside a run is one of the points where a loss is raised.
_held_locks: contextvars.ContextVar[Mapping[str, ExecutionLock | None]] = contextvars.ContextVar(
    "celery_redislock_held", default=MappingProxyType({})
)
#: (task, lock fields, lock) for the request a direct call is about to push.
_pending_request: contextvars.ContextVar[tuple[Any, dict[str, Any], Any] | None] = contextvars.ContextVar(
    "celery_redislock_pending", default=None
)


def task_lock_key(
    task: Task[Any, Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> str:
    """The Redis key a worker's run of ``task.delay(*args, **kwargs)`` locks: a ``lock_on``
    callable is called with the arguments as that run receives them, through the task's
    serializer. Raises ``LockKeyError`` naming an argument that cannot be keyed.
    """
    return run_key(task, *_bound_options(task), args or (), kwargs or {}, {})


def _bound_options(task: Task[Any, Any]) -> tuple[LockOptions, AppSettings]:
    options = bound_options(task)
    settings = getattr(task, "lock_settings", None)
    if options is None or settings is None:
        raise LockConfigurationError(f"task {task.name!r} is not a LockedTask bound to an app")
    return options, settings


class LockedTask(OnCommit):
    """A task whose body runs under a per-signature Redis lock.

    Options are the ``lock_*`` attributes (docs/tasks.md, "Options"): set them with
    ``@app.task(base=LockedTask, lock_ttl=60)``, on a subclass, or through
    ``task_annotations``; ``None`` falls back to ``app.conf.redislock_*``,
    then to the default. They are checked when the task is bound.

    Inside the body, ``self.request.lock_key`` and ``self.request.lock_fence``
    describe the hold (``lock_fence`` is ``None`` when running unlocked with
    ``redislock_on_error="run"``), ``self.request.lock_lost`` becomes
    ``True`` if the watchdog finds the lock lost, and ``self.request.lock_slot``
    names the beat slot the run is for (``None`` outside once-per-slot beat jobs).
    ``self.check_lock()`` raises ``LockLost`` once the lock is lost.
    """

    Request = "celery_redislock.request:LockedRequest"
    Strategy = "celery_redislock.request:strategy"

    #: When the lock is held: ``"while_executing"`` (the body's run), ``"until_executing"``
    #: (from ``apply_async`` until the run starts), ``"until_executed"`` (from ``apply_async``
    #: until the run ends, across its retries), ``"until_and_while_executing"`` (one queued,
    #: one running), ``"until_expired"`` (until ``lock_period`` after the run).
    #: [``"while_executing"``]
    lock_mode: ClassVar[str | None] = None
    #: Which arguments make the key: ``None`` (all), a tuple of parameter names, or a callable
    #: ``(*args, **kwargs) -> JSON-able value``. [``None``]
    lock_on: ClassVar[Any] = None
    #: Lease of a held execution lock (seconds or ``timedelta``), renewed every third of it. [30]
    lock_ttl: ClassVar[Any] = None
    #: A run that finds its lock held: ``"skip"``, ``"retry"`` (after ``lock_retry_delay``),
    #: ``"wait"`` (up to ``lock_wait_timeout``), ``"raise"`` (``LockNotAcquired``) or
    #: ``"reject"`` (the message, not requeued).
    #: [``"retry"`` for ``until_and_while_executing``, else ``"skip"``]
    lock_busy: ClassVar[str | None] = None
    #: An enqueue that finds its lock held: ``"return"`` the queued task's ``AsyncResult``,
    #: ``"raise"`` ``DuplicateTask``, or ``"replace"`` the queued message (last one wins; see
    #: ``celery_redislock.enqueue``). [``"return"``]
    lock_duplicate: ClassVar[str | None] = None
    #: Longest life of an enqueue lock while its message waits (plus its countdown). [3600]
    lock_queue_ttl: ClassVar[Any] = None
    #: ``until_expired``: how long the lock stays after a run. [``None``]
    lock_period: ClassVar[Any] = None
    #: Countdown of a ``lock_busy="retry"`` (with jitter, 0.5x to 1.5x). [5]
    lock_retry_delay: ClassVar[Any] = None
    #: Longest wait of ``lock_busy="wait"``. [``lock_ttl``]
    lock_wait_timeout: ClassVar[Any] = None
    #: A lock lost while the body runs: ``"log"``, ``"raise"`` (``LockLost`` at the run's check
    #: points) or ``"terminate"`` (stop the prefork pool child). [``"log"``]
    lock_on_lost: ClassVar[str | None] = None
    #: Run once per schedule slot when sent by beat (``celery_redislock.beat``). [``False``]
    lock_beat: ClassVar[bool | None] = None

    #: The options above, resolved and validated when the task is bound (``None`` until then).
    lock_options: ClassVar[LockOptions | None] = None
    #: The app's ``redislock_*`` settings, resolved when the task is bound.
    lock_settings: ClassVar[AppSettings | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        cls.lock_settings = app_settings(app)
        cls.lock_options = task_options(cls, app, cls.lock_settings)
        if not isinstance(cls.request_stack, RunRequests):  # bound again (another app): wrapped already
            cls.request_stack = RunRequests(cls.request_stack)  # type: ignore[assignment]  # popping a run's request ends it
        install(app)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Send the task; in the enqueue modes, first take its enqueue lock (one round trip).

        A duplicate returns the ``AsyncResult`` of the task already queued or running
        (``lock_duplicate="return"``), raises ``DuplicateTask``, or takes the lock over from the
        queued message and is sent (``"replace"``). A republish of a message that carries its
        lock, a busy retry's republish (whatever the message carries: it is queued again, not a
        new call) and a member of a group, chord or chain (unless sent with ``lock_in_canvas=True``)
        pass. So does a message that continues the run under way here, however that run's
        message was sent: its retry (``self.retry``, autoretry) or its replacement
        (``task.replace()``). In the modes that keep the lock between runs, it carries a token of
        its own, for which the run parks its hold when it lets go; with other arguments, it takes
        their enqueue lock, or goes without it when held (``execution.send_continuation``). So
        does Celery's retry of a run whose pool child was lost (``lost_retry``), parked for likewise."""
        lock_options, settings = _bound_options(self)
        check_call_options(self, task_id, options)
        key = run_key(self, lock_options, settings, args or (), kwargs or {}, options)  # unkeyable: unsent
        rules = lock_options.rules
        in_canvas_opt_in = options.pop("lock_in_canvas", False)
        republish = options.pop(REPUBLISH, False)
        in_canvas = canvas_member(options) and not in_canvas_opt_in
        headers = call_headers(self, options.pop("headers", None))

        def send(task_id: str | None) -> Any:
            return super(LockedTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
            )

        if (lost := lost_run(task_id, options)) is not None:  # a worker's main process: a lost pool child
            return lost.send(self, key, options, headers, send)
        if (running := continued_run(self, task_id, options)) is not None:  # its retry or replacement
            return send_continuation(self, running, key, options, headers, send, in_canvas)
        if republish or not rules.enqueue_lock or HEADER in headers or in_canvas:
            return send(task_id)
        return enqueue(self, key + rules.queued_suffix, task_id or uuid(), options, headers, send)

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        """Run the task here (Celery's ``apply``), its ``task_id`` and options checked as
        ``apply_async`` checks them."""
        check_call_options(self, task_id, options)
        return super().apply(args, kwargs, link, link_error, task_id, *more, **options)

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        pending = _pending_request.get()
        if pending is None or pending[0] is not self:
            super().push_request(*args, **kwargs)
            return
        _pending_request.set(None)  # a direct call's own request gets the lock's fields
        _, fields, lock = pending
        super().push_request(*args, **{**kwargs, **fields})
        if lock is not None:
            lock.attach(self.request_stack.top)

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """After the result is stored, before ``task_postrun``: the run's release is read and
        reported (``receivers.after_run``). Call ``super()`` when you override it; else it is
        done as the trace ends (``receivers.RunRequests``), after the ``task_postrun`` receivers."""
        super().after_return(status, retval, task_id, args, kwargs, einfo)
        after_run(self, task_id)

    def check_lock(self) -> None:
        """Raise ``LockLost`` if the lock of the run under way was lost; else return ``None``.

        For the loops of long bodies: a loss is found by the watchdog (within
        one renewal interval) and never interrupts the body by itself. Whatever
        ``lock_on_lost`` says, a body that asks is told. Outside a locked run
        (unlocked with ``redislock_on_error="run"``, or not running) it returns.
        """
        lock = _held_locks.get().get(getattr(self.request, "lock_key", None) or "")
        if lock is not None and lock.found_lost():
            raise LockLost(lock.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options, settings = _bound_options(self)
        request: Any = self.request_stack.top
        # The worker and apply() push the request of the execution they start; a direct call
        # (task(...)) pushes its own in super().__call__().
        if request is None or request.called_directly or hasattr(request, "lock_key"):
            request = None
        try:
            key = run_key(self, options, settings, args, kwargs)
        except LockKeyError:  # in a worker, not at apply_async: its message's enqueue lock goes
            free_unkeyed_ticket(self, request, options)
            raise
        held = _held_locks.get()
        raise_if_lost(held.values())  # a locked call inside a run is one of the run's check points
        if key in held:  # called directly from a call holding the same key: run under that hold
            return super().__call__(*args, **kwargs)
        run = Execution(self, options, settings, key, request, args, kwargs)
        # One try from ``begin`` on: an asynchronous exception (a soft time limit) landing between
        # two steps still lets go of the run, and leaves the thread holding nothing of it.
        try:
            if not run.begin():
                return skipped(self, request)
            _held_locks.set({**held, key: run.lock})
            with run.body():
                if request is not None:
                    request.update(run.fields())
                    if run.lock is not None:
                        run.lock.attach(request)  # a loss found before the body: not reset to False
                    result = self.run(*args, **kwargs)
                else:
                    try:  # consumed by the push of the call's own request; none left, whatever lands
                        _pending_request.set((self, run.fields(), run.lock))
                        result = super().__call__(*args, **kwargs)
                    finally:
                        _pending_request.set(None)
        except (Retry, Ignore, Reject) as exc:  # Celery calls no after_return then: the reply is read now
            run.unreturned = exc
            raise
        finally:  # the body's own exception, if any, stands, lost lock or not (the loss is logged)
            try:
                _held_locks.set(held)
            finally:
                try:
                    run.let_go()  # nothing to let go of after a skip or a failed begin
                except BaseException:
                    run.cut_short()
                    raise
        raise_if_lost([run.lock])  # the body returned, but exclusion broke meanwhile: not a success
        return result
