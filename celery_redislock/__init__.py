"""celery-redislock: per-signature Redis locks for Celery tasks, with a watchdog.

Importing the package connects nothing and starts nothing.
"""

from __future__ import annotations

from .exceptions import (
    DuplicateTask,
    LockConfigurationError,
    LockKeyError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedisLockError,
)
from .lock import RedisLock

__all__ = [
    "DuplicateTask",
    "LockConfigurationError",
    "LockKeyError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "RedisLock",
    "RedisLockError",
    "__version__",
]

__version__ = "0.1.0"
