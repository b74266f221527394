"""A summary of an app's locks from Redis alone, for ``celery redislock stats``.

One walk of the keys under the prefix (``inventory.scan_keys``: SCAN, then
``inventory.read_values``: a read-only script per 500 keys) and the server clock
(``TIME``) give the figures below. Each lock is counted from its raw read (key,
TTL, fence, waiters, whether queued); only the locks listed are read in full
(``HeldLock``).

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
from typing import Any, NamedTuple

from .config import AppSettings, LockOptions
from .connection import Client
from .inventory import is_queued, parse_lock, permit_of, read_values, scan_keys, task_of
from .keys import leader_key, slot_markers
from .protocol import parse_value

__all__ = ["ORPHAN_AGE", "summary"]

#: Seconds after which an enqueue lock counts as an orphan.
ORPHAN_AGE = 3600.0
#: A renewed lock with less than this part of its lease left is expiring.
LATE_PART = 1 / 3
#: What ends a slot marker's key: the slot id, ``beat.Slot.id`` (ISO 8601, UTC, ``Z``).
_SLOT_ID = re.compile(r"(.*):(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z)", re.DOTALL)


class _Read(NamedTuple):
    """What the summary counts of a lock; ``value`` is read in full only for a lock listed."""

    key: str
    task: str | None
    #: an enqueue lock whose message waits (``inventory.is_queued``)
    queued: bool
    #: ms left (-1: no TTL)
    pttl: int
    fence: int
    waiters: int
    value: str

    @property
    def ttl(self) -> float | None:
        return None if self.pttl == -1 else self.pttl / 1000


def _read(client: Client, prefix: str) -> list[_Read]:
    """Every lock under ``prefix``, as counted (``_Read``), in no order. The permits of one
    semaphore, and a lock of its name, share its waiters: they are counted on the first read."""
    found, queues = [], set()
    for key, pttl, waiters, value in read_values(client, scan_keys(client, prefix)):
        lock = parse_value(value)
        if lock is not None and pttl != -2:
            permit = permit_of(key)
            queue = key if permit is None else permit[0]  # whose waiters these are
            waiters = 0 if queue in queues else waiters
            queues.add(queue)
            found.append(_Read(key, task_of(key, prefix), is_queued(lock), pttl, lock.fence, waiters, value))
    return found


class _Walk:
    """The locks read in one walk, by kind; rows built only for the locks shown."""

    def __init__(
        self, reads: list[_Read], now_us: int, settings: AppSettings, tasks: Mapping[str, LockOptions]
    ) -> None:
        self.now_us, self.settings, self.tasks = now_us, settings, tasks
        markers, self.leader_key = slot_markers(settings.prefix), leader_key(settings.prefix)
        self.markers: list[_Read] = []
        self.kinds: dict[str, list[_Read]] = {"execution": [], "enqueue": [], "leader": [], "other": []}
        for read in reads:
            if read.key.startswith(markers):
                self.markers.append(read)
            else:
                self.kinds[self.kind(read)].append(read)
        self.locks = [read for kind in self.kinds.values() for read in kind]
        self.leader = self.kinds["leader"][0] if self.kinds["leader"] else None

    def kind(self, read: _Read) -> str:
        """``execution``, ``enqueue`` (a task's), ``leader`` or ``other`` (a slot marker: not asked)."""
        if read.task is None:
            return "leader" if read.key == self.leader_key else "other"
        return "enqueue" if read.queued else "execution"

    def lease(self, read: _Read) -> float | None:
        """Seconds of the lease its watchdog renews, where known (see the module docstring)."""
        if read is self.leader:
            return self.settings.beat_leader_ttl
        options = self.tasks.get(read.task or "")
        if options is None or options.rules.settles or self.kind(read) != "execution":
            return None
        return options.ttl

    def age(self, read: _Read) -> float | None:
        """Seconds since the hold was granted, from its fence (``None``: a marker's fence 0)."""
        return max(self.now_us - read.fence, 0) / 1e6 if read.fence else None

    def expiring(self) -> list[_Read]:
        """The renewed locks with under ``LATE_PART`` of their lease left."""
        late = []
        for read in [*self.kinds["execution"], *self.kinds["leader"]]:
            lease = self.lease(read)
            if lease is not None and read.pttl != -1 and read.pttl < lease * LATE_PART * 1000:
                late.append(read)
        return late

    def orphans(self) -> list[_Read]:
        """The enqueue locks older than ``ORPHAN_AGE``."""
        granted_before = self.now_us - ORPHAN_AGE * 1e6
        return [read for read in self.kinds["enqueue"] if read.fence < granted_before]

    def row(self, read: _Read) -> dict[str, Any]:
        """The lock's row: ``list --json``'s fields, its kind, age and lease."""
        lock = parse_lock(read.key, read.pttl, read.waiters, read.value, self.settings.prefix)
        assert lock is not None  # a _Read is a lock value
        options = self.tasks.get(read.task or "")
        return {
            **lock.as_dict(None if options is None else options.mode),
            "kind": self.kind(read),
            "age": self.age(read),
            "lease": self.lease(read),
        }

    def section(self, reads: list[_Read], order: Callable[[_Read], Any], limit: int) -> dict[str, Any]:
        """``{"count": n, "locks": rows}``: the first ``limit`` (0: all) of ``reads`` by ``order``."""
        first = heapq.nsmallest(limit, reads, key=order) if limit else sorted(reads, key=order)
        return {"count": len(reads), "locks": [self.row(read) for read in first]}


def _tasks(walk: _Walk) -> list[dict[str, Any]]:
    """Held locks and waiters per task name, most locks first."""
    counts: dict[str, dict[str, int]] = {}
    for kind in ("execution", "enqueue"):
        for read in walk.kinds[kind]:
            task = counts.get(read.task or "")
            if task is None:
                task = counts[read.task or ""] = {"execution": 0, "enqueue": 0, "waiters": 0}
            task[kind] += 1
            task["waiters"] += read.waiters
    rows = []
    for name, task in counts.items():
        options = walk.tasks.get(name)
        rows.append({"task": name, "mode": None if options is None else options.mode, **task})
    return sorted(rows, key=lambda row: (-row["execution"] - row["enqueue"], row["task"]))


def _beat(walk: _Walk) -> dict[str, Any]:
    """The leader lock and the slot markers per entry (the latest slot, who claimed it)."""
    start = len(slot_markers(walk.settings.prefix))
    entries: dict[str, list[tuple[str, _Read]]] = {}
    for marker in walk.markers:
        named = _SLOT_ID.fullmatch(marker.key, start)
        entry, slot = named.groups() if named else (marker.key[start:], "")
        entries.setdefault(entry, []).append((slot, marker))
    rows = []
    for entry, slots in sorted(entries.items()):
        slot, latest = max(slots, key=lambda found: (found[0], found[1].key))
        claimed = parse_value(latest.value)
        rows.append(
            {
                "entry": entry,
                "markers": len(slots),
                "slot": slot or None,
                "holder": None if claimed is None else claimed.holder,
                "ttl": latest.ttl,
            }
        )
    leader = None if walk.leader is None else walk.row(walk.leader)
    return {"leader": leader, "markers": len(walk.markers), "entries": rows}


def _by_age(read: _Read) -> tuple[int, str]:
    """Oldest first: by the fence, the server time of the grant."""
    return read.fence, read.key


def summary(
    client: Client, settings: AppSettings, tasks: Mapping[str, LockOptions], limit: int = 10
) -> dict[str, Any]:
    """The summary of the locks under ``settings.prefix`` (see the module docstring), as the
    JSON object ``celery redislock stats --json`` prints; lists of locks hold their first
    ``limit`` (0: all), each with its ``count``. ``tasks``: the app's LockedTasks' options."""
    reads = _read(client, settings.prefix)
    seconds, micros = client.time()
    walk = _Walk(reads, int(seconds) * 1_000_000 + int(micros), settings, tasks)
    waited = [read for read in walk.locks if read.waiters]
    return {
        "prefix": settings.prefix,
        "time": walk.now_us / 1e6,
        "held": {
            **{kind: len(reads) for kind, reads in walk.kinds.items()},
            "waiters": sum(read.waiters for read in waited),
        },
        "tasks": _tasks(walk),
        "waited_for": walk.section(waited, lambda read: (-read.waiters, read.key), limit),
        "oldest": walk.section(walk.locks, _by_age, limit),
        "expiring": walk.section(
            walk.expiring(), lambda read: (read.pttl / 1000 / (walk.lease(read) or 1), read.key), limit
        ),
        "orphans": walk.section(walk.orphans(), _by_age, limit),
        "beat": _beat(walk),
    }
