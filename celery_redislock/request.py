"""The worker main process's side of ``LockedTask``: freeing the lock of a pool child that died.

When a prefork child dies mid-task (SIGKILL, OOM, a hard time limit,
``revoke(terminate=True)``), nothing in it can release its lock; the main
process learns of the death through the task's ``Request`` and releases the
lock at once, so the next duplicate does not wait for the lease to expire.
The release is owner-checked against the holder the child wrote (task id,
node name and child pid), so a lock taken over meanwhile is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request

from .config import EXECUTION_MODES
from .connection import client_for
from .task import holder_for, release_held_by, task_lock_key

__all__ = ["LockedRequest"]

logger = logging.getLogger(__name__)

#: What the pool reports when the child running a task is gone.
CHILD_GONE = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)


class LockedRequest(Request):
    """``Request`` of a ``LockedTask``: releases the lock of a dead child's task."""

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
        if not soft:  # the pool has killed the child
            self._release_orphaned_lock("hard time limit")

    def _release_orphaned_lock(self, why: str) -> None:
        task = self.task
        options = getattr(task, "_lock_options", None)
        if options is None or options.mode not in EXECUTION_MODES or self.worker_pid is None:
            return
        try:
            key = task_lock_key(task, self.args, self.kwargs)
            client, _ = client_for(task.app)
            retries = self.request_dict.get("retries") or 0
            holder = holder_for(self.id, retries, self.hostname, int(self.worker_pid))
            released = release_held_by(client, key, holder)
        except Exception:  # the main process's event loop must go on
            logger.exception("task %s[%s]: could not release its dead pool child's lock", self.name, self.id)
            return
        if released:
            logger.warning(
                "task %s[%s]: pool child %s gone (%s); released its lock %s",
                self.name,
                self.id,
                self.worker_pid,
                why,
                key,
            )
