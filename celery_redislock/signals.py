"""The package's own Celery signals.

Connect receivers as with any Celery signal (``@lock_lost.connect``).
Receivers are called as ``receiver(sender=..., **kwargs)`` (so a receiver written
before a keyword argument was added still works); an exception in
a receiver is logged by Celery and never reaches the lock or the task.

* ``lock_acquired(sender=task, key, task_id, fence, waited, mode)``: a task took its lock,
  ``waited`` seconds after its first attempt; ``mode`` is its ``lock_mode``.
* ``lock_busy(sender=task, key, task_id, holder, outcome)``: a task found its lock held;
  ``outcome`` is what it goes on to do: ``"busy-skip"``, ``"busy-retry"``, ``"busy-wait"``,
  ``"busy-raise"``, ``"busy-reject"`` or ``"superseded"`` (``celery_redislock.telemetry.OUTCOMES``).
* ``lock_released(sender=task, key, task_id, held, fence)``: a task's lock was released,
  ``held`` seconds after it was taken; ``fence`` is the hold's.
* ``lock_lost(sender=lock, key, reason)``: the watchdog found a held lock
  gone or owned by another token (``sender`` is the ``RedisLock``; ``key`` its name, a
  semaphore's too, not its permit's: the key ``lock_acquired`` names; ``reason``
  is ``"not owned"`` or ``"expired"``, the latter when renewals failed until
  the lease ran out).
* ``task_deduplicated(sender=task, key, existing_task_id)``: an enqueue was
  refused because an identical task is queued or running, or a worker
  dropped a message for a beat slot that another message has (``key`` is the
  slot's marker; ``existing_task_id`` is ``None`` while a beat's claim names
  no task yet), or a worker dropped a message superseded by a later call
  (``lock_duplicate="replace"``): then ``existing_task_id`` is that call's task
  and the extra keyword ``superseded_task_id`` names the message dropped.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_busy", "lock_lost", "lock_released", "task_deduplicated"]

lock_acquired = Signal(name="lock_acquired")
lock_busy = Signal(name="lock_busy")
lock_released = Signal(name="lock_released")
lock_lost = Signal(name="lock_lost")
task_deduplicated = Signal(name="task_deduplicated")
