"""The ``lock_*`` fields of a run's request, typed.

Inside a ``LockedTask``'s body, ``self.request`` carries ``lock_key``,
``lock_fence``, ``lock_lost`` and ``lock_slot`` (docs/tasks.md, "Inside a run").
Celery's ``Context`` does not declare them, so ``mypy --strict`` refuses
``self.request.lock_fence``; ``lock_fields(self.request)`` reads them into a typed
object instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LockFields", "lock_fields"]


@dataclass(frozen=True)
class LockFields:
    """A run's lock fields when read (``lock_fields``)."""

    #: the key of the run's lock (``None``: not a ``LockedTask``'s run)
    key: str | None
    #: the fencing token of the run's hold (``None``: the run holds no lock)
    fence: int | None
    #: whether the watchdog had found the lock gone or taken over
    lost: bool
    #: the beat slot the run is for (``None`` outside once-per-slot beat jobs)
    slot: str | None


def lock_fields(request: Any) -> LockFields:
    """The lock fields of ``request`` (``self.request`` in a bound task's body) as they are now:
    ``lost`` can turn ``True`` later, so read it again (or call ``self.check_lock()``) to see a
    loss. A request without them (a plain task's) gives ``None`` and ``False``."""
    return LockFields(
        key=getattr(request, "lock_key", None),
        fence=getattr(request, "lock_fence", None),
        lost=bool(getattr(request, "lock_lost", False)),
        slot=getattr(request, "lock_slot", None),
    )
