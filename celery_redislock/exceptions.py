"""The package's exceptions: one root, keyword fields, readable messages.

Every exception keeps its fields in ``args`` in constructor order, so that
``type(exc)(*exc.args)`` rebuilds it: Celery's result serialisation (JSON or
pickle) and ``pickle`` both rely on that.
"""

from __future__ import annotations

__all__ = [
    "DuplicateTask",
    "LockConfigurationError",
    "LockKeyError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "LockNotReplicated",
    "RedisLockError",
]


class RedisLockError(Exception):
    """Root of every error this package raises."""


class LockNotAcquired(RedisLockError):
    """The lock at ``key`` is held by ``holder`` for ``ttl`` more seconds."""

    def __init__(self, key: str, holder: str | None = None, ttl: float | None = None) -> None:
        super().__init__(key, holder, ttl)
        self.key = key
        self.holder = holder
        self.ttl = ttl

    def __str__(self) -> str:
        held = f" held by {self.holder!r}" if self.holder else ""
        left = f" for {self.ttl:.3f}s more" if self.ttl is not None else ""
        return f"lock {self.key!r} is busy{held}{left}"


class DuplicateTask(LockNotAcquired):
    """An identical task (``existing_task_id``) is already queued or running."""

    def __init__(
        self,
        key: str,
        existing_task_id: str | None = None,
        holder: str | None = None,
        ttl: float | None = None,
    ) -> None:
        RedisLockError.__init__(self, key, existing_task_id, holder, ttl)
        self.key = key
        self.existing_task_id = existing_task_id
        self.holder = holder
        self.ttl = ttl

    def __str__(self) -> str:
        return f"duplicate of task {self.existing_task_id!r} (lock {self.key!r})"


class LockNotReplicated(LockNotAcquired):
    """The lock at ``key`` was granted, but fewer than ``wanted`` replicas (``acknowledged``)
    confirmed it in time, so it was released again."""

    def __init__(self, key: str, acknowledged: int | None = None, wanted: int | None = None) -> None:
        RedisLockError.__init__(self, key, acknowledged, wanted)
        self.key = key
        self.acknowledged = acknowledged
        self.wanted = wanted
        self.holder = None
        self.ttl = None

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} was granted but only {self.acknowledged} of {self.wanted} replicas "
            "acknowledged it in time; released"
        )


class LockNotOwned(RedisLockError):
    """A release or extend of ``key`` by someone who does not hold it; Redis is unchanged."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} is not held by this owner (never acquired, released, expired or taken over)"
        )


class LockLost(RedisLockError):
    """The lock at ``key`` expired or was taken by another owner while it was held."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"lock {self.key!r} was lost while held (expired, deleted or taken by another owner)"


class LockConfigurationError(RedisLockError, ValueError):
    """A bad option, argument or setting; the message names it, its value and what is allowed."""


class LockKeyError(RedisLockError, ValueError):
    """The arguments of ``task`` cannot be turned into a lock key; ``argument`` names the culprit."""

    def __init__(self, task: str, argument: str, reason: str) -> None:
        super().__init__(task, argument, reason)
        self.task = task
        self.argument = argument
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot build the lock key of task {self.task!r}: argument {self.argument!r} {self.reason}"
