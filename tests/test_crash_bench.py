"""bench/crash_bench.py: the time from a pool child's kill to the duplicate running is told in its
parts, Celery's notice of the death (its worker's main process reports the run lost, at once or at
its pool's 5 s check) apart from the lock's release, which follows it."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from celery_redislock.testing import RedisServer
from examples._support import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # it imports lock_bench and task_bench by name
_spec = importlib.util.spec_from_file_location("crash_bench", ROOT / "bench" / "crash_bench.py")
assert _spec is not None and _spec.loader is not None
crash_bench: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_bench)


def test_a_child_kill_times_celerys_notice_apart_from_the_locks_release() -> None:
    with RedisServer() as broker, RedisServer() as locks:
        row = crash_bench.run_once("LockedTask", "child", broker, locks, cap=20, every=0.5)
    assert row["noticed_s"] is not None  # Celery's worker main process reported the run lost
    assert row["noticed_s"] <= row["lock_freed_s"] <= row["noticed_s"] + 1  # released once noticed
    assert row["recovered_s"] is not None and row["recovered_s"] >= row["noticed_s"]


def test_the_parts_of_a_slow_notice_are_celerys_and_the_release() -> None:
    """A kill Celery noticed at its pool's 5 s check: the 5 s are Celery's, the release 0.02 s."""
    row = {
        "kill": "child",
        "noticed_s": 5.01,
        "lock_freed_s": 5.03,
        "recovered_s": 5.3,
        "cap_s": 20.0,
        "lock_ttls_left_ms": {},
    }
    assert crash_bench.parts(row) == ["5.01 s", "0.02 s", "5.03 s", "5.3 s"]
    gone = {**row, "kill": "worker", "noticed_s": None, "lock_freed_s": 30.0, "recovered_s": 30.2}
    assert crash_bench.parts(gone) == ["-", "-", "30.00 s", "30.2 s"]  # nobody noticed: the lease ran out
    kept = {**row, "lock_freed_s": None, "recovered_s": None, "lock_ttls_left_ms": {"k": -1}}
    assert crash_bench.parts(kept) == ["5.01 s", "-", "> 20 s", "> 20 s (lock: no expiry)"]
