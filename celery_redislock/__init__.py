"""celery-redislock: per-signature Redis locks for Celery tasks, with a watchdog.

Importing the package connects nothing and starts nothing.
"""

from __future__ import annotations

from .aio import AsyncRedisLock
from .aio_semaphore import AsyncRedisSemaphore
from .exceptions import (
    DuplicateTask,
    LockConfigurationError,
    LockKeyError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    LockNotReplicated,
    RedisLockError,
)
from .lock import RedisLock
from .lock_fields import LockFields, lock_fields
from .receivers import install
from .redlock import Redlock
from .semaphore import RedisSemaphore
from .task import LockedTask, task_lock_key

__all__ = [
    "AsyncRedisLock",
    "AsyncRedisSemaphore",
    "DuplicateTask",
    "LockConfigurationError",
    "LockFields",
    "LockKeyError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "LockNotReplicated",
    "LockedTask",
    "RedisLock",
    "RedisLockError",
    "RedisSemaphore",
    "Redlock",
    "__version__",
    "install",
    "lock_fields",
    "task_lock_key",
]

__version__ = "0.1.0"
