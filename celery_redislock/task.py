"""LockedTask: a Celery task that takes a per-signature Redis lock around its body.

``@app.task(base=LockedTask)`` makes two calls with the same arguments (the
same *signature*) never run at once: the worker takes the lock
``{prefix}:{task name}:{digest}`` before the body and releases it after,
whatever the outcome, and the watchdog renews it while the body runs. What
a worker does when the lock is held is the task's ``lock_busy`` policy.

Where each outcome is handled:

* the body ends (SUCCESS, FAILURE, RETRY, IGNORED, REJECTED): ``__call__``
  releases in a ``finally``, before Celery stores the result; the
  ``task_postrun`` receiver releases a lock an asynchronous exception (a soft
  time limit) kept that ``finally`` from releasing;
* the pool child dies (SIGKILL, OOM, hard time limit, ``revoke(terminate=True)``):
  the worker's main process releases the lock, owner-checked
  (``celery_redislock.request.LockedRequest``);
* the whole worker dies: nothing renews the lease, and it expires within
  ``lock_ttl``.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import os
import random
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar, cast

import redis
from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Retry

from . import signals
from ._scripts import RELEASE
from .config import AppSettings, LockOptions, app_settings, task_options
from .connection import client_for
from .exceptions import LockConfigurationError, LockLost, LockNotAcquired, LockNotOwned, RedisLockError
from .keys import call_digest, lock_key
from .lock import RedisLock
from .watchdog import Lease

__all__ = ["LockedTask", "holder_for", "install", "parse_holder", "release_held_by", "task_lock_key"]

logger = logging.getLogger(__name__)

#: Keys held by the calls running in this thread (or task), so that a task
#: called directly from inside another holding the same key runs under it.
_held_keys: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "celery_redislock_held", default=frozenset()
)
#: (task, lock fields, lock) for the request a direct call is about to push.
_pending_request: contextvars.ContextVar[tuple[Any, dict[str, Any], Any] | None] = contextvars.ContextVar(
    "celery_redislock_pending", default=None
)
#: task id -> its execution lock while the body runs in this process (for task_postrun).
_running: dict[str, RedisLock] = {}


def holder_for(task_id: str | None, retries: int, node: str, pid: int) -> str:
    """How a task's lock names its holder: task id, attempt (retries so far), worker node and process."""
    return f"task={task_id or '-'} try={retries} node={node} pid={pid}"


def parse_holder(holder: str | None) -> dict[str, str]:
    """The fields of a holder written by ``holder_for`` (empty for another kind of holder)."""
    if holder is None or not holder.startswith("task="):
        return {}
    return dict(field.partition("=")[::2] for field in holder.split(" "))


def release_held_by(client: redis.Redis, key: str, holder: str) -> bool:
    """Release ``key`` if ``holder`` holds it (two round trips); whether it was released.

    For a process that cleans up after another (the worker's main process
    after a pool child died): the token comes from the lock itself, and the
    release is still owner-checked, so a lock taken over meanwhile is left alone.
    """
    value = client.get(key)
    if value is None:
        return False
    token, _, rest = (value.decode() if isinstance(value, bytes) else str(value)).partition(":")
    if rest.partition(":")[2] != holder:
        return False
    return bool(int(RELEASE(client, [key], [token, ""])))


