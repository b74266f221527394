"""Mutual exclusion with ``LockedTask``: calls with the same arguments never run at once.

Run: ``python -m examples.mutual_exclusion`` from the repository's root (a
private Redis is started unless ``REDIS_URL`` is set).
"""

from __future__ import annotations

import itertools

from examples._support import Worker, redis_url, say
from examples.tasks import sync_account


def main() -> None:
    with redis_url(), Worker(concurrency=4) as worker:
        say(f"a prefork worker with 4 processes (pid {worker.pid}) gets 3 syncs of account 7 and")
        say("1 of account 8 at once; sync_account waits for a busy lock (lock_busy='wait'):")
        results = [sync_account.delay(account) for account in (7, 7, 7, 8)]
        runs = [result.get(timeout=60) for result in results]
        origin = min(run["start"] for run in runs)
        for run in sorted(runs, key=lambda run: run["start"]):
            start, end = run["start"] - origin, run["end"] - origin
            bar = " " * round(start * 20) + "#" * max(round((end - start) * 20), 1)
            say(f"  account {run['account']} in process {run['pid']:>6}: {start:4.2f}s-{end:4.2f}s {bar}")
        sevens = sorted((run["start"], run["end"]) for run in runs if run["account"] == 7)
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(sevens)), sevens
        say("account 7's runs never overlap; account 8's ran alongside them")
        for result in results:
            result.forget()


if __name__ == "__main__":
    main()
