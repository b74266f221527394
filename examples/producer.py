"""The producer of docker-compose.yml: sends duplicate work in rounds and says what became of it.

Needs a Redis at ``REDIS_URL`` and a worker (``celery -A examples.tasks worker``);
``docker compose up`` starts both. Run: ``python -m examples.producer
[--rounds N] [--every SECONDS]`` (``--rounds 0``, the default: until stopped).
"""

from __future__ import annotations

import argparse
import itertools
import threading

from examples._support import say
from examples.tasks import rebuild_index, sync_account


def send_round(number: int) -> None:
    results = [rebuild_index.delay("catalog") for _ in range(20)]
    ids = {result.id for result in results}
    outcome = results[0].get(timeout=120)
    say(f"round {number}: 20 x rebuild_index.delay('catalog') sent {len(ids)} task: {outcome}")
    syncs = [sync_account.delay(account) for account in (1, 1, 2)]
    runs = sorted(
        (run["start"], run["end"], run["account"]) for run in (sync.get(timeout=120) for sync in syncs)
    )
    ones = [(start, end) for start, end, account in runs if account == 1]
    say(f"round {number}: two syncs of account 1 ran one after the other: {ones[0][1] <= ones[1][0]}")
    for result in (results[0], *syncs):
        result.forget()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=0, help="how many rounds (0: until stopped)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between rounds")
    options = parser.parse_args()
    pause = threading.Event()
    for number in itertools.count(1) if options.rounds == 0 else range(1, options.rounds + 1):
        send_round(number)
        if number != options.rounds:
            pause.wait(options.every)  # the pace of the rounds


if __name__ == "__main__":
    main()
