"""A summary of an app's locks from Redis alone, for ``celery redislock stats``.

One walk of the keys under the prefix (``inventory.held_locks``: SCAN, then a
read-only script per 500 keys) and the server clock (``TIME``) give:

* **held locks per task**: *execution* locks (held by a run, or kept through
  an ``until_expired`` period after it) and *enqueue* locks (holder
  ``state=queued``: a message waits for its run; the ``…:queued`` key of
  ``until_and_while_executing``, the enqueue lock of the other ``until_*``
  modes, or a hold parked for a retry); the beat leader and plain
  ``RedisLock`` names under the prefix are counted apart;
* **waiters**: blocking acquires queued for each lock;
* **the oldest holds**. A lock's value records no acquisition time, but its
  fence is the Redis server clock in microseconds when the hold was granted
  (taken, adopted by its run, or handed over to a waiter), so its *age* is
  the server time now less its fence. A hold parked for a retry keeps its
  fence: its age counts from the grant of the run that parked it. The TTL
  left says nothing of age: a renewed lease is back to full every third of it;
* **expiring**: renewed locks whose TTL left is under a third of their lease.
  The watchdog renews every third of the lease, so a lock it keeps up with
  has between two thirds and all of it left: under a third, two renewals are
  late. The lease is known for the app's own tasks (``lock_ttl``; not in a
  mode that settles, whose period is not renewed) and for the beat leader
  (``redislock_beat_leader_ttl``); other locks are not judged;
* **orphans**: enqueue locks older than an hour, a message waiting that long
  or one lost with its lock left behind (it expires with ``lock_queue_ttl``);
* **beat**: the leader lock, and the slot markers per schedule entry.

A lock taken or freed during the walk may be missed or counted. In a Redis
Cluster, ages are measured against the clock of the node that answers
``TIME``.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Mapping
from typing import Any

from .config import AppSettings, LockOptions
from .connection import Client
from .inventory import HeldLock, held_locks
from .keys import leader_key, slot_markers

__all__ = ["ORPHAN_AGE", "summary"]

#: Seconds after which an enqueue lock counts as an orphan.
ORPHAN_AGE = 3600.0
#: A renewed lock with less than this part of its lease left is expiring.
LATE_PART = 1 / 3
#: What ends a slot marker's key: the slot id, ``beat.Slot.id`` (ISO 8601, UTC, ``Z``).
_SLOT_ID = re.compile(r"(.*):(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)", re.DOTALL)


class _Walk:
    """The locks read in one walk, sorted by kind; rows built only for the locks shown."""

    def __init__(
        self, locks: list[HeldLock], now_us: int, settings: AppSettings, tasks: Mapping[str, LockOptions]
    ) -> None:
        self.now_us, self.settings, self.tasks = now_us, settings, tasks
        markers, leader = slot_markers(settings.prefix), leader_key(settings.prefix)
        self.markers: list[HeldLock] = []
        self.kinds: dict[str, list[HeldLock]] = {"execution": [], "enqueue": [], "leader": [], "other": []}
        for lock in locks:
            if lock.key.startswith(markers):
                self.markers.append(lock)
            elif lock.task is not None:
                self.kinds["enqueue" if lock.state == "queued" else "execution"].append(lock)
            else:
                self.kinds["leader" if lock.key == leader else "other"].append(lock)
        self.locks = [lock for kind in self.kinds.values() for lock in kind]
        self.leader = self.kinds["leader"][0] if self.kinds["leader"] else None

    def kind(self, lock: HeldLock) -> str:
        if lock.task is None:
            return "leader" if lock is self.leader else "other"
        return "enqueue" if lock.state == "queued" else "execution"

    def lease(self, lock: HeldLock) -> float | None:
        """Seconds of the lease its watchdog renews, where known (see the module docstring)."""
        if lock is self.leader:
            return self.settings.beat_leader_ttl
        options = self.tasks.get(lock.task or "")
        if options is None or options.rules.settles or self.kind(lock) != "execution":
            return None
        return options.ttl

    def age(self, lock: HeldLock) -> float | None:
        """Seconds since the hold was granted, from its fence (``None``: a marker's fence 0)."""
        return max(self.now_us - lock.fence, 0) / 1e6 if lock.fence else None

    def expiring(self) -> list[HeldLock]:
        """The renewed locks with under ``LATE_PART`` of their lease left."""
        renewed = [*self.kinds["execution"], *self.kinds["leader"]]
        late = []
        for lock in renewed:
            lease = self.lease(lock)
            if lease is not None and lock.ttl is not None and lock.ttl < lease * LATE_PART:
                late.append(lock)
        return late

    def orphans(self) -> list[HeldLock]:
        """The enqueue locks older than ``ORPHAN_AGE``."""
        granted_before = self.now_us - ORPHAN_AGE * 1e6
        return [lock for lock in self.kinds["enqueue"] if lock.fence < granted_before]

    def row(self, lock: HeldLock) -> dict[str, Any]:
        options = self.tasks.get(lock.task or "")
        mode = None if options is None else options.mode
        return {
            **lock.as_dict(mode),
            "kind": self.kind(lock),
            "age": self.age(lock),
            "lease": self.lease(lock),
        }

    def section(self, locks: list[HeldLock], order: Callable[[HeldLock], Any], limit: int) -> dict[str, Any]:
        """``{"count": n, "locks": rows}``: the first ``limit`` (0: all) of ``locks`` by ``order``."""
        first = heapq.nsmallest(limit, locks, key=order) if limit else sorted(locks, key=order)
        return {"count": len(locks), "locks": [self.row(lock) for lock in first]}


def _tasks(walk: _Walk) -> list[dict[str, Any]]:
    """Held locks and waiters per task name, most locks first."""
    counts: dict[str, dict[str, int]] = {}
    for kind in ("execution", "enqueue"):
        for lock in walk.kinds[kind]:
            task = counts.get(lock.task or "")
            if task is None:
                task = counts[lock.task or ""] = {"execution": 0, "enqueue": 0, "waiters": 0}
            task[kind] += 1
            task["waiters"] += lock.waiters
    rows = []
    for name, task in counts.items():
        options = walk.tasks.get(name)
        rows.append({"task": name, "mode": None if options is None else options.mode, **task})
    return sorted(rows, key=lambda row: (-row["execution"] - row["enqueue"], row["task"]))


def _beat(walk: _Walk) -> dict[str, Any]:
    """The leader lock and the slot markers per entry (the latest slot, who claimed it)."""
    start = len(slot_markers(walk.settings.prefix))
    entries: dict[str, list[tuple[str, HeldLock]]] = {}
    for marker in walk.markers:
        named = _SLOT_ID.fullmatch(marker.key, start)
        entry, slot = named.groups() if named else (marker.key[start:], "")
        entries.setdefault(entry, []).append((slot, marker))
    rows = []
    for entry, slots in sorted(entries.items()):
        slot, latest = max(slots, key=lambda found: found[0])
        rows.append(
            {
                "entry": entry,
                "markers": len(slots),
                "slot": slot or None,
                "holder": latest.holder,
                "ttl": latest.ttl,
            }
        )
    leader = None if walk.leader is None else walk.row(walk.leader)
    return {"leader": leader, "markers": len(walk.markers), "entries": rows}


def _by_age(lock: HeldLock) -> tuple[int, str]:
    """Oldest first: by the fence, the server time of the grant."""
    return lock.fence, lock.key


def summary(
    client: Client, settings: AppSettings, tasks: Mapping[str, LockOptions], limit: int = 10
) -> dict[str, Any]:
    """The summary of the locks under ``settings.prefix`` (see the module docstring), as the
    JSON object ``celery redislock stats --json`` prints; lists of locks hold their first
    ``limit`` (0: all), each with its ``count``. ``tasks``: the app's LockedTasks' options."""
    locks = held_locks(client, settings.prefix)
    seconds, micros = client.time()
    walk = _Walk(locks, int(seconds) * 1_000_000 + int(micros), settings, tasks)
    waited = [lock for lock in walk.locks if lock.waiters]
    return {
        "prefix": settings.prefix,
        "time": walk.now_us / 1e6,
        "held": {
            **{kind: len(locks) for kind, locks in walk.kinds.items()},
            "waiters": sum(lock.waiters for lock in waited),
        },
        "tasks": _tasks(walk),
        "waited_for": walk.section(waited, lambda lock: (-lock.waiters, lock.key), limit),
        "oldest": walk.section(walk.locks, _by_age, limit),
        "expiring": walk.section(
            walk.expiring(), lambda lock: (lock.ttl or 0) / (walk.lease(lock) or 1), limit
        ),
        "orphans": walk.section(walk.orphans(), _by_age, limit),
        "beat": _beat(walk),
    }
