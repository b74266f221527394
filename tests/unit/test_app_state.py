"""What the package keeps per app (``state.app_state``): one state per app, gone with the app."""

from __future__ import annotations

import gc

from celery import Celery

from celery_redislock import state
from tests.unit.threads import asked_at_once


def test_one_state_per_app_whoever_asks_first() -> None:
    app = Celery(set_as_current=False)
    seen = asked_at_once(lambda: state.app_state(app))
    assert len(seen) == 8 and all(found is seen[0] for found in seen)
    assert state.app_state(app) is seen[0]
    assert state.app_state(Celery(set_as_current=False)) is not seen[0]


def test_an_app_that_is_gone_takes_its_state_with_it() -> None:
    app = Celery(set_as_current=False)
    state.app_state(app).switched_off = True
    key = id(app)
    assert key in state._STATES
    del app
    gc.collect()  # a Celery app lives in reference cycles
    assert key not in state._STATES
