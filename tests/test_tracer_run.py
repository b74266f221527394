"""bench/tracer_run.py's arithmetic: ``strace -c``'s table read by system call, and system calls
per task as the difference of two runs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from typing import Any

import pytest

from examples._support import ROOT

_spec = importlib.util.spec_from_file_location("tracer_run", ROOT / "bench" / "tracer_run.py")
assert _spec is not None and _spec.loader is not None
tracer_run: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tracer_run)

SUMMARY = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 26.12    0.044020           3     14000           getpid
 11.70    0.019712           3      6000      2000 recvfrom
  2.21    0.003716           3      1000           getrandom
------ ----------- ----------- --------- --------- ----------------
100.00    0.168504           3     21000      2000 total
"""


def test_the_table_is_read_by_system_call_without_its_total() -> None:
    assert tracer_run.syscalls(SUMMARY) == {"getpid": 14000, "recvfrom": 6000, "getrandom": 1000}


def test_per_task_is_the_difference_of_two_runs_most_first_and_small_ones_left_out() -> None:
    small = {"getpid": 400, "poll": 100, "futex": 7}
    large = {"getpid": 4400, "poll": 2100, "futex": 9, "sendto": 4000}
    assert tracer_run.per_task(small, large, 1000) == {"getpid": 4.0, "sendto": 4.0, "poll": 2.0}


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_real_count_sees_the_lock_round_trips() -> None:
    """Two small runs under strace: a ``LockedTask`` sends two commands per task to the lock server
    (its acquire and its release), beyond what a plain task sends."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "tracer_run.py"),
        "--syscalls",
        "--base",
        "20",
        "--tasks",
        "200",
    ]
    lines = subprocess.run(
        [*command, "plain", "LockedTask"], check=True, capture_output=True, text=True, timeout=300
    ).stdout.splitlines()
    sends = [float(line.split("sendto ")[1].split(",")[0].rstrip(")")) for line in lines]
    assert [line.split(":")[0] for line in lines] == ["plain", "LockedTask"]
    assert sends[1] - sends[0] == pytest.approx(2.0, abs=0.1)
