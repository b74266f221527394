"""The retry Celery's worker main process sends for a task whose pool child was lost.

With ``task_retry_on_worker_lost`` (Celery 5.7 and later), a prefork pool child that dies
mid-task (SIGKILL, OOM) has its task retried by the worker's main process
(``Request._retry_worker_lost``: ``signature_from_request(...).apply_async()``, with the
next retry count and ``default_retry_delay`` as countdown), where no run of it is under way:
``LockedTask.apply_async`` learns of it here (``retrying``, around Celery's send, by
``LockedRequest``) and sends it as a retry, the way it sends ``self.retry()``:

* never refused as a duplicate: not of the dead run's own hold, which the main process has
  not let go of yet (a message sent without an enqueue lock, by ``send_task`` say, would be
  refused and ``Celery`` would take the ``AsyncResult`` for a retry sent: the task never runs
  again), nor of a later call's enqueue lock;
* in the modes that keep the lock across a task's retries (``until_executed``,
  ``until_expired``), the dead run's hold is parked (``PARK``) for a token of the retry's own,
  which its message carries, before it is sent, as a run's own retry parks it: one queued or
  running, also while the retry waits out its countdown; else the main process released the
  hold, and a ``delay()`` meanwhile was sent beside the retry. A hold that is not the dead
  run's any more (it never adopted its message's, or lost it) is left alone: the retry
  carries the message's enqueue lock, if any, as before. A send that fails lets the parked
  hold go (``give_up_ticket``), and so does an interrupt of the main process (a hard
  shutdown's ``WorkerTerminate``) from ``PARK``'s send to the retry's.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import redis

from .config import LockOptions
from .connection import client_for
from .enqueue import give_up_ticket
from .inventory import hold_of
from .protocol import HEADER, message_delay, sent_attempt
from .run_lock import park
from .telemetry import log_fields

__all__ = ["LostRun", "lost_run", "retrying"]

logger = logging.getLogger(__name__)


@dataclass
class LostRun:
    """A run whose pool child was lost: its task id, attempt (retries so far), and the holder
    its execution lock names (``None``: it held none); ``sent`` once its retry was sent (what
    Celery does next, the task's ``on_retry`` say, may still raise)."""

    task_id: str
    retries: int
    holder: str | None
    sent: bool = False

    def send(
        self,
        task: Any,
        key: str,
        options: Mapping[str, Any],
        headers: dict[str, Any],
        send: Callable[[str | None], Any],
    ) -> Any:
        """Send its retry (``send``, with ``headers``) for the lock ``key``: the dead run's hold
        parked for it first, where the mode keeps the lock across retries."""
        lock_options: LockOptions = task.lock_options
        if not lock_options.rules.parks_for_retry or self.holder is None:
            return self._sent(send)
        try:
            client, _ = client_for(task.app)
            value = hold_of(client, key, self.holder)
        except redis.RedisError as exc:  # its hold is released (or runs out), as without a retry
            self._not_kept(task, key, exc)
            return self._sent(send)
        if value is None:  # not the dead run's: the retry carries its message's ticket, if any
            return self._sent(send)
        token = secrets.token_hex(16)  # carried whatever PARK's outcome: a lost reply may hide a park
        headers[HEADER] = {"key": key, "token": token}
        parked: bool | None = None  # unknown until PARK's reply is read
        try:
            parked = self._park(task, client, key, (value.token, token), lock_options, options)
            return self._sent(send)
        except BaseException:  # not sent (a failed send, an interrupt: a hard shutdown's
            # WorkerTerminate): nothing will adopt the hold parked, or maybe parked, for ``token``
            why = f"task {task.name}[{self.task_id}]: its retry after a lost pool child was not sent"
            with suppress(redis.RedisError):  # the exception stands (the hold runs out)
                if parked is not False:
                    give_up_ticket(client, (key, token), True, lock_options, why)
            raise

    def _sent(self, send: Callable[[str | None], Any]) -> Any:
        """Send the retry (``send``); noted once it returned."""
        result = send(self.task_id)
        self.sent = True
        return result

    def _park(
        self,
        task: Any,
        client: Any,
        key: str,
        tokens: tuple[str, str],
        lock_options: LockOptions,
        options: Mapping[str, Any],
    ) -> bool:
        """Park the dead run's hold of ``key`` (``tokens``: its token, and the one the retry
        carries) for the retry sent with ``options``, owner-checked by its holder: whether it was
        (or, after a Redis error, may have been) parked. Not parked: the main process releases
        it, and the retry takes the lock afresh."""
        hold, retry = (tokens[0], self.holder or ""), (self.task_id, *sent_attempt(options))
        try:
            return park(client, key, hold, tokens[1], retry, lock_options, message_delay(options)) == 1
        except redis.RedisError as exc:
            self._not_kept(task, key, exc)
            return True

    def _not_kept(self, task: Any, key: str, exc: Exception) -> None:
        logger.warning(
            "task %s[%s]: could not keep lock %s for its retry after a lost pool child: %s",
            task.name,
            self.task_id,
            key,
            exc,
            extra=log_fields(key, self.task_id, self.holder, outcome="error"),
        )


#: The lost run whose retry Celery's main process is sending (``retrying``), if any.
_lost: contextvars.ContextVar[LostRun | None] = contextvars.ContextVar("celery_redislock_lost", default=None)


@contextmanager
def retrying(run: LostRun) -> Iterator[None]:
    """While Celery sends the retry of ``run`` (``LockedRequest._retry_worker_lost``)."""
    reset = _lost.set(run)
    try:
        yield
    finally:
        _lost.reset(reset)


def lost_run(task_id: str | None, options: Mapping[str, Any]) -> LostRun | None:
    """The lost run that a message for ``task_id`` sent with ``options`` retries, if any (same
    task id, the next retry count), while Celery sends its retry."""
    run = _lost.get()
    if run is None or task_id != run.task_id or (options.get("retries") or 0) != run.retries + 1:
        return None
    return run
