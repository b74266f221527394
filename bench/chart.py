"""The benchmarks as one chart: ``bench/results/{lock,task}_bench.json`` -> ``bench/results/benchmarks.png``.

Run: ``make chart`` (= ``.venv/bin/python bench/chart.py``; ``--lock``, ``--tasks``
and ``--out`` name other files). It does not run a benchmark: it charts what the
two JSON files hold (``make bench``, ``make bench-tasks`` write them), as ratios
to a baseline so that runs on different machines compare:

* the lock primitive, uncontended: acquire+release pairs/s x the bare
  ``SET NX PX`` + ``EVALSHA`` loop;
* N processes on one key: critical sections/s x the best peer, and fairness
  (min/max acquisitions per process);
* beyond one Redis: a Redlock over 3 primaries x pottery's, a 3-primary
  Cluster x one server (``--only redlock``, ``--only cluster``);
* Celery tasks: wall time x a plain task (the median of per-round ratios, each
  run paired with plain's in its round, with the best peer as a line), lock CPU
  per task (worker pool + producer less plain's, plus the lock server; older
  files: CPU per task of all processes), and what a refused duplicate enqueue
  costs the producer (``refused_duplicates``).

A scenario or variant a run left out is left out of its panel; a panel with
nothing to show says why. Each figure a caption names comes from the files:
the processes from ``args``, the hold from the contention rows (``hold_ms``),
the target lines from the targets ``lock_bench.py`` checked (``summary``).
matplotlib (the ``bench`` extra) is installed from PyPI if it cannot be
imported. The PNG's ``Source`` text names the SHA-256 of both JSON files, so a
test can tell a chart older than its data.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOCK_JSON = HERE / "results" / "lock_bench.json"
TASK_JSON = HERE / "results" / "task_bench.json"
OUT = HERE / "results" / "benchmarks.png"
#: What ``make chart`` installs when matplotlib is missing (the ``bench`` extra's pin).
MATPLOTLIB = "matplotlib>=3.8"
#: "times", as in "0.92x the bare loop"
X = "\N{MULTIPLICATION SIGN}"
#: Variants of this package (drawn in its colour); the others are peers or baselines.
OURS = ("RedisLock", "LockedTask", "until_executed")


@dataclass
class Bar:
    label: str
    value: float
    #: written on the bar: the ratio and the measured number behind it
    note: str
    #: drawn as this package's (blue); ``None``: decided by the label (``ours``)
    mine: bool | None = None


@dataclass
class Panel:
    title: str
    #: the y axis
    unit: str
    bars: list[Bar] = field(default_factory=list)
    #: reference lines: (y, label)
    lines: list[tuple[float, str]] = field(default_factory=list)
    #: why the panel is empty, when it is
    missing: str = ""


def ours(label: str) -> bool:
    return label.startswith(OURS)


def wrapped(label: str) -> str:
    """A long label on two lines: at its first space, else after its first ``-`` or ``_``."""
    if len(label) <= 10 or "\n" in label:
        return label
    for mark, keep in ((" ", ""), ("-", "-"), ("_", "_")):
        head, found, tail = label.partition(mark)
        if found:
            return f"{head}{keep}\n{tail}"
    return label


def _section(data: dict[str, Any], *path: str) -> dict[str, Any]:
    for name in path:
        data = data.get(name) or {}
    return data


def target(lock: dict[str, Any], check: str) -> float | None:
    """The target ``lock_bench.py`` checked ``check`` against (``">= 0.95"``: 0.95), if it did."""
    for row in lock.get("summary") or []:
        if row["name"] == check and row["target"]:
            return float(row["target"].split()[-1])
    return None


def contention_setup(lock: dict[str, Any]) -> str:
    """The contention run as its results record it: ``"32 processes, 1 ms hold"``."""
    processes = _section(lock, "args").get("processes")
    rows = _section(lock, "results", "contention").values()
    hold = next((row["hold_ms"] for row in rows if "hold_ms" in row), None)  # older files: not recorded
    setup = f"{processes} processes" if processes else "contended"
    return setup if hold is None else f"{setup}, {hold:g} ms hold"


def lock_uncontended(lock: dict[str, Any]) -> Panel:
    panel = Panel(
        f"Lock, uncontended: pairs/s {X} bare loop", f"{X} bare SET NX + EVALSHA loop (higher is better)"
    )
    rows = _section(lock, "results", "uncontended")
    for name, row in rows.items():
        if name == "bare":
            continue
        note = (
            f"{row['ratio_to_bare']:.2f}{X}\n{row['pairs_per_s']:,.0f}/s\n{row['round_trips_per_pair']:g} RT"
        )
        panel.bars.append(Bar(name.replace("watchdog=False", "no watchdog"), row["ratio_to_bare"], note))
    if "bare" in rows:
        panel.lines = [(1.0, f"bare loop, {rows['bare']['pairs_per_s']:,.0f}/s")]
        goal = target(lock, "uncontended RedisLock/bare pairs/s")
        panel.lines += [(goal, f"target {goal:g}{X}")] if goal else []
    panel.missing = "" if panel.bars else "no uncontended results in lock_bench.json"
    return panel


def lock_contention(lock: dict[str, Any]) -> Panel:
    panel = Panel(
        f"Lock, {contention_setup(lock)}: critical sections/s {X} best peer",
        f"{X} the best peer (higher is better)",
    )
    rows = _section(lock, "results", "contention")
    peers = [row["critical_sections_per_s"] for name, row in rows.items() if not ours(name)]
    if not peers:
        panel.missing = "no contention results for the peers in lock_bench.json"
        return panel
    best = max(peers)
    for name, row in rows.items():
        ratio = row["critical_sections_per_s"] / best
        rate, trips = row["critical_sections_per_s"], row["round_trips_per_acquisition"]
        note = f"{ratio:.2f}{X}\n{rate:,.0f}/s\n{trips:.1f} RT"
        panel.bars.append(Bar(name, ratio, note))
    panel.lines = [(1.0, f"best peer, {best:,.0f}/s")]
    return panel


def lock_fairness(lock: dict[str, Any]) -> Panel:
    panel = Panel(
        f"Lock, {contention_setup(lock)}: fairness", "min / max acquisitions per process (higher is fairer)"
    )
    rows = _section(lock, "results", "contention")
    for name, row in rows.items():
        note = f"{row['min_max_ratio']:.2f}\np99 wait\n{row['p99_over_fifo_ideal']:.1f}{X} FIFO"
        panel.bars.append(Bar(name, row["min_max_ratio"], note))
    goal = target(lock, "contention fair=True min/max acquisitions per process")
    panel.lines = [(goal, "target, fair=True")] if panel.bars and goal else []
    panel.missing = "" if panel.bars else "no contention results in lock_bench.json"
    return panel


#: The peers of ``task_bench.py`` (the best of them is the bar ``LockedTask`` is held to).
TASK_PEERS = ("celery-once", "celery-singleton")


def paired(tasks: dict[str, Any]) -> bool:
    """Whether ``task_bench.json`` has the paired figures (per-round ratios to plain, lock CPU);
    older files have medians of walls and CPU per process only."""
    return any("paired_ratio_to_plain" in row for row in _section(tasks, "summary").values())


def task_wall(tasks: dict[str, Any]) -> Panel:
    count = _section(tasks, "args").get("tasks")
    what = f"{count:,} tasks" if isinstance(count, int) else "tasks"
    rounds = _section(tasks, "args").get("repeats")
    if paired(tasks):
        title = f"Celery, {what}: wall {X} plain, paired median of {rounds} rounds"
        ratio_key = "paired_ratio_to_plain"
    else:
        title, ratio_key = f"Celery, {what}: wall {X} a plain task", "wall_ratio_to_plain"
    panel = Panel(title, f"{X} a plain task's wall time (lower is better)")
    for name, row in _section(tasks, "summary").items():
        ratio = row.get(ratio_key)
        if ratio is None:
            continue
        commands = row.get("server_commands_per_task")
        note = f"{ratio:.2f}{X}\n{row['wall_s']:.2f} s\n{row['round_trips_per_task']:.1f} RT"
        if commands is not None:
            note += f"\n{commands:.1f} cmds"
        panel.bars.append(Bar(name, ratio, note))
    peers = [bar.value for bar in panel.bars if bar.label in TASK_PEERS]
    target = (min(peers), "best peer") if paired(tasks) and peers else (1.05, f"target 1.05{X}")
    panel.lines = [(1.0, "plain"), target] if panel.bars else []
    panel.missing = "" if panel.bars else "no task results with a plain baseline in task_bench.json"
    return panel


def task_cpu(tasks: dict[str, Any]) -> Panel:
    if paired(tasks):
        return task_lock_cpu(tasks)
    panel = Panel("Celery: CPU per task, all processes", "CPU ms per task (lower is better)")
    for name, row in _section(tasks, "summary").items():
        cpu = row.get("cpu_ms_per_task") or {}
        if cpu:
            total = sum(cpu.values())
            note = (
                f"{total:.2f} ms\npool {cpu.get('worker pool', 0):.2f}\nproducer {cpu.get('producer', 0):.2f}"
            )
            panel.bars.append(Bar(name, total, note))
    panel.missing = "" if panel.bars else "no CPU figures in task_bench.json"
    return panel


def task_lock_cpu(tasks: dict[str, Any]) -> Panel:
    panel = Panel(
        "Celery: lock CPU per task (pool + producer - plain's, + lock server)",
        "lock CPU µs per task (lower is better)",
    )
    for name, row in _section(tasks, "summary").items():
        cpu = row.get("lock_cpu_us_per_task")
        if cpu is None or name == "plain":
            continue
        lock_server = _section(row, "cpu_ms_per_task").get("lock server", 0) * 1000
        note = f"{cpu:.0f} µs\nserver {lock_server:.0f}\n{row['round_trips_per_task']:.1f} RT"
        if row.get("all_cpu_us_per_task") is not None:  # every place's, the main process's included
            note += f"\nall {row['all_cpu_us_per_task']:.0f}"
        panel.bars.append(Bar(name, cpu, note))
    peers = [bar.value for bar in panel.bars if bar.label in TASK_PEERS]
    panel.lines = [(min(peers), "best peer")] if peers else []
    panel.missing = "" if panel.bars else "no lock CPU figures in task_bench.json"
    return panel


def refused(tasks: dict[str, Any]) -> Panel:
    panel = Panel(
        "A refused duplicate enqueue: producer CPU", "producer CPU µs per refused duplicate (lower is better)"
    )
    for name, row in _section(tasks, "refused_duplicates").items():
        note = f"{row['producer_cpu_us']:.0f} µs\n{row['round_trips']:.2f} RT\n{row['wall_us']:.0f} µs wall"
        panel.bars.append(Bar(name, row["producer_cpu_us"], note))
    panel.missing = (
        "" if panel.bars else "no refused_duplicates in task_bench.json\n(make bench-tasks measures it)"
    )
    return panel


def beyond_one_redis(lock: dict[str, Any]) -> Panel:
    panel = Panel(
        f"Beyond one Redis: uncontended pairs/s {X} baseline", f"{X} the baseline (higher is better)"
    )
    pairs = [
        ("redlock", "pottery Redlock over 3", "pottery\nover 3", "RedisLock over 3", "Redlock\nover 3"),
        ("cluster", "RedisLock, one server", "one\nserver", "RedisLock, Cluster", "3-primary\nCluster"),
    ]
    for scenario, base_name, base_label, our_name, our_label in pairs:
        rows = _section(lock, "results", scenario)
        if base_name not in rows or our_name not in rows:
            continue
        base, mine = rows[base_name], rows[our_name]
        ratio = mine["pairs_per_s"] / base["pairs_per_s"]
        panel.bars.append(Bar(base_label, 1.0, f"1.00{X}\n{base['pairs_per_s']:,.0f}/s", mine=False))
        panel.bars.append(Bar(our_label, ratio, f"{ratio:.2f}{X}\n{mine['pairs_per_s']:,.0f}/s", mine=True))
    panel.lines = [(1.0, "baseline")] if panel.bars else []
    panel.missing = (
        "" if panel.bars else "no redlock or cluster results in lock_bench.json\n(make bench measures them)"
    )
    return panel


def notes(lock: dict[str, Any], tasks: dict[str, Any]) -> Panel:
    """Not a chart: how the numbers were made, and the versions compared."""
    versions = {**_section(lock, "versions"), **_section(tasks, "versions")}
    compared = [f"{name} {version}" for name, version in versions.items() if name != "celery-redislock"]
    lines = [
        "make bench        -> bench/results/lock_bench.json",
        "make bench-tasks  -> bench/results/task_bench.json",
        "make chart        -> this PNG (runs no benchmark)",
        "",
        "versions compared:",
        *(", ".join(compared[i : i + 3]) for i in range(0, len(compared), 3)),
        "",
        "RT: round trips to Redis per operation",
    ]
    return Panel("How these were made", "", missing="\n".join(lines))


def panels(lock: dict[str, Any], tasks: dict[str, Any]) -> list[Panel]:
    """The chart's eight panels, in reading order (two rows of four): the lock, then Celery tasks."""
    return [
        lock_uncontended(lock),
        lock_contention(lock),
        lock_fairness(lock),
        beyond_one_redis(lock),
        task_wall(tasks),
        task_cpu(tasks),
        refused(tasks),
        notes(lock, tasks),
    ]


