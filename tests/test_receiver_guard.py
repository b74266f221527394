"""The suite's guard against leaked Celery signal receivers (``tests/receiver_guard.py``) fails
the test that leaked one, names it, and disconnects what it left; the package's receivers
(``install``'s, a ``celery_redislock.`` uid, once per process) are allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEAKY_MODULE = """
from celery.signals import worker_init


@worker_init.connect
def start_metrics(**kwargs):
    pass
"""

LEAKING_TESTS = """
from celery.signals import task_prerun, worker_init

from celery_redislock import signals


def on_lost(**kwargs):
    pass


def test_imports_a_module_that_connects():
    import leaky_module  # connects worker_init at import, as an example module might


def test_connects_without_disconnecting():
    signals.lock_lost.connect(on_lost, weak=False)


def test_installs_the_package_receivers():
    from celery import Celery
    from celery_redislock import install

    app = Celery("guarded", broker="memory://", set_as_current=False)
    app.conf.redislock_url = "redis://127.0.0.1:1/0"  # never connected: installing connects nothing
    install(app)


def test_disconnects_what_it_connects():
    task_prerun.connect(on_lost, weak=False)
    task_prerun.disconnect(on_lost)


def test_later_tests_see_none_of_the_leaks():
    assert worker_init.receivers == []
    assert signals.lock_lost.receivers == []
"""


def test_a_leaking_test_fails_at_teardown_naming_itself_the_signal_and_the_receiver(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(leaky_module=LEAKY_MODULE, test_leaking=LEAKING_TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "tests.receiver_guard")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*ERROR at teardown of test_imports_a_module_that_connects*",
            "*test_leaking.py::test_imports_a_module_that_connects left Celery signal receivers "
            "connected*celery.signals.worker_init: leaky_module.start_metrics*",
            "*ERROR at teardown of test_connects_without_disconnecting*",
            "*test_leaking.py::test_connects_without_disconnecting left Celery signal receivers "
            "connected*celery_redislock.signals.lock_lost: test_leaking.on_lost*",
        ]
    )
