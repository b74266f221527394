"""The suite's invariant checker, run after every test and, in the fault tests, while they run.

* No key of a test (``{prefix}...`` and the lock companions ``{{prefix}...}...``)
  is ever without a TTL: locks, their queues and wake lists, and the tests' own
  bookkeeping (events, gates) alike.
* Once a test's tasks have finished, none of its locks is left in Redis: no
  lock value and no lock companion (waiter queue, deadlines, wake list) under
  its prefix. A test whose design leaves one (a queued message never consumed,
  an ``until_expired`` period) says so with ``@pytest.mark.locks_may_remain(reason)``.
  Beat slot markers (``{prefix}:slot:...``) are not locks: they outlive their
  slot on purpose, so that a late duplicate of it is still recognised.

A lock is recognised by its value, not its name: ``<32 hex token>:<fence>:<holder>``.
"""

from __future__ import annotations

import re
import threading
import time
from types import TracebackType

import redis

from celery_redislock.keys import slot_markers

__all__ = ["Sampler", "check", "keys_of", "keys_without_ttl", "leftover_locks", "stored"]

#: A lock value (``protocol.parse_value``), a watched hold's too (the watching copy's token second).
LOCK_VALUE = re.compile(rb"^[0-9a-f]{32}(?:[0-9a-f]{32})?:\d+:")
COMPANIONS = (b"}:queue", b"}:waiters", b"}:wake:")


def keys_of(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key of the test: ``prefix...`` and companions ``{prefix...}...``."""
    found = {
        *client.scan_iter(match=f"{prefix}*", count=1000),
        *client.scan_iter(match=f"{{{prefix}*", count=1000),
    }
    return sorted(found)


def stored(client: redis.Redis | redis.cluster.RedisCluster, key: str) -> bytes:
    """The value at ``key``, which must be there (the suite's clients do not decode replies)."""
    value = client.get(key)
    assert isinstance(value, bytes), f"{key} holds {value!r}"
    return value


def keys_without_ttl(client: redis.Redis, prefix: str) -> list[bytes]:
    return [key for key in keys_of(client, prefix) if client.pttl(key) == -1]


def leftover_locks(client: redis.Redis, prefix: str) -> list[str]:
    """Locks and lock companions of the test still in Redis, described (key, TTL, value)."""
    left = []
    for key in keys_of(client, prefix):
        if key.startswith(slot_markers(prefix).encode()):
            continue
        if any(marker in key for marker in COMPANIONS):
            left.append(f"{key!r} (lock companion, ttl {client.pttl(key)} ms)")
            continue
        if client.type(key) != b"string":
            continue
        value = client.get(key)
        if isinstance(value, bytes) and LOCK_VALUE.match(value):
            left.append(f"{key!r} = {value!r} (ttl {client.pttl(key)} ms)")
    return left


def check(client: redis.Redis, prefix: str, *, locks_may_remain: bool = False) -> None:
    """Assert the invariants on ``client``'s server for the keys of ``prefix``."""
    problems = [f"{key!r} has no TTL" for key in keys_without_ttl(client, prefix)]
    if not locks_may_remain:
        problems += [f"left in Redis after the test: {lock}" for lock in leftover_locks(client, prefix)]
    assert not problems, "invariants broken:\n" + "\n".join(problems)


class Sampler:
    """Checks "no key without a TTL" every ``every`` seconds on a thread while a fault test runs.

    ``stop()`` ends the sampling and raises ``AssertionError`` listing what was
    seen, so a key left without a TTL for a moment (between two commands that
    should have been one script) fails the test even if it had one at the end.
    """

    def __init__(self, client: redis.Redis, prefix: str, every: float = 0.05) -> None:
        self.client, self.prefix, self.every = client, prefix, every
        self.samples = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariant-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                missing = keys_without_ttl(self.client, self.prefix)
            except redis.RedisError:  # the server is down or restarting (a fault under test)
                continue
            self.samples += 1
            self.violations += [f"{key!r} had no TTL at {time.monotonic():.3f}" for key in missing]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self.violations, "invariants broken while the test ran:\n" + "\n".join(self.violations)

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
