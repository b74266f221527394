"""A pytest plugin (``tests/conftest.py`` loads it): no test leaves a Celery signal receiver
connected.

A receiver a test connects and leaves (a module imported in the test that connects at import,
as an example's ``@worker_init.connect``; a ``connect`` without its ``disconnect``) stays in
the process and fires in later, unrelated tests: an xdist worker runs many files. Before each
test the receivers of every Celery signal (``celery.signals``, the testing worker's) and of the
package's (``celery_redislock.signals``) are noted; after it, each live receiver added since is
disconnected, and the test fails at teardown naming the test, the signal and the receiver.

The package's own receivers are told apart by their ``dispatch_uid``: ``install(app)`` (and
``beat.guard``) connects each once per process, strongly, with a uid in the package's
namespace (``celery_redislock.``), and nothing undoes it: they stay for good by contract,
whichever test binds the first ``LockedTask``. Not "any receiver from a ``celery_redislock``
module": one the package connected per app or per call (a partial, a closure; a later one
connects again) would then pile up unseen, which the uid rule reports.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

import celery.contrib.testing.worker
import celery.signals
import pytest
from celery.utils.dispatch import Signal

import celery_redislock.signals

__all__ = ["PACKAGE_UID", "SIGNALS", "leaked_receivers"]

#: The ``dispatch_uid`` prefix of the package's receivers, connected once per process for good.
PACKAGE_UID = "celery_redislock."

#: (dotted name, signal) of every signal watched.
SIGNALS: list[tuple[str, Signal]] = [
    (f"{module.__name__}.{name}", value)
    for module in (celery.signals, celery.contrib.testing.worker, celery_redislock.signals)
    for name, value in vars(module).items()
    if isinstance(value, Signal)
]


def _live(receiver: Any) -> Any:
    """The receiver itself (a weak one resolved), or ``None`` once a weak one is gone."""
    return receiver() if isinstance(receiver, weakref.ReferenceType) else receiver


def _package(key: tuple[Any, Any]) -> bool:
    """Whether a receiver's lookup key (``(dispatch_uid or id(receiver), id(sender))``) is the
    package's: a uid in its namespace."""
    return isinstance(key[0], str) and key[0].startswith(PACKAGE_UID)


def _described(receiver: Any) -> str:
    """``module.qualname`` of a receiver (a partial's function, a bound method's function)."""
    while isinstance(receiver, functools.partial):
        receiver = receiver.func
    receiver = getattr(receiver, "__func__", receiver)
    module = getattr(receiver, "__module__", None) or type(receiver).__module__
    return f"{module}.{getattr(receiver, '__qualname__', type(receiver).__qualname__)}"


def leaked_receivers(before: list[set[Any]]) -> list[str]:
    """Disconnect every live receiver connected since ``before`` (each signal's lookup keys, in
    ``SIGNALS`` order) but the package's; ``"signal: receiver"`` for each."""
    found = []
    for (name, signal), keys in zip(SIGNALS, before, strict=True):
        leaked = [
            entry
            for entry in signal.receivers
            if entry[0] not in keys and not _package(entry[0]) and _live(entry[1]) is not None
        ]
        if leaked:
            gone = {id(entry) for entry in leaked}
            # As ``Signal.disconnect`` does (which needs the sender, not its id); not in the stubs.
            with signal.lock:  # type: ignore[attr-defined]
                signal.receivers[:] = [entry for entry in signal.receivers if id(entry) not in gone]
                signal.sender_receivers_cache.clear()  # type: ignore[attr-defined]
            found += [f"{name}: {_described(_live(receiver))}" for _, receiver in leaked]
    return found


@pytest.fixture(autouse=True)
def _no_leaked_receivers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Set up before the test's other function fixtures, so torn down after them: what a
    fixture connects and disconnects at its teardown is not a leak."""
    before = [{key for key, _ in signal.receivers} for _, signal in SIGNALS]
    yield
    leaked = leaked_receivers(before)
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} left Celery signal receivers connected (disconnected now; "
            "disconnect them in the test's teardown): " + "; ".join(leaked),
            pytrace=False,
        )
