"""bench/chart.py: the benchmark PNG is drawn from the results JSON, whatever it holds, and the
committed PNG is the one the committed JSON makes."""

from __future__ import annotations

import copy
import importlib.util
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from examples._support import ROOT

_spec = importlib.util.spec_from_file_location("bench_chart", ROOT / "bench" / "chart.py")
assert _spec is not None and _spec.loader is not None
chart: Any = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chart  # its dataclasses look their module up
_spec.loader.exec_module(chart)

LOCK: dict[str, Any] = json.loads(chart.LOCK_JSON.read_text())
TASKS: dict[str, Any] = json.loads(chart.TASK_JSON.read_text())


def png_info(path: Path) -> tuple[int, int, dict[str, str]]:
    """(width, height, text chunks) of a PNG, read chunk by chunk (CRCs checked)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    offset, size, texts = 8, (0, 0), {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        offset += 12 + length
    return size[0], size[1], texts


def by_title(panels: list[Any], part: str) -> Any:
    (panel,) = [panel for panel in panels if part in panel.title]
    return panel


def values(panel: Any) -> dict[str, float]:
    return {bar.label: bar.value for bar in panel.bars}


def test_the_committed_png_is_drawn_from_the_committed_results() -> None:
    width, height, texts = png_info(chart.OUT)
    assert (width, height) == (1920, 840)
    assert texts.get("Source") == chart.source(chart.LOCK_JSON, chart.TASK_JSON), (
        "bench/results/benchmarks.png is older than the results JSON: run `make chart` and commit the PNG"
    )
    readme = (ROOT / "README.md").read_text()
    assert "bench/results/benchmarks.png" in readme and "make chart" in readme


def test_the_panels_hold_the_ratios_of_the_results() -> None:
    panels = chart.panels(LOCK, TASKS)
    assert len(panels) == 8
    uncontended = values(by_title(panels, "Lock, uncontended"))
    for name, row in LOCK["results"]["uncontended"].items():
        if name != "bare":
            assert uncontended[name.replace("watchdog=False", "no watchdog")] == row["ratio_to_bare"]
    contention = values(by_title(panels, "critical sections/s"))
    rows = LOCK["results"]["contention"]
    peers = {name: row["critical_sections_per_s"] for name, row in rows.items() if not chart.ours(name)}
    assert max(contention[name] for name in peers) == 1.0  # the best peer is the baseline
    assert contention["RedisLock fair=True"] == pytest.approx(
        rows["RedisLock fair=True"]["critical_sections_per_s"] / max(peers.values())
    )
    fairness = values(by_title(panels, "fairness"))
    assert fairness == {name: row["min_max_ratio"] for name, row in rows.items()}
    assert chart.paired(TASKS)  # the committed results are in the format bench/task_bench.py writes now
    wall = values(by_title(panels, "Celery, 2,000 tasks"))
    assert wall == {name: row["paired_ratio_to_plain"] for name, row in TASKS["summary"].items()}
    cpu = values(by_title(panels, "Celery: lock CPU per task"))
    assert cpu["LockedTask"] == TASKS["summary"]["LockedTask"]["lock_cpu_us_per_task"]


def test_the_until_executed_variant_and_refused_duplicates_are_charted(tmp_path: Path) -> None:
    """The format bench/task_bench.py writes now: an ``until_executed`` variant, and a
    ``refused_duplicates`` section per de-duplicating variant."""
    tasks = copy.deepcopy(TASKS)
    tasks["summary"]["until_executed"] = {
        **tasks["summary"]["LockedTask"],
        "wall_ratio_to_plain": 1.07,
        "paired_ratio_to_plain": 1.07,
    }
    tasks["refused_duplicates"] = {
        "until_executed": {"round_trips": 1.0, "producer_cpu_us": 180.0, "wall_us": 260.0},
        "celery-once": {"round_trips": 1.0, "producer_cpu_us": 240.0, "wall_us": 330.0},
        "celery-singleton": {"round_trips": 2.0, "producer_cpu_us": 410.0, "wall_us": 520.0},
    }
    path = tmp_path / "task_bench.json"
    path.write_text(json.dumps(tasks))
    out = tmp_path / "chart.png"
    assert chart.main(["--tasks", str(path), "--out", str(out)]) == 0
    panels = chart.panels(LOCK, tasks)
    assert values(by_title(panels, "Celery, 2,000 tasks"))["until_executed"] == 1.07
    refused = by_title(panels, "A refused duplicate enqueue")
    assert values(refused) == {"until_executed": 180.0, "celery-once": 240.0, "celery-singleton": 410.0}
    assert not refused.missing and "2.00 RT" in refused.bars[2].note
    width, _, texts = png_info(out)
    assert width == 1920
    assert texts["Source"] == chart.source(chart.LOCK_JSON, path)


def test_what_a_run_left_out_leaves_its_panel_empty_and_the_chart_is_still_drawn(tmp_path: Path) -> None:
    lock = {**LOCK, "results": {"uncontended": LOCK["results"]["uncontended"]}}  # --only uncontended
    path = tmp_path / "lock_bench.json"
    path.write_text(json.dumps(lock))
    out = tmp_path / "chart.png"
    assert chart.main(["--lock", str(path), "--tasks", str(tmp_path / "none.json"), "--out", str(out)]) == 0
    panels = chart.panels(lock, {})
    assert [bool(panel.bars) for panel in panels] == [True, False, False, False, False, False, False, False]
    assert "no contention results" in panels[1].missing
    assert "no redlock or cluster results" in panels[3].missing
    assert "no refused_duplicates" in panels[6].missing
    assert "make chart" in panels[7].missing  # the notes panel
    assert png_info(out)[2]["Source"] == chart.source(path)
    with pytest.raises(SystemExit):  # neither file: nothing to chart
        chart.main(["--lock", str(tmp_path / "a"), "--tasks", str(tmp_path / "b"), "--out", str(out)])


def test_redlock_and_cluster_results_are_charted_against_their_baselines() -> None:
    """The scenarios ``lock_bench.py --only redlock --only cluster`` adds to lock_bench.json."""
    lock = copy.deepcopy(LOCK)
    lock["results"]["redlock"] = {
        "RedisLock over 3": {"pairs_per_s": 1279.0, "round_trips_per_pair": 6.0},
        "pottery Redlock over 3": {"pairs_per_s": 282.0, "round_trips_per_pair": 6.0},
    }
    lock["results"]["cluster"] = {
        "RedisLock, one server": {"pairs_per_s": 3479.0},
        "RedisLock, Cluster": {"pairs_per_s": 3429.0},
    }
    beyond = by_title(chart.panels(lock, TASKS), "Beyond one Redis")
    assert [(bar.label, bar.mine) for bar in beyond.bars] == [
        ("pottery\nover 3", False),
        ("Redlock\nover 3", True),
        ("one\nserver", False),
        ("3-primary\nCluster", True),
    ]
    assert [bar.value for bar in beyond.bars] == pytest.approx([1.0, 1279 / 282, 1.0, 3429 / 3479])
    lock["results"].pop("cluster")
    assert len(by_title(chart.panels(lock, TASKS), "Beyond one Redis").bars) == 2  # one scenario only


def test_paired_ratios_and_lock_cpu_are_charted() -> None:
    """The format bench/task_bench.py writes now: per-round ratios to plain (their median is the
    bar), lock CPU per task in µs, server commands per task; the best peer is a line."""
    tasks = copy.deepcopy(TASKS)
    tasks["summary"] = {"plain": tasks["summary"]["plain"]}
    figures = {
        "plain": (1.0, 0.0),
        "LockedTask": (1.03, 180.0),
        "celery-once": (1.05, 210.0),
        "celery-singleton": (1.04, 190.0),
    }
    for name, (ratio, cpu) in figures.items():
        tasks["summary"].setdefault(name, copy.deepcopy(tasks["summary"]["plain"]))
        tasks["summary"][name].update(
            paired_ratio_to_plain=ratio, lock_cpu_us_per_task=cpu, server_commands_per_task=2.0
        )
    panels = chart.panels(LOCK, tasks)
    wall = by_title(panels, "Celery, 2,000 tasks: wall")
    assert "paired median" in wall.title
    assert values(wall) == {name: ratio for name, (ratio, _) in figures.items()}
    assert (1.04, "best peer") in wall.lines
    cpu = by_title(panels, "Celery: lock CPU per task")
    assert values(cpu) == {name: cpu_us for name, (_, cpu_us) in figures.items() if name != "plain"}
    assert cpu.lines == [(190.0, "best peer")]


def test_all_cpu_is_noted_on_the_lock_cpu_bars() -> None:
    tasks = copy.deepcopy(TASKS)
    plain = tasks["summary"]["plain"]
    older = {k: v for k, v in plain.items() if k != "all_cpu_us_per_task"}  # results from before it
    tasks["summary"] = {
        "plain": plain,
        "LockedTask": {**copy.deepcopy(plain), "lock_cpu_us_per_task": 180.0, "all_cpu_us_per_task": 250.0},
        "celery-once": {**copy.deepcopy(older), "lock_cpu_us_per_task": 210.0},
    }
    notes = {
        bar.label: bar.note for bar in by_title(chart.panels(LOCK, tasks), "Celery: lock CPU per task").bars
    }
    assert notes["LockedTask"].endswith("\nall 250")
    assert "all" not in notes["celery-once"]


def test_the_captions_say_what_the_results_record() -> None:
    """The contention panels name the run's processes (its ``args``) and hold (its rows), the
    target lines are those lock_bench checked (its ``summary``): no figure of the chart's own."""
    lock = copy.deepcopy(LOCK)
    lock["args"]["processes"] = 8
    for row in lock["results"]["contention"].values():
        row["hold_ms"] = 5.0
    targets = {
        "uncontended RedisLock/bare pairs/s": ">= 0.97",
        "contention fair=True min/max acquisitions per process": ">= 0.9",
    }
    for check in lock["summary"]:
        check["target"] = targets.get(check["name"], check["target"])
    panels = chart.panels(lock, TASKS)
    assert by_title(panels, "critical sections/s").title.startswith("Lock, 8 processes, 5 ms hold:")
    assert by_title(panels, "fairness").title == "Lock, 8 processes, 5 ms hold: fairness"
    assert not [panel.title for panel in panels if "32" in panel.title]
    assert (0.97, f"target 0.97{chart.X}") in by_title(panels, "Lock, uncontended").lines
    assert by_title(panels, "fairness").lines == [(0.9, "target, fair=True")]
    lock["summary"] = []  # no target checked: no target line
    assert not [line for panel in chart.panels(lock, TASKS) for line in panel.lines if "target" in line[1]]


def test_a_hold_the_results_do_not_record_is_not_named() -> None:
    """Results from before lock_bench recorded its hold (``hold_ms``) name the processes only."""
    lock = copy.deepcopy(LOCK)
    for row in lock["results"]["contention"].values():
        row.pop("hold_ms", None)
    processes = lock["args"]["processes"]
    assert by_title(chart.panels(lock, TASKS), "critical sections/s").title.startswith(
        f"Lock, {processes} processes: "
    )
