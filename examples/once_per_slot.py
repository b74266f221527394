"""A once-only beat job with two beats: two ``celery beat`` processes send one schedule,
and each slot of it runs once.

``send_digest`` has ``lock_beat=True`` and the schedule
(``examples.celeryconfig``) sends it every second here. Both beats send every
slot; the first to claim the slot's marker in Redis sends it, the other logs
the duplicate and sends nothing; the worker checks the slot again before it
runs. Then one beat is stopped, as a deploy or a crash would, and the other
goes on sending each slot alone: two beats for availability, one run per slot.

Run: ``python -m examples.once_per_slot`` from the repository's root (a
private Redis is started unless ``REDIS_URL`` is set). ``make demo`` shows the
first part too (``two_beats``).
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis

from celery_redislock.keys import slot_key
from examples._support import Beat, Worker, redis_url, say

#: The example app's redislock_prefix (the default).
PREFIX = "redislock"
#: Seconds between two sends of the job, and so the length of a slot.
EVERY = 1.0
#: The schedule entry the beats send (``examples.celeryconfig`` names it after its interval).
ENTRY = f"digest-every-{EVERY:g}s"
#: Longest wait for what the beats and the worker do.
TIMEOUT = 30.0

#: The worker's line for a run: the slot, and the beat whose message it is.
_RUN = re.compile(r"runs slot (\S+) of beat entry '([^']+)' \(sent by (\S+)\)")
#: A beat's line for a slot it did not send: another beat had claimed it.
_DROPPED = re.compile(r"(beat=\S+): entry '([^']+)' slot (\S+) not sent: a duplicate")


@dataclass
class Slots:
    """What the worker and the beats logged about ``ENTRY``'s slots so far."""

    #: slot id -> how many times the worker ran it
    runs: Counter[str] = field(default_factory=Counter)
    #: slot id -> the beat whose message the worker ran (``beat=host:pid``)
    senders: dict[str, str] = field(default_factory=dict)
    #: slot id -> the beats that found it claimed and sent nothing
    dropped: dict[str, list[str]] = field(default_factory=dict)
    #: a beat's log line for one dropped duplicate, to quote
    dropped_line: str = ""

    @property
    def duplicates(self) -> int:
        return sum(len(beats) for beats in self.dropped.values())


def read_slots(worker: Worker, beats: Iterable[Beat]) -> Slots:
    slots = Slots()
    for line in worker.log_lines("runs slot", f"of beat entry '{ENTRY}'"):
        match = _RUN.search(line)
        if match:
            slots.runs[match[1]] += 1
            slots.senders[match[1]] = match[3]
    for beat in beats:
        for line in beat.log_lines(f"entry '{ENTRY}' slot", "not sent: a duplicate"):
            match = _DROPPED.search(line)
            if match:
                slots.dropped.setdefault(match[3], []).append(match[1])
                slots.dropped_line = line.split("] ", 1)[-1]
    return slots


