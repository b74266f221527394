"""This process's id, kept in memory: ``os.getpid`` is a system call (about 0.2 µs in a loop,
0.5 µs in a pool child's run on a virtual machine), and a run asks for it about ten times
(``held()``, the holder, the loaned connection, the watchdog, the client).

The id is what tells a forked child from its parent: a child must not hold its parent's
locks, read on its parent's connections or use its client and watchdog. A child made with
``os.fork`` (multiprocessing, billiard's prefork pool, gunicorn) sets the id anew before any
of its own code runs (``os.register_at_fork``). uWSGI forks its workers in C, where those
hooks do not run unless it is told to (``--py-call-osafterfork``): in a uWSGI process the id is
asked of the kernel each time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["current_pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


def _kept() -> int:
    """``os.getpid()``, without the system call."""
    return _pid


os.register_at_fork(after_in_child=_forked)

#: This process's id (``os.getpid`` itself where forks may skip the hooks: uWSGI's ``uwsgi``
#: module is there from the start in its processes).
current_pid: Callable[[], int] = os.getpid if "uwsgi" in sys.modules else _kept
