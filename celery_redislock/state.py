"""What the package keeps per Celery app in this process, held weakly by the app.

One ``AppState`` per app, held by the app's id until the app is gone (a
``weakref.finalize`` drops it then), and nothing is set on the app itself.
``forget_client(app)`` (also ``celery_redislock.testing.forget_client``)
drops the app's lock client (closing it if the package made it), for tests
that change an app's ``redislock_url`` or ``redislock_client`` between uses;
the rest of the state stays.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import redis
import redis.cluster

__all__ = [
    "AppState",
    "LockClient",
    "app_state",
    "app_states",
    "forget_client",
    "run_over",
    "run_started",
    "running",
]


class LockClient(NamedTuple):
    """An app's lock client in one process (``connection.client_for``)."""

    #: the process that made it: a forked child makes its own
    pid: int
    client: redis.Redis | redis.cluster.RedisCluster
    #: where it points, without credentials (logged once per process)
    where: str
    #: whether the package made it, and so closes it (``forget_client``); never a client it was given
    owned: bool


class Run(Protocol):
    """A run under way (``execution.Execution``), as ``running`` holds it."""

    #: its task, the request it was started with, its task id and its lock's key
    task: Any
    request: Any
    task_id: str | None
    key: str
    #: the run it was started in, under the same task id in the same thread (``apply()`` of a run
    #: that replaces itself: Celery runs the replacement at once), back in ``running`` once it is over
    outer: Run | None

    def finish(self) -> None:
        """Let go of what an asynchronous exception kept the run from letting go."""


@dataclass
class AppState:
    """One app's state in this process."""

    #: the app's lock client, once made in this process or its parent
    client: LockClient | None = None
    #: whether ``install(app)`` found ``redislock_enabled = False`` (and logged it): nothing connected
    switched_off: bool = False
    #: whether ``install(app)`` connected the receivers (``celery_redislock.receivers``)
    installed: bool = False
    #: the pid of this process if it is a prefork pool child (``worker_process_init``)
    pool_child: int | None = None
    #: tasks whose WARNING that ``lock_on_lost="terminate"`` acts as ``"raise"`` here was logged
    terminate_warned: set[str] = field(default_factory=set)


#: (thread id, task id) -> the run (an ``Execution`` with an execution lock), from its lock's
#: making to its finish (``after_return``, or the end of its trace: ``receivers.RunRequests``),
#: which runs in the same thread (two attempts of one task, a retry starting while its previous
#: attempt finishes, run in different threads); keyed by task id too, as a run may start another
#: in its thread (an eager ``apply()``) before either ends; one of the same task id (an eager
#: replacement) stands in for the run it was started in until it is over (``run_over``). One for
#: the process, not one per app: a task class bound to another app meanwhile (another app
#: registers it) still finds its runs.
running: dict[tuple[int, str], Run] = {}


def run_started(where: tuple[int, str], run: Run) -> None:
    """``run`` is under way at ``where``: in ``running``, standing in for the run there, if any,
    that it was started in (``Run.outer``)."""
    run.outer = running.get(where)
    running[where] = run


def run_over(where: tuple[int, str], run: Run) -> None:
    """``run`` (``running[where]``) is over: out of ``running``, the run it was started in
    (``Run.outer``) back in its place. Nothing if ``where`` holds another run."""
    if running.get(where) is run:
        if run.outer is None:
            del running[where]
        else:
            running[where] = run.outer


#: id(app) -> its state, dropped when the app is (its id is not reused before): a run looks its
#: app's state up for its lock client, and a ``WeakKeyDictionary`` runs Python code and makes a
#: weak reference on every lookup.
_STATES: dict[int, AppState] = {}


def app_state(app: Any) -> AppState:
    """``app``'s state in this process (created empty on first use)."""
    state = _STATES.get(id(app))
    if state is None:
        made = AppState()
        state = _STATES.setdefault(id(app), made)  # two threads asking at once share one
        if state is made:
            weakref.finalize(app, _STATES.pop, id(app), None)
    return state


def app_states() -> list[AppState]:
    """The state of every app of this process that has one and is still alive."""
    return list(_STATES.values())


def forget_client(app: Any) -> None:
    """Forget ``app``'s lock client (closing it if the package made it, not one given as
    ``redislock_client``): its next use reads the settings again."""
    state = _STATES.get(id(app))
    if state is not None and state.client is not None:
        made, state.client = state.client, None
        if made.owned:
            made.client.close()
