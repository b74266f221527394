"""This process's id, kept in memory: ``os.getpid`` is a system call (about 0.2 µs on a
virtual machine), and a run asks for it about ten times (``held()``, the holder, the loaned
connection, the watchdog, the client). A child made with ``os.fork`` (multiprocessing and
billiard's prefork pool included) sets it anew before any of its own code runs
(``os.register_at_fork``)."""

from __future__ import annotations

import os

__all__ = ["current_pid"]

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """``os.getpid()``, without the system call."""
    return _pid