def source(*paths: Path) -> str:
    """What the PNG's ``Source`` text says: each file's name and SHA-256."""
    return "; ".join(f"{path.name} sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}" for path in paths)


def subtitle(lock: dict[str, Any], tasks: dict[str, Any]) -> str:
    parts = []
    for name, data in (("lock_bench", lock), ("task_bench", tasks)):
        if data:
            machine = data.get("machine") or {}
            where = f"{data.get('cpus', '?')} CPUs, Python {data.get('python', '?')}"
            if machine:
                where = f"{machine['cpu']}, {machine['cores']} cores, Python {machine['python']}"
            commit = f", commit {data['commit']}" if data.get("commit") else ""
            parts.append(f"{name}.json: {where}{commit}")
    return "; ".join(parts) + ". RT: round trips to Redis. Numbers vary with machine load: compare ratios."


def ensure_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print(f"installing {MATPLOTLIB} from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", MATPLOTLIB], check=True)
        importlib.invalidate_caches()


def draw(charts: list[Panel], title: str, out: Path, metadata: dict[str, str]) -> None:
    """Write ``charts`` as a PNG at ``out`` (two rows of four panels)."""
    ensure_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 4, figsize=(24, 10.5))
    for axis, panel in zip(axes.flat, charts, strict=True):
        axis.set_title(panel.title, fontsize=10.5, loc="left")
        if not panel.bars:  # what is missing, or the notes
            axis.text(
                0.02,
                0.6,
                panel.missing,
                va="center",
                transform=axis.transAxes,
                color="0.3",
                family="monospace",
                fontsize=9,
            )
            axis.axis("off")
            continue
        labels = [bar.label for bar in panel.bars]
        values = [bar.value for bar in panel.bars]
        mine = [ours(bar.label) if bar.mine is None else bar.mine for bar in panel.bars]
        colours = ["tab:blue" if blue else "0.65" for blue in mine]
        drawn = axis.bar(range(len(values)), values, color=colours, width=0.75)
        top = max([*values, *(y for y, _ in panel.lines)]) * 1.32
        axis.set_ylim(0, top)
        for rect, bar, blue in zip(drawn, panel.bars, mine, strict=True):
            inside = rect.get_height() > top * 0.3  # a tall bar holds its note, clear of the lines above
            axis.text(
                rect.get_x() + rect.get_width() / 2,
                rect.get_height() + top * (-0.015 if inside else 0.01),
                bar.note,
                ha="center",
                va="top" if inside else "bottom",
                fontsize=7.5 if len(values) <= 5 else 6.5,  # six bars are narrower
                color="white" if inside and blue else "black",
            )
        for y, label in panel.lines:
            colour = "tab:red" if "target" in label else "0.3"
            axis.axhline(
                y, color=colour, linestyle="--", linewidth=0.9, label=label, zorder=0.5
            )  # behind bars
        if panel.lines:  # in the headroom above the bars, where no note is
            axis.legend(loc="upper left", fontsize=7.5, frameon=False, ncols=len(panel.lines))
        axis.set_xticks(range(len(labels)), [wrapped(label) for label in labels], fontsize=8)
        axis.set_ylabel(panel.unit, fontsize=8.5)
        axis.tick_params(axis="y", labelsize=8)
        axis.spines[["top", "right"]].set_visible(False)
    figure.suptitle(
        "celery-redislock benchmarks (blue: this package; grey: peers and baselines)",
        fontsize=13,
        x=0.01,
        ha="left",
    )
    figure.text(0.01, 0.945, title, fontsize=8.5, color="0.3")
    figure.tight_layout(rect=(0, 0, 1, 0.94))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80, metadata={"Software": None, **metadata})  # type: ignore[dict-item]
    plt.close(figure)


def load(path: Path) -> dict[str, Any]:
    """The JSON at ``path``, or ``{}`` if there is none (its panels then say so)."""
    if not path.exists():
        print(f"{path} not found: its panels will be empty")
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lock", type=Path, default=LOCK_JSON, help=f"lock_bench results (default {LOCK_JSON})"
    )
    parser.add_argument(
        "--tasks", type=Path, default=TASK_JSON, help=f"task_bench results (default {TASK_JSON})"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default {OUT})")
    args = parser.parse_args(argv)
    lock, tasks = load(args.lock), load(args.tasks)
    if not lock and not tasks:
        parser.error("neither results file exists: run make bench and make bench-tasks first")
    sources = source(*(path for path in (args.lock, args.tasks) if path.exists()))
    draw(panels(lock, tasks), subtitle(lock, tasks), args.out, {"Source": sources})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
