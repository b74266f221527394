"""Celery workers for the tests: in-process (threads pool) or subprocesses stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redislock.state import running

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 60.0, what: str | Callable[[], str] = "condition") -> T:
    """Poll ``check`` until it returns something truthy, or fail after ``timeout`` seconds
    (``what``, or what it returns then, says what was awaited)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what if isinstance(what, str) else what()}"
            )
        time.sleep(0.01)  # a polling step with a deadline, not a synchronisation


def runs_over(task_name: str, task_id: str | None = None) -> bool:
    """Whether the package has finished every run of ``task_name`` (``task_id``'s only, if given)
    in this process: a run that ``after_return`` did not finish (a retry, an interrupt) is
    finished as its trace ends (``receivers.RunRequests``), after the ``task_postrun``
    receivers, on the worker's thread: the point to wait for after ``task_postrun``."""
    return not any(
        run.task.name == task_name and task_id in (None, run.task_id) for run in list(running.values())
    )


def renewed(client: redis.Redis | redis.cluster.RedisCluster, key: str, timeout: float = 60.0) -> None:
    """Wait until a watchdog renews ``key``: its PTTL, which otherwise only falls, goes up."""
    lowest = client.pttl(key)
    assert lowest > 0, f"{key} is not held (PTTL {lowest})"

    def went_up() -> bool:
        nonlocal lowest
        now = client.pttl(key)
        lowest, rose = min(lowest, now), now > lowest
        return rose

    wait_for(went_up, timeout=timeout, what=f"a renewal of {key}")


@contextmanager
def threads_worker(app: Celery, concurrency: int = 4) -> Iterator[Any]:
    """An in-process worker (threads pool) consuming ``app``'s default queue."""
    with start_worker(app, pool="threads", concurrency=concurrency, perform_ping_check=False) as worker:
        yield worker


class Subprocess:
    """A ``celery -A {app} ...`` subprocess in a session of its own, logging to a file,
    signalled and stopped by its pid."""

    def __init__(
        self, kind: str, name: str, env: dict[str, str], args: list[str], app: str = "tests.taskapp"
    ) -> None:
        self.env = {**os.environ, **env}
        self.args = [sys.executable, "-m", "celery", "-A", app, *args]
        self.log = Path(tempfile.mkstemp(prefix=f"{kind}-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(
        self, text: str, timeout: float = 60.0, what: str | Callable[[], str] = "a line"
    ) -> str:
        """Wait until the output holds ``text`` (a line or part of one); that output. A failure
        says what was awaited (``what``, or what it returns then), names ``text`` and shows the
        output's end."""

        def holding() -> str:
            output = self.output()
            return output if text in output else ""

        def failure() -> str:
            awaited = what if isinstance(what, str) else what()
            return f"{awaited}: {text!r} in {self.log}, which ends with:\n{self.output()[-3000:]}"

        return wait_for(holding, timeout=timeout, what=failure)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL to the process group (the main process and its pool children); reaped."""
        os.killpg(self.pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL to the process group if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(timeout=15)


def _taskapp_env(url: str, prefix: str, queue: str, conf: str) -> dict[str, str]:
    return {
        "TASKAPP_URL": url,
        "TASKAPP_PREFIX": prefix,
        "TASKAPP_QUEUE": queue,
        "TASKAPP_CONF": conf,  # JSON: more settings for the app
    }


class WorkerProcess(Subprocess):
    """``celery -A tests.taskapp worker`` (``app``: a module that imports ``tests.taskapp``'s)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        queue: str,
        pool: str,
        concurrency: int,
        name: str,
        conf: str = "{}",
        app: str = "tests.taskapp",
    ) -> None:
        args = ["worker", "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{name}@%h"]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
        super().__init__("worker", name, _taskapp_env(url, prefix, queue, conf), args, app=app)


class BeatProcess(Subprocess):
    """``celery -A tests.taskapp beat`` with a schedule file of its own, its clock ``skew``
    seconds off, without the tasks named in ``without``."""

    def __init__(
        self,
        url: str,
        prefix: str,
        queue: str,
        name: str,
        conf: str = "{}",
        scheduler: str | None = None,
        skew: float = 0.0,
        without: tuple[str, ...] = (),
    ) -> None:
        env = _taskapp_env(url, prefix, queue, conf)
        env.update(TASKAPP_SKEW=str(skew), TASKAPP_WITHOUT=",".join(without))
        schedule_file = Path(tempfile.mkdtemp(prefix=f"beat-{name}-")) / "schedule"
        args = ["beat", "-l", "INFO", "-s", str(schedule_file)]
        super().__init__("beat", name, env, args + (["-S", scheduler] if scheduler else []))