def task_lock_key(
    task: Task[Any, Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> str:
    """The Redis key ``task(*args, **kwargs)`` locks.

    Raises ``LockKeyError`` naming an argument that cannot be keyed.
    """
    options, settings = _bound_options(task)
    digest = call_digest(task.name, task.run, args or (), kwargs or {}, options.on)
    return lock_key(settings.prefix, task.name, digest)


def _bound_options(task: Task[Any, Any]) -> tuple[LockOptions, AppSettings]:
    options = getattr(task, "_lock_options", None)
    settings = getattr(task, "_lock_settings", None)
    if options is None or settings is None:
        raise LockConfigurationError(f"task {task.name!r} is not a LockedTask bound to an app")
    return options, settings


def _lost_here(key: str) -> type[LockLost]:
    """A ``LockLost`` class constructible without arguments, for ``PyThreadState_SetAsyncExc``."""

    class LockLostHere(LockLost):
        def __init__(self) -> None:
            super().__init__(key)

    return LockLostHere


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in the thread at its next bytecode (``None``: cancel a pending one)."""
    exc = None if exc_type is None else ctypes.py_object(exc_type)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


class _ExecutionLock(RedisLock):
    """A task's execution lock: a loss marks the request (``lock_lost``) and, with
    ``lock_on_lost="raise"``, raises ``LockLost`` in the thread running the body."""

    def __init__(self, client: redis.Redis, key: str, ttl: float, holder: str, on_lost: str) -> None:
        super().__init__(client, key, ttl, holder=holder)
        self.request: Any = None  # the request the body sees, once pushed
        self.raise_on_lost = on_lost == "raise"
        self._thread_id = threading.get_ident()
        self._body_running = False
        self._guard = threading.Lock()

    def _mark_lost(self, lease: Lease) -> bool:
        if not super()._mark_lost(lease):
            return False
        if self.request is not None:
            self.request.lock_lost = True
        with self._guard:
            if self.raise_on_lost and self._body_running:
                _set_async_exc(self._thread_id, _lost_here(self.name))
        return True

    @contextmanager
    def body(self) -> Iterator[None]:
        """While this block runs, a loss may raise ``LockLost`` in it; never after it."""
        with self._guard:
            self._body_running = True
        try:
            yield
        finally:
            with self._guard:
                self._body_running = False
                if self.raise_on_lost:
                    _set_async_exc(self._thread_id, None)


class LockedTask(Task):  # type: ignore[type-arg]
    """A task whose body runs under a per-signature Redis lock.

    Options are the ``lock_*`` attributes (see the README): set them with
    ``@app.task(base=LockedTask, lock_ttl=60)``, on a subclass, or through
    ``task_annotations``; ``None`` falls back to ``app.conf.redislock_*``,
    then to the default. They are checked when the task is bound.

    Inside the body, ``self.request.lock_key`` and ``self.request.lock_fence``
    describe the hold (``lock_fence`` is ``None`` when running unlocked with
    ``redislock_on_error="run"``), and ``self.request.lock_lost`` becomes
    ``True`` if the watchdog finds the lock lost.
    """

    Request = "celery_redislock.request:LockedRequest"

    lock_mode: ClassVar[str | None] = None
    lock_on: ClassVar[Any] = None
    lock_ttl: ClassVar[Any] = None
    lock_busy: ClassVar[str | None] = None
    lock_duplicate: ClassVar[str | None] = None
    lock_queue_ttl: ClassVar[Any] = None
    lock_period: ClassVar[Any] = None
    lock_retry_delay: ClassVar[Any] = None
    lock_wait_timeout: ClassVar[Any] = None
    lock_on_lost: ClassVar[str | None] = None

    _lock_options: ClassVar[LockOptions | None] = None
    _lock_settings: ClassVar[AppSettings | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        options = task_options(cls, app)
        if options.mode != "while_executing":
            raise LockConfigurationError(
                f"task {cls.name!r}: lock_mode={options.mode!r} is not available in this version; "
                "use 'while_executing'"
            )
        cls._lock_options = options
        cls._lock_settings = app_settings(app)
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
        task_lock_key(self, args or (), kwargs or {})  # arguments that cannot be keyed fail before sending
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        pending = _pending_request.get()
        if pending is None or pending[0] is not self:
            super().push_request(*args, **kwargs)
            return
        _pending_request.set(None)  # a direct call's own request gets the lock's fields
        _, fields, lock = pending
        super().push_request(*args, **{**kwargs, **fields})
        if lock is not None:
            lock.request = self.request_stack.top

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options, settings = _bound_options(self)
        key = task_lock_key(self, args, kwargs)
        held = _held_keys.get()
        if key in held:  # called directly from a call holding the same key: run under that hold
            return super().__call__(*args, **kwargs)
        request: Any = self.request_stack.top
        # The worker and apply() push the request of the execution they start; a direct call
        # (task(...)) pushes its own in super().__call__().
        if request is None or request.called_directly or hasattr(request, "lock_key"):
            request = None
        task_id = None if request is None else request.id
        node = (None if request is None else request.hostname) or socket.gethostname()
        client, url = client_for(self.app)
        execution_lock = _ExecutionLock(
            client,
            key,
            options.ttl,
            holder_for(task_id, 0 if request is None else request.retries, node, os.getpid()),
            options.on_lost,
        )
        execution_lock.request = request
        lock: _ExecutionLock | None = execution_lock
        try:
            if not self._acquire(execution_lock, options, request, task_id, args, kwargs):
                return None
        except redis.RedisError as exc:
            where = f"task {self.name!r}[{task_id}]: could not lock {key!r} in Redis at {url}: {exc}"
            if settings.on_error == "fail":
                raise RedisLockError(where) from exc
            logger.warning("%s; running unlocked (redislock_on_error='run')", where)
            lock = None
        fields = {"lock_key": key, "lock_fence": None if lock is None else lock.fence, "lock_lost": False}
        held_token = _held_keys.set(held | {key})
        if lock is not None and task_id is not None:
            _running[task_id] = lock
        try:
            with nullcontext() if lock is None else lock.body():
                if request is not None:
                    request.update(fields)
                    return self.run(*args, **kwargs)
                pending = _pending_request.set((self, fields, lock))
                try:
                    return super().__call__(*args, **kwargs)
                finally:
                    _pending_request.reset(pending)
        except LockLost as exc:
            if type(exc) is not LockLost:  # raised in this thread by the watchdog: make it a plain one
                raise LockLost(key) from None
            raise
        finally:
            _held_keys.reset(held_token)
            if lock is not None:
                _release(self, lock, task_id)
                if task_id is not None:  # only once released: an interrupted release is task_postrun's
                    _running.pop(task_id, None)

    def _acquire(
        self,
        lock: _ExecutionLock,
        options: LockOptions,
        request: Any,
        task_id: str | None,
        args: Any,
        kwargs: Any,
    ) -> bool:
        """Take ``lock``: ``False`` to skip the body; raises for ``raise``, ``retry``, a timed-out ``wait``.

        ``request`` is the worker's (or apply()'s) request, ``None`` for a direct call.
        """
        if lock.acquire(blocking=False):
            signals.lock_acquired.send(sender=self, key=lock.name, task_id=task_id, fence=lock.fence)
            return True
        holder, ttl = lock._busy
        signals.lock_busy.send(sender=self, key=lock.name, task_id=task_id, holder=holder)
        busy = options.busy
        held_by = parse_holder(holder)
        if request is not None and held_by.get("task") == task_id and int(held_by["try"]) < request.retries:
            busy = "wait"  # this task's previous attempt published this retry and is releasing now
        elif request is not None and (request.group or request.chord):
            busy = "wait"  # a group or chord member is never skipped: its chord would never complete
        elif busy == "retry" and (request is None or request.is_eager):
            busy = "wait"  # an eager or direct call cannot be retried later
        if busy == "skip":
            logger.info(
                "task %s[%s] skipped: lock %s is held by task %s (%s)",
                self.name,
                task_id,
                lock.name,
                held_by.get("task"),
                holder,
            )
            return False
        if busy == "retry":
            delay = options.retry_delay * random.uniform(0.5, 1.5)
            logger.info(
                "task %s[%s] retries in %.1fs: lock %s is held by task %s",
                self.name,
                task_id,
                delay,
                lock.name,
                held_by.get("task"),
            )
            # Republished with the same retry count: a busy lock is not one of the task's own retries.
            signature = self.signature_from_request(
                request, args, kwargs, countdown=delay, retries=request.retries
            )
            signature.apply_async()
            raise Retry(f"lock {lock.name} is held by {holder}", when=cast(Any, delay), sig=signature)
        if busy == "wait" and lock.acquire(timeout=options.wait_timeout):
            signals.lock_acquired.send(sender=self, key=lock.name, task_id=task_id, fence=lock.fence)
            return True
        holder, ttl = lock._busy
        raise LockNotAcquired(lock.name, holder, ttl)


def _release(task: Task[Any, Any], lock: RedisLock, task_id: str | None) -> None:
    """Release after the body; a failure is logged, never raised over the task's outcome."""
    if not lock._held_here():
        return
    try:
        lock.release()
    except LockNotOwned:
        logger.warning(
            "task %s[%s]: lock %s was no longer held when the task ended", task.name, task_id, lock.name
        )
    except redis.RedisError as exc:
        logger.warning(
            "task %s[%s]: could not release lock %s (%s); it expires within its ttl",
            task.name,
            task_id,
            lock.name,
            exc,
        )
    else:
        signals.lock_released.send(sender=task, key=lock.name, task_id=task_id)


def _release_after_run(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: release what an asynchronous exception kept ``__call__`` from releasing."""
    lock = _running.pop(task_id, None) if task_id is not None else None
    if lock is not None:
        _release(sender, lock, task_id)


def install(app: Any) -> None:
    """Connect the package's signal receivers for ``app``; idempotent.

    Called when the first ``LockedTask`` is bound to ``app``; importing the
    package connects nothing. Receivers are strong references with a
    ``dispatch_uid``, so connecting twice keeps one.
    """
    if getattr(app, "_redislock_installed", False):
        return
    app_settings(app)  # bad settings fail here, not at the first task
    celery_signals.task_postrun.connect(
        _release_after_run, weak=False, dispatch_uid="celery_redislock.release_after_run"
    )
    app._redislock_installed = True
