"""bench/otel_bench.py's arithmetic: the per-round ratios of its runs, with runs too small for
the pool's CPU to be measured (``/proc`` counts it in clock ticks, 10 ms)."""

from __future__ import annotations

import importlib.util
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from celery_redislock import testing
from examples._support import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # it imports task_bench and lock_bench by name
_spec = importlib.util.spec_from_file_location("otel_bench", ROOT / "bench" / "otel_bench.py")
assert _spec is not None and _spec.loader is not None
otel_bench: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(otel_bench)


def test_a_pool_cpu_under_one_clock_tick_is_reported_as_not_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tasks 1``: the pool of a run used less CPU than ``/proc`` resolves, 0 ms; its ratios
    are not measured (not a ZeroDivisionError), the wall ratios are."""

    def run(way: str, tasks: int, *_: Any) -> dict[str, Any]:
        pool = 0.0 if way == "off" else 10.0  # one tick of 10 ms over 1 task, or none
        return {"wall_s": 0.5 if way == "off" else 0.6, "cpu_ms_per_task": {"worker pool": pool}}

    monkeypatch.setattr(otel_bench, "hook_cost_us", lambda: 1.0)
    monkeypatch.setattr(otel_bench, "hook_cost_elsewhere_us", lambda *_, **__: 2.0)
    monkeypatch.setattr(otel_bench, "metrics_in_runs_us", lambda url: 3.0)
    monkeypatch.setattr(otel_bench, "run", run)
    monkeypatch.setattr(testing, "RedisServer", lambda: nullcontext(type("Server", (), {"url": "redis://"})))
    out = tmp_path / "otel.json"
    assert otel_bench.main(["--tasks", "1", "--repeats", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["ratio_to_off"]["wall"]["metrics"] == pytest.approx(1.2)
    assert results["ratio_to_off"]["pool_cpu"]["metrics"] is None
    assert results["metrics_estimate_to_off"] is None
    assert results["ratio_to_base"]["pool_cpu"]["celery"] == pytest.approx(1.0)  # both measured
    printed = capsys.readouterr().out
    assert "under one clock tick" in printed and "--tasks" in printed
