"""A run that found its execution lock held: what the ``lock_busy`` policies (``busy``) and a
copy watching its first delivery's hold (``redelivery``) know of it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from . import telemetry
from .config import LockOptions
from .run_lock import ExecutionLock, acquired

__all__ = ["Found"]


@dataclass(frozen=True)
class Found:
    """A run that found ``lock`` held by ``holder`` (``ttl`` seconds left, if known)."""

    task: Any
    options: LockOptions
    lock: ExecutionLock
    #: the worker's (or apply()'s) request; ``None`` for a direct call
    request: Any
    args: Any
    kwargs: Any
    holder: str | None
    ttl: float | None
    #: monotonic time of the run's first acquire attempt
    started: float
    #: monotonic times before ``holder`` and ``ttl`` were asked for, and after they were read:
    #: the hold's lease ends ``ttl`` s after a time between the two, unless renewed (stalls
    #: between the script's run and the reply's reading widen the span, never move the end out)
    asked: float
    seen: float
    #: monotonic end of the run's wait, once one began (``busy``'s earlier-run wait): a wait for
    #: the hold it meets next ends by it too (``lock_wait_timeout`` is the longest wait); ``None``:
    #: ``lock_wait_timeout`` from the wait's start
    deadline: float | None = None

    def wait_ends(self) -> float:
        """The monotonic end of a wait beginning now: ``deadline``, else ``lock_wait_timeout`` on."""
        return time.monotonic() + self.options.wait_timeout if self.deadline is None else self.deadline

    @property
    def task_id(self) -> str | None:
        return None if self.request is None else self.request.id

    def took(self) -> bool:
        """The run holds ``lock`` now."""
        return acquired(self.task, self.lock, self.task_id, self.started)

    def log_fields(self, outcome: str) -> dict[str, Any]:
        """The ``extra=`` of a log line about this run and ``outcome``."""
        return telemetry.log_fields(self.lock.name, self.task_id, self.holder, outcome=outcome)
