"""``_process.current_pid``: this process's id without a system call, right in a forked child."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

from celery_redislock._process import current_pid


def _report(queue: multiprocessing.Queue[tuple[int, int]]) -> None:
    queue.put((current_pid(), os.getpid()))


def test_current_pid_is_this_process_id() -> None:
    assert current_pid() == os.getpid()


def test_a_forked_child_has_its_own_id_before_any_of_its_code_runs() -> None:
    """``os.fork`` (here through multiprocessing's fork start method, as billiard's prefork pool
    forks) runs the at-fork hook in the child: the id it reads is its own, not its parent's."""
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[tuple[int, int]] = context.Queue()
    child = context.Process(target=_report, args=(queue,))
    child.start()
    try:
        kept, asked = queue.get(timeout=30)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert kept == asked == child.pid != os.getpid()


def test_under_uwsgi_the_id_is_asked_of_the_kernel_each_time() -> None:
    """uWSGI forks its workers in C, where at-fork hooks do not run by default: where its ``uwsgi``
    module is loaded, ``current_pid`` is ``os.getpid`` itself (a fresh interpreter, so that the
    module is seen at import)."""
    code = (
        "import os, sys, types; sys.modules['uwsgi'] = types.ModuleType('uwsgi'); "
        "from celery_redislock._process import current_pid; print(current_pid is os.getpid)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (found.returncode, found.stdout.strip()) == (0, "True"), found.stderr
