"""The package's own Celery signals.

Connect receivers as with any Celery signal (``@lock_lost.connect``).
Receivers are called as ``receiver(sender=..., **kwargs)``; an exception in
a receiver is logged by Celery and never reaches the lock or the task.

* ``lock_acquired(sender=task, key, task_id, fence)``: a task took its lock.
* ``lock_busy(sender=task, key, task_id, holder)``: a task found its lock held.
* ``lock_released(sender=task, key, task_id)``: a task's lock was released.
* ``lock_lost(sender=lock, key, reason)``: the watchdog found a held lock
  gone or owned by another token (``sender`` is the ``RedisLock``; ``reason``
  is ``"not owned"`` or ``"expired"``, the latter when renewals failed until
  the lease ran out).
* ``task_deduplicated(sender=task, key, existing_task_id)``: an enqueue was
  refused because an identical task is queued or running, or a worker
  dropped a message for a beat slot that another message has (``key`` is the
  slot's marker; ``existing_task_id`` is ``None`` while a beat's claim names
  no task yet).
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_busy", "lock_lost", "lock_released", "task_deduplicated"]

lock_acquired = Signal(name="lock_acquired")
lock_busy = Signal(name="lock_busy")
lock_released = Signal(name="lock_released")
lock_lost = Signal(name="lock_lost")
task_deduplicated = Signal(name="task_deduplicated")
