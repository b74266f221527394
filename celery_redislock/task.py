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
* a step between taking the lock and running the body fails (a Redis error
  freeing the message's enqueue lock): the lock is released on the way out;
* the lock is lost while the body runs: the run is told at points the package
  controls, never by an exception injected into the body (``lock_on_lost``,
  ``LockedTask.check_lock``), or its prefork pool child is stopped
  (``lock_on_lost="terminate"``);
* the pool child dies (SIGKILL, OOM, hard time limit, ``revoke(terminate=True)``,
  ``lock_on_lost="terminate"``): the worker's main process releases the lock
  once the child is gone, owner-checked (``celery_redislock.request.LockedRequest``);
* the whole worker dies: nothing renews the lease, and it expires within
  ``lock_ttl``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import random
import secrets
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, ClassVar, cast

import redis
from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Ignore, Retry
from celery.utils.time import maybe_make_aware
from kombu.utils.uuid import uuid

from . import signals
from ._durations import to_ms
from ._scripts import RELEASE, RENEW
from ._task_scripts import ADOPT, CLAIM, PARK, SETTLE
from .config import AppSettings, LockOptions, app_settings, task_options
from .connection import Client, client_for
from .exceptions import (
    DuplicateTask,
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    LockNotReplicated,
    RedisLockError,
)
from .keys import call_digest, lock_key
from .lock import RedisLock
from .protocol import (
    BEAT_HEADER,
    HEADER,
    holder_for,
    message_ticket,
    parse_holder,
    parse_value,
    request_slot,
    request_ticket,
    text,
)
from .watchdog import Lease

__all__ = [
    "BEAT_HEADER",
    "HEADER",
    "LockedTask",
    "free_ticket",
    "holder_for",
    "install",
    "message_ticket",
    "parse_holder",
    "release_held_by",
    "request_slot",
    "task_lock_key",
]

logger = logging.getLogger(__name__)

#: Key -> execution lock (``None`` when running unlocked) of the runs under way in this thread
#: (or task): a task called directly from inside another holding the same key runs under
#: it, and a locked call inside a run is one of the points where a loss is raised.
_held_locks: contextvars.ContextVar[Mapping[str, _ExecutionLock | None]] = contextvars.ContextVar(
    "celery_redislock_held", default=MappingProxyType({})
)
#: (task, lock fields, lock) for the request a direct call is about to push.
_pending_request: contextvars.ContextVar[tuple[Any, dict[str, Any], Any] | None] = contextvars.ContextVar(
    "celery_redislock_pending", default=None
)
#: thread id -> (task id, its lock) while a worker's body runs in that thread, for the
#: task_postrun receiver, which runs in the same thread (two attempts of one task, a
#: retry starting while its previous attempt finishes, run in different threads).
_running: dict[int, tuple[str, RedisLock]] = {}


def release_held_by(client: Client, key: str, holder: str) -> bool:
    """Release ``key`` if ``holder`` holds it (two round trips); whether it was released.

    For a process that cleans up after another (the worker's main process
    after a pool child died): the token comes from the lock itself, and the
    release is still owner-checked, so a lock taken over meanwhile is left alone.
    """
    value = parse_value(client.get(key))
    if value is None or value.holder != holder:
        return False
    return free_ticket(client, (key, value.token))


def free_ticket(client: Client, ticket: tuple[str, str]) -> bool:
    """Release a message's enqueue lock, owner-checked by its token; whether it was released."""
    key, token = ticket
    return bool(int(RELEASE(client, [key], [token])))


def task_lock_key(
    task: Task[Any, Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> str:
    """The Redis key ``task(*args, **kwargs)`` locks.

    Raises ``LockKeyError`` naming an argument that cannot be keyed.
    """
    options, settings = _bound_options(task)
    digest = call_digest(task.name, task.run, args or (), kwargs or {}, options.on, settings.key_secret)
    return lock_key(settings.prefix, task.name, digest)


def _bound_options(task: Task[Any, Any]) -> tuple[LockOptions, AppSettings]:
    options = getattr(task, "lock_options", None)
    settings = getattr(task, "lock_settings", None)
    if options is None or settings is None:
        raise LockConfigurationError(f"task {task.name!r} is not a LockedTask bound to an app")
    return options, settings


class _ExecutionLock(RedisLock):
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
        raise_on_lost: bool,
        stop_child: bool,
    ) -> None:
        super().__init__(client, key, ttl, holder=holder, **settings.replication)
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
                    logger.error(
                        "lock %r lost while task %s ran: it is no longer held by this task; stopping "
                        "pool child %d (lock_on_lost='terminate')",
                        self.name,
                        getattr(self.request, "id", None),
                        os.getpid(),
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
        return True

    @contextmanager
    def body(self) -> Iterator[None]:
        """The body runs in this block: only then does a loss stop the pool child (``stop_child``)."""
        with self._guard:
            self._body_running = True
        try:
            yield
        finally:
            with self._guard:
                self._body_running = False


def _raise_if_lost(locks: Iterable[_ExecutionLock | None]) -> None:
    """Raise ``LockLost`` for the first of ``locks`` that raises on a loss and was lost."""
    for lock in locks:
        if lock is not None and lock.raise_on_lost and lock.lost.is_set():
            raise LockLost(lock.name)


def _mark_pool_child(app_ref: weakref.ref[Any], **_: Any) -> None:
    """``worker_process_init`` (sent in a prefork pool child only): this process is one."""
    app = app_ref()
    if app is not None:
        app._redislock_pool_child = os.getpid()


class LockedTask(Task):  # type: ignore[type-arg]
    """A task whose body runs under a per-signature Redis lock.

    Options are the ``lock_*`` attributes (see the README): set them with
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

    # Each option's ``None`` falls back to ``app.conf.redislock_<x>``, then to the default in brackets.

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
    #: ``"wait"`` (up to ``lock_wait_timeout``) or ``"raise"`` (``LockNotAcquired``).
    #: [``"retry"`` for ``until_and_while_executing``, else ``"skip"``]
    lock_busy: ClassVar[str | None] = None
    #: An enqueue that finds its lock held: ``"return"`` the queued task's ``AsyncResult``, or
    #: ``"raise"`` ``DuplicateTask``. [``"return"``]
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
    #: whether the WARNING that ``lock_on_lost="terminate"`` acts as ``"raise"`` here was logged
    _lock_terminate_warned: bool = False

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        cls.lock_options = task_options(cls, app)
        cls.lock_settings = app_settings(app)
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

        A duplicate returns the ``AsyncResult`` of the task already queued or
        running (``lock_duplicate="return"``) or raises ``DuplicateTask``. A
        republish of a message that carries its lock, and a member of a group
        or chord (unless sent with ``lock_in_canvas=True``), pass. So does a
        retry of the attempt running here (``self.retry``, autoretry), however
        its first attempt was sent: in the modes that keep the lock between
        attempts, its message carries a token of its own, for which the attempt
        parks its hold when it lets go.
        """
        key = task_lock_key(self, args or (), kwargs or {})  # unkeyable arguments fail before sending
        lock_options, settings = _bound_options(self)
        in_canvas_opt_in = options.pop("lock_in_canvas", False)
        in_canvas = (options.get("group_id") or options.get("chord")) and not in_canvas_opt_in
        headers = dict(options.pop("headers", None) or {})
        running = self._retried_attempt(key, task_id, options)
        rules = lock_options.rules
        if running is not None and rules.parks_for_retry and running.lock_fence is not None:
            token = secrets.token_hex(16)
            headers[HEADER] = {"key": key, "token": token}
            result = super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
            )
            running.lock_retry = (key, token, _delay(options))  # once sent: _let_go parks the hold for it
            return result
        if running is not None or not rules.enqueue_lock or HEADER in headers or in_canvas:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
            )
        task_id = task_id or uuid()
        key += rules.queued_suffix
        ttl = lock_options.queue_ttl + _delay(options)
        if options.get("expires") is not None:
            ttl = min(ttl, max(_seconds_until(options["expires"]), 0.001))
        if rules.settles:
            ttl = max(ttl, lock_options.period or 0)
        client, url = client_for(self.app)
        holder = holder_for(task_id, options.get("retries") or 0, socket.gethostname(), os.getpid(), "queued")
        lock = RedisLock(client, key, ttl, watchdog=False, holder=holder, **settings.replication)
        try:
            acquired = lock.acquire(blocking=False)
        except (redis.RedisError, LockNotReplicated) as exc:  # not replicated: as unreachable
            where = (
                f"task {self.name!r}[{task_id}]: could not take enqueue lock {key!r} in Redis at {url}: {exc}"
            )
            if settings.on_error == "fail":
                raise RedisLockError(where) from exc
            logger.warning("%s; sending it unlocked (redislock_on_error='run')", where)
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
            )
        if not acquired:
            return self._duplicate(key, *lock.busy)
        headers[HEADER] = {"key": key, "token": lock.token}
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, headers=headers, **options
            )
        except BaseException:
            _release(self, lock, task_id)  # nothing was sent: nothing must stay locked
            raise

    def _retried_attempt(self, key: str, task_id: str | None, options: Mapping[str, Any]) -> Any:
        """The request of the attempt running here that a message for ``task_id`` with
        ``options`` retries (same task id and key, the next retry count), if any."""
        running = self.request
        if (
            task_id is None
            or running.id != task_id
            or getattr(running, "lock_key", None) != key
            or (options.get("retries") or 0) != (running.retries or 0) + 1
        ):
            return None
        return running

    def _duplicate(self, key: str, holder: str | None, ttl: float | None) -> Any:
        """An enqueue found ``key`` held: the existing task's result, or ``DuplicateTask``."""
        existing = parse_holder(holder).get("task")
        logger.info("task %s: not sent, a duplicate of task %s (lock %s)", self.name, existing, key)
        signals.task_deduplicated.send(sender=self, key=key, existing_task_id=existing)
        if self.lock_options is not None and self.lock_options.duplicate == "return" and existing:
            return self.AsyncResult(existing)
        raise DuplicateTask(key, existing, holder, ttl)

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

    def check_lock(self) -> None:
        """Raise ``LockLost`` if the lock of the run under way was lost; else return ``None``.

        For the loops of long bodies: a loss is found by the watchdog (within
        one renewal interval) and never interrupts the body by itself. Whatever
        ``lock_on_lost`` says, a body that asks is told. Outside a locked run
        (unlocked with ``redislock_on_error="run"``, or not running) it returns.
        """
        lock = _held_locks.get().get(getattr(self.request, "lock_key", None) or "")
        if lock is not None and lock.lost.is_set():
            raise LockLost(lock.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options, settings = _bound_options(self)
        key = task_lock_key(self, args, kwargs)
        held = _held_locks.get()
        _raise_if_lost(held.values())  # a locked call inside a run is one of the run's check points
        if key in held:  # called directly from a call holding the same key: run under that hold
            return super().__call__(*args, **kwargs)
        request: Any = self.request_stack.top
        # The worker and apply() push the request of the execution they start; a direct call
        # (task(...)) pushes its own in super().__call__().
        if request is None or request.called_directly or hasattr(request, "lock_key"):
            request = None
        task_id = None if request is None else request.id
        retries = 0 if request is None else request.retries or 0
        node = (None if request is None else request.hostname) or socket.gethostname()
        ticket = None if request is None else request_ticket(request)
        slot = None if request is None else request_slot(request)
        if slot is not None and not (options.beat or slot.get("claimed")):
            slot = None  # neither the task nor its schedule entry opted in
        client, url = client_for(self.app)
        lock: _ExecutionLock | None = None
        if options.rules.execution_lock:
            lock = _ExecutionLock(
                client,
                key,
                options.ttl,
                holder_for(task_id, retries, node, os.getpid()),
                settings,
                raise_on_lost=options.on_lost != "log",
                stop_child=self._stops_child(options),
            )
            lock.request = request
            # From here on, what an asynchronous exception leaves held is task_postrun's to release.
            if task_id is not None:
                _running[threading.get_ident()] = (task_id, lock)
        # In these modes the message's enqueue lock goes once the message is dealt with here:
        # run, skipped or failed; not when it is republished (Retry) or ignored as a twin.
        ticket_to_free = ticket if options.rules.frees_ticket else None
        try:
            if slot is not None and not self._claim_slot(client, slot, request, node):
                if ticket is not None:  # a duplicate never runs: its enqueue lock, if any, goes
                    free_ticket(client, ticket)
                return None
            try:
                taken = lock is None or self._take(lock, options, request, args, kwargs, ticket)
            except LockNotAcquired:
                if ticket_to_free is not None:
                    # Refused is the outcome: an error freeing the enqueue lock must not turn it into
                    # an unlocked run beside the holder (redislock_on_error="run").
                    with suppress(redis.RedisError):
                        self._free_message_lock(client, ticket_to_free, None, task_id)
                raise
            if ticket_to_free is not None:
                self._free_message_lock(client, ticket_to_free, lock, task_id)
            if not taken:
                return None
        except (redis.RedisError, LockNotReplicated) as exc:  # not replicated: as unreachable
            where = f"task {self.name!r}[{task_id}]: could not lock {key!r} in Redis at {url}: {exc}"
            if settings.on_error == "fail":
                raise RedisLockError(where) from exc
            logger.warning("%s; running unlocked (redislock_on_error='run')", where)
            lock = None
        fields = {
            "lock_key": key,
            "lock_fence": None if lock is None else lock.fence,
            "lock_lost": False,
            "lock_slot": None if slot is None else slot["slot"],
        }
        held_token = _held_locks.set({**held, key: lock})
        try:
            with nullcontext() if lock is None else lock.body():
                if request is not None:
                    request.update(fields)
                    result = self.run(*args, **kwargs)
                else:
                    pending = _pending_request.set((self, fields, lock))
                    try:
                        result = super().__call__(*args, **kwargs)
                    finally:
                        _pending_request.reset(pending)
        finally:  # the body's own exception, if any, stands, lost lock or not (the loss is logged)
            _held_locks.reset(held_token)
            if lock is not None:
                self._let_go(lock, options, task_id, retries)
                if task_id is not None:  # only once let go: an interrupted release is task_postrun's
                    _running.pop(threading.get_ident(), None)
        _raise_if_lost([lock])  # the body returned, but exclusion broke meanwhile: not a success
        return result

    def _stops_child(self, options: LockOptions) -> bool:
        """Whether a lost lock stops this process: ``lock_on_lost="terminate"`` in a prefork pool child.

        Anywhere else (threads, solo, gevent or eventlet pools, a direct call)
        the process is the worker itself: ``"terminate"`` acts as ``"raise"``,
        with a WARNING the first time.
        """
        if options.on_lost != "terminate":
            return False
        if getattr(self.app, "_redislock_pool_child", None) == os.getpid():
            return True
        if not self._lock_terminate_warned:
            self._lock_terminate_warned = True
            logger.warning(
                "task %s: lock_on_lost='terminate' stops a prefork pool child, and this process is "
                "not one (threads, solo, gevent or eventlet pool, or a direct call): a lost lock "
                "raises LockLost instead, as with lock_on_lost='raise'",
                self.name,
            )
        return False

    def _free_message_lock(
        self, client: Client, ticket: tuple[str, str], lock: _ExecutionLock | None, task_id: str | None
    ) -> None:
        """Free the message's enqueue lock, the run being under way (``lock``: its execution lock).

        If that fails, nothing stays held: ``lock`` is released, the enqueue
        lock is tried once more (owner-checked), and the error propagates.
        """
        try:
            if not free_ticket(client, ticket):
                logger.debug("task %s[%s]: its enqueue lock had already gone", self.name, task_id)
        except BaseException:
            if lock is not None:
                _release(self, lock, task_id)
            try:
                free_ticket(client, ticket)
            except redis.RedisError as exc:
                logger.warning(
                    "task %s[%s]: could not release its enqueue lock %s (%s); it expires within its ttl",
                    self.name,
                    task_id,
                    ticket[0],
                    exc,
                )
            raise

    def _claim_slot(self, client: Client, slot: dict[str, Any], request: Any, node: str) -> bool:
        """Claim the beat slot the message was sent for; ``False`` if another message has it.

        The sender's claim (same token) is taken over, naming this task; a slot
        nobody claimed (beat's ``send_task`` fallback) goes to the first
        message of it that starts here.
        """
        holder = holder_for(request.id, request.retries or 0, node, os.getpid(), "claimed")
        reply = CLAIM(client, [slot["key"]], [slot["token"], holder, slot["ttl"]])
        if isinstance(reply, int):
            logger.info(
                "task %s[%s]: runs slot %s of beat entry %r (sent by %s)",
                self.name,
                request.id,
                slot["slot"],
                slot["entry"],
                slot.get("beat"),
            )
            return True
        other = text(reply)
        logger.info(
            "task %s[%s]: not run, a duplicate: slot %s of beat entry %r went to %s (marker %s)",
            self.name,
            request.id,
            slot["slot"],
            slot["entry"],
            other,
            slot["key"],
        )
        signals.task_deduplicated.send(
            sender=self, key=slot["key"], existing_task_id=parse_holder(other).get("task")
        )
        return False

    def _take(
        self,
        lock: _ExecutionLock,
        options: LockOptions,
        request: Any,
        args: Any,
        kwargs: Any,
        ticket: tuple[str, str] | None,
    ) -> bool:
        """Take ``lock`` (adopting the message's enqueue lock where the mode keeps it):
        ``False`` to skip the body; raises for ``raise``, ``retry``, a timed-out ``wait``.

        ``request`` is the worker's (or apply()'s) request, ``None`` for a direct call.
        """
        task_id = None if request is None else request.id
        if options.rules.adopts_ticket and ticket is not None and ticket[0] == lock.name:
            busy = _adopt(lock, ticket[1])
            if busy is None:
                return self._acquired(lock, task_id)
            if busy[1] != -2:  # held, not for this message: busy (gone: take it afresh below)
                return self._when_busy(lock, options, request, args, kwargs, busy[0], max(busy[1], 0) / 1000)
        if lock.acquire(blocking=False):
            return self._acquired(lock, task_id)
        return self._when_busy(lock, options, request, args, kwargs, *lock.busy)

    def _acquired(self, lock: _ExecutionLock, task_id: str | None) -> bool:
        signals.lock_acquired.send(sender=self, key=lock.name, task_id=task_id, fence=lock.fence)
        return True

    def _when_busy(
        self,
        lock: _ExecutionLock,
        options: LockOptions,
        request: Any,
        args: Any,
        kwargs: Any,
        holder: str | None,
        ttl: float | None,
    ) -> bool:
        """``lock`` is held by ``holder``: apply ``lock_busy`` (see ``_take``)."""
        task_id = None if request is None else request.id
        signals.lock_busy.send(sender=self, key=lock.name, task_id=task_id, holder=holder)
        busy = options.busy
        held_by = parse_holder(holder)
        same_task = request is not None and held_by.get("task") == task_id
        if same_task and int(held_by["try"]) == (request.retries or 0) and held_by.get("state") == "running":
            # A redelivered message (acks_late, visibility timeout, a dead consumer's messages):
            # ignored while its first delivery runs, run if that delivery's worker died.
            if self._first_delivery_died(lock, options, holder, ttl or 0.0):
                logger.warning(
                    "task %s[%s]: redelivered after its first delivery's worker died (its lease on %s "
                    "ran out); running it",
                    self.name,
                    task_id,
                    lock.name,
                )
                return self._acquired(lock, task_id)
            logger.info("task %s[%s]: redelivered while its first delivery runs; ignored", self.name, task_id)
            raise Ignore()
        if same_task and int(held_by["try"]) > (request.retries or 0):
            # A copy of an earlier attempt (a redelivery): a later attempt is queued or running.
            logger.info(
                "task %s[%s]: a later attempt holds %s; this stale copy is ignored",
                self.name,
                task_id,
                lock.name,
            )
            raise Ignore()
        if same_task and int(held_by["try"]) < (request.retries or 0):
            # This task's previous attempt published this retry and is letting go now.
            ticket = request_ticket(request)
            if options.rules.parks_for_retry and ticket is not None and ticket[0] == lock.name:
                return self._adopt_when_parked(lock, options, ticket[1], task_id)
            busy = "wait"
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
            ticket = request_ticket(request)
            if ticket is not None and options.rules.frees_ticket:
                # Queued again, with the same enqueue lock: it lives as long as at enqueue (owner-checked).
                RENEW(lock.client, [ticket[0]], [to_ms(options.queue_ttl + delay), ticket[1]])
            signature.apply_async()
            raise Retry(f"lock {lock.name} is held by {holder}", when=cast(Any, delay), sig=signature)
        if busy == "wait" and lock.acquire(timeout=options.wait_timeout):
            return self._acquired(lock, task_id)
        if busy == "wait":
            holder, ttl = lock.busy
        raise LockNotAcquired(lock.name, holder, ttl)

    def _adopt_when_parked(
        self, lock: _ExecutionLock, options: LockOptions, token: str, task_id: str | None
    ) -> bool:
        """A retry carrying ``token`` found its previous attempt still holding ``lock``: wait (at
        most ``lock_wait_timeout``) until that attempt parks the hold for ``token`` (its park wakes
        this waiter) or frees it, then adopt it; else ``LockNotAcquired``."""
        fence = lock.wait_as(token, time.monotonic() + options.wait_timeout)
        holder, ttl = lock.busy
        if fence is not None:  # ``token`` owns the hold now: parked for it, or taken free
            busy = _adopt(lock, token)
            if busy is None:
                return self._acquired(lock, task_id)
            holder, ttl = busy[0], max(busy[1], 0) / 1000
        raise LockNotAcquired(lock.name, holder, ttl)

    def _first_delivery_died(
        self, lock: _ExecutionLock, options: LockOptions, holder: str | None, left: float
    ) -> bool:
        """A redelivered message found ``lock`` held by its own first delivery, ``left`` seconds from expiry.

        ``True`` (``lock`` now held here) if that holder died: its lease ran out
        unrenewed. ``False`` if it is alive (it renewed the lease or released
        it: it ran to its end, or its pool child died and the worker released
        for it). A live holder renews every ``lock_ttl/3``, so this waits at most
        one renewal interval for a live holder, and the rest of the lease for a
        dead one; it is woken at once by a release.
        """
        margin = 0.1  # seconds: a release this close to the lease's end counts as its running out
        began = time.monotonic()
        if left > margin:  # watch for one renewal interval, never up to the end of the lease
            if lock.acquire(timeout=min(options.ttl / 3, left - margin)):
                _release(self, lock, None, announce=False)  # freed early: released by its holder, who is done
                return False
            now_holder, now_left = lock.busy
            if now_holder != holder or (now_left or 0.0) > left - (time.monotonic() - began) + margin:
                return False  # renewed (alive), or released and taken by another
            began, left = time.monotonic(), now_left or 0.0
        if lock.acquire(timeout=left + margin):  # not renewed for an interval: wait for the lease to end
            if time.monotonic() - began >= left - margin:
                return True  # it ran out: the holder is dead
            _release(self, lock, None, announce=False)  # released late: it was alive after all
        return False

    def _let_go(self, lock: _ExecutionLock, options: LockOptions, task_id: str | None, retries: int) -> None:
        """After the body: release, or keep the lock as the mode says (a retry on its way; a period).

        An attempt that sent its retry (``apply_async``) parks its hold for the token
        the retry's message carries, whether the body then raised the ``Retry`` or not.
        """
        retry = getattr(lock.request, "lock_retry", None)
        if options.rules.parks_for_retry and retry is not None and retry[0] == lock.name and lock.held():
            ttl = options.queue_ttl + retry[2]
            queued = holder_for(task_id, retries + 1, socket.gethostname(), os.getpid(), "queued")
            current = lock.holder or ""
            try:
                parked = PARK(
                    lock.client, [lock.name], [lock.stop_renewing(), current, retry[1], queued, to_ms(ttl)]
                )
            except redis.RedisError as exc:
                logger.warning(
                    "task %s[%s]: could not keep lock %s for its retry: %s",
                    self.name,
                    task_id,
                    lock.name,
                    exc,
                )
                return
            finally:
                lock.forget()
            if not int(parked):
                logger.info(  # usually the retry already adopted it; else it was lost
                    "task %s[%s]: lock %s was already taken over at its retry", self.name, task_id, lock.name
                )
            return
        if options.rules.settles and options.period is not None and lock.held():
            try:
                left = int(SETTLE(lock.client, [lock.name], [lock.stop_renewing(), to_ms(options.period)]))
            except redis.RedisError as exc:
                logger.warning("task %s[%s]: could not keep lock %s: %s", self.name, task_id, lock.name, exc)
                lock.forget()
                return
            if left > 0:
                lock.forget()
                return
        _release(self, lock, task_id)


def _delay(options: Mapping[str, Any]) -> float:
    """Seconds until a message sent with ``options`` (``countdown``/``eta``) may run."""
    if options.get("countdown") is not None:
        return max(float(options["countdown"]), 0.0)
    if options.get("eta") is not None:
        return max(_seconds_until(options["eta"]), 0.0)
    return 0.0


def _seconds_until(when: Any) -> float:
    """``when`` (seconds from now, a datetime or an ISO 8601 string) as seconds from now.

    Read as Celery's worker reads a message's ``eta``/``expires``: a naive time is UTC,
    whatever the process's local time zone or the app's ``timezone``.
    """
    if isinstance(when, (int, float)):
        return float(when)
    moment: datetime = maybe_make_aware(datetime.fromisoformat(when) if isinstance(when, str) else when)
    return (moment - datetime.now(timezone.utc)).total_seconds()


def _adopt(lock: _ExecutionLock, token: str) -> tuple[str | None, int] | None:
    """Adopt for ``lock`` the hold queued for the message carrying ``token`` (``ADOPT``), under a
    token of the run's own; ``None`` once held (acknowledged by ``replicas`` replicas where set,
    as every acquisition), else (the holder, its PTTL in ms; -2: gone).

    Raises ``LockNotReplicated`` (the hold released) when too few replicas acknowledge it.
    """
    own = secrets.token_hex(16)
    sent_at = time.monotonic()
    reply = ADOPT(lock.client, [lock.name], [token, own, to_ms(lock.ttl), lock.holder or ""])
    if not isinstance(reply, int):
        return (None if reply[1] is None else text(reply[1])), int(reply[0])
    lock.take_hold(own, reply, sent_at)
    return None


def _release(task: Task[Any, Any], lock: RedisLock, task_id: str | None, *, announce: bool = True) -> None:
    """Release after the body; a failure is logged, never raised over the task's outcome.

    A lock found no longer held is marked ``lost``. ``announce=False``: no
    ``lock_released`` signal (for a hold that was never a run's: a probe).
    """
    if not lock.held():
        return
    try:
        lock.release()
    except LockNotOwned:
        lock.lost.set()
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
        if announce:
            signals.lock_released.send(sender=task, key=lock.name, task_id=task_id)


def _release_after_run(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: release what an asynchronous exception kept ``__call__`` from releasing."""
    running = _running.pop(threading.get_ident(), None)
    if running is not None and running[0] == task_id:
        _release(sender, running[1], task_id)


def _free_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    """``task_revoked`` (worker main process): a message revoked or expired before it ran
    frees its enqueue lock. A terminated run's lock is freed once its child is gone
    (``LockedRequest``)."""
    ticket = request_ticket(request)
    if ticket is None or terminated or not isinstance(sender, LockedTask):
        return
    _free_ticket_logged(
        sender.app, ticket, f"task {sender.name}[{request.id}] {'expired' if expired else 'revoked'}"
    )


def _free_unrunnable(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    """``task_unknown`` / ``task_rejected`` (worker main process): a message that will never
    run frees the enqueue lock it carries."""
    ticket = message_ticket(getattr(message, "headers", None))
    app = getattr(sender, "app", None)
    if ticket is not None and app is not None:
        _free_ticket_logged(app, ticket, f"message for {name or 'an invalid task'} dropped")


def _free_ticket_logged(app: Any, ticket: tuple[str, str], why: str) -> None:
    try:
        client, _ = client_for(app)
        if free_ticket(client, ticket):
            logger.info("%s: released its enqueue lock %s", why, ticket[0])
    except Exception:  # the worker's main loop must go on
        logger.exception("%s: could not release its enqueue lock %s", why, ticket[0])


def install(app: Any) -> None:
    """Connect the package's signal receivers for ``app``; idempotent.

    Called when the first ``LockedTask`` is bound to ``app``; importing the
    package connects nothing. Receivers are strong references with a
    ``dispatch_uid``, so connecting twice keeps one. In a beat process they
    include the beat guard (``celery_redislock.beat``): call ``install(app)``
    there yourself if that process binds no ``LockedTask``.
    """
    if getattr(app, "_redislock_installed", False):
        return
    app_settings(app)  # bad settings fail here, not at the first task
    celery_signals.task_postrun.connect(
        _release_after_run, weak=False, dispatch_uid="celery_redislock.release_after_run"
    )
    # Once per app (this function is idempotent), holding the app weakly.
    celery_signals.worker_process_init.connect(
        functools.partial(_mark_pool_child, weakref.ref(app)), weak=False
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
    from .beat import connect  # beat builds on this module: imported once it is needed

    connect()
    app._redislock_installed = True
