"""bench/instructions_bench.py's arithmetic: a callgrind output's total, per-task figures as the
difference of two runs, lock instructions as pool + producer + lock server less plain's, and the
lock server's count per run."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from examples._support import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # it imports task_bench and lock_bench by name
_spec = importlib.util.spec_from_file_location("instructions_bench", ROOT / "bench" / "instructions_bench.py")
assert _spec is not None and _spec.loader is not None
instructions_bench: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(instructions_bench)


@pytest.mark.parametrize("line", ["summary: 1234567", "totals: 1234567"])
def test_the_total_is_read_from_either_form_of_callgrind_output(tmp_path: Path, line: str) -> None:
    out = tmp_path / "1.out"
    out.write_text(f"version: 1\ncmd: python\nevents: Ir\nfn=(1) main\n16 1200000\n{line}\n")
    assert instructions_bench.callgrind_total(out) == 1234567


def test_an_output_without_a_total_is_an_error_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "2.out"
    out.write_text("")  # a process killed before it wrote its count
    with pytest.raises(RuntimeError, match=r"2\.out"):
        instructions_bench.callgrind_total(out)


def test_per_task_figures_are_the_difference_of_two_runs_and_locks_exclude_the_main_process() -> None:
    def runs(pool: float, main: float, producer: float, server: float) -> dict[str, dict[str, float]]:
        small = {"worker pool": 10e6, "worker main": 50e6, "producer": 20e6, "lock server": 1e6}
        large = {
            "worker pool": 10e6 + 300 * pool,
            "worker main": 50e6 + 300 * main,
            "producer": 20e6 + 300 * producer,
            "lock server": 1e6 + 300 * server,
        }
        return {"small": small, "large": large}

    rows = {}
    for variant, figures in {
        "plain": (1.2e6, 3.4e6, 2.5e6, 0),
        "LockedTask": (1.75e6, 3.5e6, 2.55e6, 0.09e6),
        "celery-singleton": (1.5e6, 3.4e6, 2.9e6, 0.01e6),
        "celery-once": (1.55e6, 3.3e6, 2.8e6, 0.02e6),
    }.items():
        both = runs(*figures)
        rows[variant] = instructions_bench.per_task(both["small"], both["large"], 300)
    assert rows["LockedTask"]["worker pool"] == pytest.approx(1.75e6)
    assert rows["LockedTask"]["producer"] == pytest.approx(2.55e6)
    summary = instructions_bench.summarize(rows)
    # pool + producer + lock server less plain's; the main process (its event loop follows the
    # run's length) apart
    assert summary["LockedTask"]["lock instructions"] == pytest.approx(0.55e6 + 0.05e6 + 0.09e6)
    assert summary["celery-singleton"]["lock instructions"] == pytest.approx(0.3e6 + 0.4e6 + 0.01e6)
    assert summary["plain"]["lock instructions"] == 0
    found = {check.name: check for check in instructions_bench.checks(summary)}
    ratio = found["LockedTask lock instructions / best peer's"]
    assert ratio.value == pytest.approx(0.69e6 / 0.67e6) and ratio.verdict == "FAIL"  # once's 0.67e6 is best
    assert found["celery-once lock instructions/task"].verdict == "INFO"


#: The lock server's counts need valgrind's callgrind and its control program.
needs_valgrind = pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
    reason="needs valgrind and callgrind_control (apt-get install valgrind)",
)


@needs_valgrind
def test_a_counted_server_counts_each_block_on_its_own(tmp_path: Path) -> None:
    """The lock server under callgrind counts what it processes in each ``server_count`` block
    only: its counts are zeroed as a block begins (here: after 300 commands outside any block)
    and dumped as it ends, so a block of 200 commands counts twice one of 100."""
    out = tmp_path / "lock-server.out"
    with instructions_bench.counted_server(out) as server, server.client() as client:
        instructions_bench.check_counted(server, out)  # both functions run in this redis-server
        for i in range(300):
            client.set(f"k{i}", "v")
        with instructions_bench.server_count(server, out) as hundred:
            for i in range(100):
                client.set(f"k{i}", "v")
        with instructions_bench.server_count(server, out) as two_hundred:
            for i in range(200):
                client.set(f"k{i}", "v")
    assert hundred["lock server"] > 0
    assert 1.8 < two_hundred["lock server"] / hundred["lock server"] < 2.2


@needs_valgrind
def test_a_server_function_that_does_not_run_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function of ``SERVER_FUNCTIONS`` that does not run in the redis-server (not exported,
    renamed) is an error naming it, not a count that quietly leaves its work out."""
    out = tmp_path / "lock-server.out"
    monkeypatch.setattr(instructions_bench, "SERVER_FUNCTIONS", ("readQueryFromClient", "noSuchFunction"))
    with (
        instructions_bench.counted_server(out) as server,
        pytest.raises(RuntimeError, match="noSuchFunction did not run"),
    ):
        instructions_bench.check_counted(server, out)


@needs_valgrind
def test_the_scripts_of_a_tasks_path_are_counted_per_call_and_leave_no_key(tmp_path: Path) -> None:
    """``script_counts``: the lock server's instructions per call of each script, each call's reply
    checked (a failing script counts instructions too), and nothing left in Redis."""
    out = tmp_path / "lock-server.out"
    with instructions_bench.counted_server(out) as server, server.client() as client:
        counts = instructions_bench.script_counts(server, out, calls=50)
        assert client.dbsize() == 0
    assert set(counts) == {
        "ACQUIRE (a free lock)",
        "RELEASE (no waiters)",
        "RENEW",
        "ADOPT",
        "SET NX PX (for scale)",
    }
    # a script's call runs the Lua interpreter besides its commands: costlier than one plain SET
    assert all(counts[step] > counts["SET NX PX (for scale)"] > 0 for step in counts if "SET" not in step)


@needs_valgrind
def test_a_script_that_fails_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_redislock import _scripts

    out = tmp_path / "lock-server.out"
    monkeypatch.setattr(_scripts, "RENEW", _scripts.Script("return {1}"))  # reports the lock lost
    with (
        instructions_bench.counted_server(out) as server,
        pytest.raises(RuntimeError, match=r"RENEW: 50 unexpected replies, e\.g\. \[1\]"),
    ):
        instructions_bench.script_counts(server, out, calls=50)