def wait_for_slots(worker: Worker, beats: list[Beat], runs: int, duplicates: int = 0) -> Slots:
    """Poll the logs until the worker has run ``runs`` slots and the beats have dropped
    ``duplicates``; ``AssertionError`` after ``TIMEOUT`` seconds."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        slots = read_slots(worker, beats)
        if len(slots.runs) >= runs and slots.duplicates >= duplicates:
            return slots
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(slots.runs)} slots run, {slots.duplicates} duplicates in {TIMEOUT}s")
        time.sleep(0.05)  # a polling step with a deadline


@contextmanager
def beats_running(*names: str) -> Iterator[list[Beat]]:
    """A beat per name, started side by side and ready; stopped by pid (if ``stop_beats``
    has not stopped them yet) and their files removed on the way out."""
    beats = [Beat(name, EVERY) for name in names]
    try:
        for beat in beats:
            beat.launch()
        for beat in beats:
            beat.wait_ready()
        yield beats
    except BaseException:
        for beat in beats:  # what the beats said helps explain the failure
            print(f"--- {beat.name}'s log ends with:", *beat.log_lines()[-20:], sep="\n", file=sys.stderr)
        raise
    finally:
        stop_beats(beats)
        for beat in beats:
            beat.cleanup()


def stop_beats(beats: list[Beat]) -> None:
    """Stop the beats by pid: all asked at once (SIGTERM), then each awaited."""
    for beat in beats:
        beat.terminate()
    for beat in beats:
        beat.stop()


def settle(client: redis.Redis, worker: Worker) -> list[str]:
    """Once the beats are stopped: wait until every slot they sent has started on the
    worker, then delete the slots' markers (which would outlive the slot by a minute, so
    that beats with skewed clocks agree); returns the marker keys deleted.

    A sent slot's marker names the beat until the worker claims it for the task it runs
    (the value's holder becomes ``task=...``); a marker freed because its send failed is gone.
    """
    pattern = slot_key(PREFIX, ENTRY, "*")
    deadline = time.monotonic() + TIMEOUT
    while True:
        markers = {key.decode(): client.get(key) for key in client.scan_iter(match=pattern)}
        waiting = [key for key, value in markers.items() if value and b":0:task=" not in value]
        if not waiting and len(read_slots(worker, []).runs) >= len(markers):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"slots sent but not run within {TIMEOUT}s: {waiting}")
        time.sleep(0.02)  # a polling step with a deadline
    if markers:
        client.delete(*markers)
    return sorted(markers)


def pid_of(beat: str) -> str:
    """``beat=host:4242`` -> ``4242``."""
    return beat.rsplit(":", 1)[-1]


def narrate(slots: Slots, only: Iterable[str] | None = None) -> None:
    for slot in sorted(only if only is not None else slots.runs):
        dropped = slots.dropped.get(slot, [])
        also = f"; beat {', '.join(pid_of(b) for b in dropped)}'s duplicate dropped" if dropped else ""
        say(f"   slot {slot}: run {slots.runs[slot]}x, sent by beat {pid_of(slots.senders[slot])}{also}")


def two_beats(client: redis.Redis, worker: Worker, slots: int = 4) -> Slots:
    """Two beats send ``ENTRY`` until the worker has run ``slots`` of its slots (and the beats
    have dropped as many duplicates, less one); stops them; checks that each slot ran once."""
    started = time.monotonic()
    with beats_running("beat-1", "beat-2") as beats:
        say(
            f"   (two beats started, pids {beats[0].pid} and {beats[1].pid}, "
            f"ready in {time.monotonic() - started:.1f}s)"
        )
        wait_for_slots(worker, beats, runs=slots, duplicates=slots - 1)
        stop_beats(beats)
        markers = settle(client, worker)
        seen = read_slots(worker, beats)
    narrate(seen)
    assert seen.runs and max(seen.runs.values()) == 1, seen.runs
    say(
        f"   {len(seen.runs)} slots, each run once by the worker; "
        f"{seen.duplicates} duplicates dropped by the beats, which log:"
    )
    say(f"   [beat log] {seen.dropped_line}")
    say(
        f"   the beats (pids {beats[0].pid}, {beats[1].pid}) are stopped; "
        f"their {len(markers)} slot markers deleted"
    )
    return seen


def main() -> None:
    with redis_url() as url, Worker() as worker:
        client = redis.Redis.from_url(url)
        say(f"send_digest has lock_beat=True; beat sends it every {EVERY:g} s (entry {ENTRY!r}).")
        say(f"A worker (pid {worker.pid}) runs it; two `celery beat` processes both send it.")
        with beats_running("beat-1", "beat-2") as beats:
            say(f"   beats started, pids {beats[0].pid} and {beats[1].pid}")
            both = wait_for_slots(worker, beats, runs=4, duplicates=3)
            narrate(both)
            say(f"   each slot ran once; {both.duplicates} duplicates dropped by the beats, which log:")
            say(f"   [beat log] {both.dropped_line}")
            # The beat that sent the latest slot stops: the other one, whose sends were dropped, takes over.
            last = both.senders[max(both.senders)]
            gone = next(beat for beat in beats if pid_of(last) == str(beat.pid))
            stays = next(beat for beat in beats if beat is not gone)
            say(f"Beat {gone.pid}, which sent the latest slot, stops (a deploy, a crash);")
            say(f"beat {stays.pid} alone goes on sending each slot:")
            stop_beats([gone])
            alone = wait_for_slots(worker, beats, runs=len(read_slots(worker, beats).runs) + 3)
            narrate(alone, only=set(alone.runs) - set(both.runs))
            stop_beats(beats)
            markers = settle(client, worker)
            seen = read_slots(worker, beats)
        assert seen.runs and max(seen.runs.values()) == 1, seen.runs
        say(f"{len(seen.runs)} slots in all, each run once; {seen.duplicates} duplicates dropped by beats")
        say(f"both beats are stopped; their {len(markers)} slot markers deleted")
        client.close()


if __name__ == "__main__":
    main()
