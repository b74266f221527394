"""Once-per-slot beat jobs and the beat leader with real ``celery beat`` processes, a real
worker and a real Redis: each slot runs once, a long run never overlaps the next, a new
leader takes over within one lease, a paused leader steps down instead of crashing.

Every process is a subprocess stopped by its pid; tests wait on what the jobs record
in Redis (``Recorder.runs``) and on the processes' logs, with deadlines.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from typing import Any, TypeVar

import pytest

from celery_redislock.testing import RedisServer
from tests.taskapp import Recorder
from tests.workers import BeatProcess, Subprocess, WorkerProcess, wait_for

P = TypeVar("P", bound=Subprocess)

#: the jobs' interval, seconds
INTERVAL = 1.0
#: the beat leader's lease in the leader tests, seconds
LEASE = 2.0
#: slack for a worker to receive and start a message once sent, seconds
LATENCY = 1.5


class Cluster:
    """Beats and a worker on one Redis, prefix and queue; stops what it started, by pid."""

    def __init__(self, url: str, prefix: str, **conf: Any) -> None:
        self.url, self.prefix, self.queue = url, prefix, f"q-{prefix}"
        self.conf = json.dumps(conf)
        self.recorder = Recorder(url, prefix)
        self.started: list[Subprocess] = []

    def beat(self, name: str, skew: float = 0.0, scheduler: str | None = None) -> BeatProcess:
        beat = BeatProcess(
            self.url,
            self.prefix,
            self.queue,
            name,
            self.conf,
            scheduler=scheduler,
            skew=skew,
            without=("taskapp.beat_fallback",),  # sent by beat's send_task fallback
        )
        return self._start(beat)

    def worker(self, concurrency: int = 4) -> WorkerProcess:
        return self._start(WorkerProcess(self.url, self.prefix, self.queue, "threads", concurrency, "w"))

    def _start(self, process: P) -> P:
        process.start()
        self.started.append(process)
        return process

    def runs(self, x: str) -> list[dict[str, Any]]:
        return [
            {"slot": run[2], "beat": run[3], "id": run[4], "start": float(run[5]), "end": float(run[6])}
            for run in self.recorder.runs()
            if run[1] == x
        ]

    def logs(self) -> str:
        return "\n".join(f"--- {p.args[5]} {p.log}\n{p.output()[-3000:]}" for p in self.started)

    def close(self) -> None:
        for process in self.started:
            process.stop()
        self.recorder.client.delete(self.queue)
        self.recorder.client.close()


def schedule(*entries: tuple[str, str, list[Any]]) -> dict[str, Any]:
    return {name: {"task": task, "schedule": INTERVAL, "args": args} for name, task, args in entries}


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    clusters: list[Cluster] = []

    def make(url: str, prefix: str, **conf: Any) -> Cluster:
        clusters.append(Cluster(url, prefix, **conf))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.close()


def assert_each_slot_ran_once(runs: list[dict[str, Any]]) -> None:
    slots = Counter(run["slot"] for run in runs)
    assert slots and slots.most_common(1)[0][1] == 1, slots.most_common(3)
    assert None not in slots and "None" not in slots


def test_three_beats_clocks_2s_apart_and_one_worker_run_each_1s_slot_once(
    redis_server: RedisServer, prefix: str, cluster_factory: Any
) -> None:
    cluster = cluster_factory(
        redis_server.url,
        prefix,
        beat_schedule=schedule(
            ("claimed", "taskapp.beat_job", ["c"]), ("fallback", "taskapp.beat_fallback", ["f"])
        ),
    )
    worker = cluster.worker()
    beats = [cluster.beat(f"b{i}", skew) for i, skew in enumerate((-1.0, 0.0, 1.0))]
    try:
        wait_for(
            lambda: len(cluster.runs("c")) >= 10 and len(cluster.runs("f")) >= 10,
            timeout=40,
            what=lambda: f"10 runs of each job\n{cluster.logs()}",
        )
    finally:
        for beat in beats:
            beat.stop()
    wait_for(lambda: cluster.recorder.client.llen(cluster.queue) == 0, what="the queue drained")
    worker.stop()  # a warm shutdown: every message it took is dealt with
    claimed, fallback = cluster.runs("c"), cluster.runs("f")
    assert_each_slot_ran_once(claimed)
    assert_each_slot_ran_once(fallback)
    beat_logs = "".join(beat.output() for beat in beats)
    assert beat_logs.count("entry 'claimed' slot") >= 10  # duplicates dropped by the beats
    assert "not sent: a duplicate, the slot went to" in beat_logs
    assert worker.output().count("not run, a duplicate: slot") >= 10  # the fallback's, dropped by the worker
    # Which beat sends a slot is whichever reaches it first: its clock's skew and how busy the
    # machine is decide, and one may send them all (the refusals above show the others tried).


def test_three_redbeat_beats_run_each_slot_once(
    fresh_server: RedisServer, prefix: str, cluster_factory: Any
) -> None:
    # Found, not imported: importing redbeat connects its beat_init receiver in this process (the
    # beats are subprocesses), which a later test's beat would run.
    if importlib.util.find_spec("redbeat") is None:
        pytest.skip("celery-redbeat is not installed (pip install celery-redbeat)")
    cluster = cluster_factory(
        fresh_server.url,
        prefix,
        beat_schedule=schedule(
            ("claimed", "taskapp.beat_job", ["c"]), ("fallback", "taskapp.beat_fallback", ["f"])
        ),
        redbeat_redis_url=fresh_server.url,
        redbeat_key_prefix=f"rb-{prefix}:",
        redbeat_lock_key=None,  # RedBeat's own single-beat lock off: every beat sends
    )
    worker = cluster.worker()
    beats = [cluster.beat(f"rb{i}", scheduler="redbeat.RedBeatScheduler") for i in range(3)]
    try:
        wait_for(
            lambda: len(cluster.runs("c")) >= 8 and len(cluster.runs("f")) >= 8,
            timeout=40,
            what=lambda: f"8 runs of each job\n{cluster.logs()}",
        )
    finally:
        for beat in beats:
            beat.stop()
    wait_for(lambda: cluster.recorder.client.llen(cluster.queue) == 0, what="the queue drained")
    worker.stop()
    assert_each_slot_ran_once(cluster.runs("c"))
    assert_each_slot_ran_once(cluster.runs("f"))
    assert "RedBeatScheduler" in beats[0].output()


@pytest.mark.locks_may_remain("the worker is SIGKILLed mid-run: its lock expires with its lease")
@pytest.mark.parametrize(("job", "policy"), [("beat_job", "skip"), ("beat_wait", "wait")])
def test_a_2_5s_body_on_a_1s_interval_never_overlaps_itself(
    redis_server: RedisServer, prefix: str, cluster_factory: Any, job: str, policy: str
) -> None:
    cluster = cluster_factory(
        redis_server.url, prefix, beat_schedule=schedule(("slow", f"taskapp.{job}", ["s", 2.5]))
    )
    worker = cluster.worker()
    beats = [cluster.beat("b0"), cluster.beat("b1", 0.5)]
    wait_for(lambda: len(cluster.runs("s")) >= 3, timeout=40, what=lambda: f"3 runs\n{cluster.logs()}")
    for process in [*beats, worker]:
        process.signal(signal.SIGKILL)  # stop at once: the waiting runs need not finish
        process.stop()
    runs = sorted(cluster.runs("s"), key=lambda run: run["start"])
    assert_each_slot_ran_once(runs)
    for earlier, later in itertools.pairwise(runs):
        assert later["start"] >= earlier["end"], (earlier, later)  # never two at once
        assert later["end"] - later["start"] >= 2.4
    if policy == "skip":
        assert worker.output().count("skipped: lock") >= 2  # the slots that came while it ran
    else:  # the next slot waited for the lock and started as soon as it was released
        assert all(later["start"] - earlier["end"] < LATENCY for earlier, later in itertools.pairwise(runs))


def leader_cluster(redis_server: RedisServer, prefix: str, cluster_factory: Any) -> Any:
    cluster = cluster_factory(
        redis_server.url,
        prefix,
        beat_schedule=schedule(("claimed", "taskapp.beat_job", ["c"])),
        redislock_beat_leader=True,
        redislock_beat_leader_ttl=LEASE,
    )
    cluster.worker()
    beats = {beat: beat for beat in (cluster.beat(f"l{i}") for i in range(3))}
    wait_for(
        lambda: sum("standing by; the leader is" in beat.output() for beat in beats) == 2,
        timeout=30,
        what=lambda: f"two beats standing by\n{cluster.logs()}",
    )
    wait_for(lambda: len(cluster.runs("c")) >= 3, timeout=30, what=lambda: f"3 runs\n{cluster.logs()}")
    senders = {run["beat"] for run in cluster.runs("c")}
    assert len(senders) == 1, senders  # one beat leads and sends; the others idle
    (sender,) = senders
    leader = next(beat for beat in beats if sender.endswith(f":{beat.pid}"))
    return cluster, list(beats), leader, sender


def test_when_the_leader_is_killed_another_sends_within_one_lease(
    redis_server: RedisServer, prefix: str, cluster_factory: Any
) -> None:
    cluster, beats, leader, sender = leader_cluster(redis_server, prefix, cluster_factory)
    leader.signal(signal.SIGKILL)
    killed_at = time.time()
    leader.process.wait(timeout=10)
    new = wait_for(
        lambda: [run for run in cluster.runs("c") if run["beat"] != sender],
        timeout=30,
        what=lambda: f"a run sent by another beat\n{cluster.logs()}",
    )
    # The lease runs out at most LEASE after the kill; the next slot starts within INTERVAL.
    assert new[0]["start"] - killed_at <= LEASE + INTERVAL + LATENCY, cluster.logs()
    wait_for(lambda: len(cluster.runs("c")) >= len(new) + 6, timeout=30, what="three more runs")
    runs = cluster.runs("c")
    assert_each_slot_ran_once(runs)
    after = runs[runs.index(new[0]) :]
    assert len({run["beat"] for run in after}) == 1  # one new leader, alone
    new_leader = next(beat for beat in beats if after[0]["beat"].endswith(f":{beat.pid}"))
    (last,) = [beat for beat in beats if beat not in (leader, new_leader)]
    assert "leads (lock" not in last.output()
    new_leader.stop()  # a clean stop releases the lock: the last beat leads at once, not at its expiry
    last.wait_for_line(
        "leads (lock", timeout=LEASE * 3, what=lambda: f"the last beat to lead\n{cluster.logs()}"
    )
    resigned, leads = logged_at(new_leader, "resigned as beat leader"), logged_at(last, "leads (lock")
    # The release wakes the last beat before the old leader logs it resigned: either line may come
    # first, by a few ms. An expiry would come >= 2/3 of a lease after the last renewal.
    assert abs(leads - resigned) < LEASE / 3


def logged_at(process: Subprocess, text: str) -> float:
    """When ``process`` first logged a line with ``text`` (from the log's timestamp)."""
    line = next(line for line in process.output().splitlines() if text in line)
    stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_a_paused_leader_that_lost_its_lease_steps_down_without_crashing(
    redis_server: RedisServer, prefix: str, cluster_factory: Any
) -> None:
    cluster, _, leader, sender = leader_cluster(redis_server, prefix, cluster_factory)
    leader.signal(signal.SIGSTOP)  # a long GC pause, a frozen VM: the lease runs out meanwhile
    try:
        new = wait_for(
            lambda: [run for run in cluster.runs("c") if run["beat"] != sender],
            timeout=30,
            what=lambda: f"a run sent by another beat\n{cluster.logs()}",
        )
    finally:
        leader.signal(signal.SIGCONT)
    resumed_at = time.time()
    leader.wait_for_line(
        "stepped down as beat leader",
        timeout=20,
        what=lambda: f"the paused leader stepping down\n{cluster.logs()}",
    )
    wait_for(lambda: len(cluster.runs("c")) >= len(new) + 4, timeout=30, what="more runs")
    assert leader.alive(), leader.output()  # it stood down, it did not crash (RedBeat #230)
    runs = cluster.runs("c")
    assert_each_slot_ran_once(runs)
    assert not [run for run in runs if run["beat"] == sender and run["start"] >= resumed_at]
    assert "Traceback" not in leader.output()
