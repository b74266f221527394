"""What the runnable examples share: a Redis to use and a worker subprocess, both stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from celery_redislock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
#: The queue of the examples' messages and workers.
QUEUE = "redislock-examples"
#: Longest wait for a worker to start or stop.
WORKER_TIMEOUT = 60.0


def say(text: str = "") -> None:
    print(text, flush=True)


@contextmanager
def redis_url() -> Iterator[str]:
    """``$REDIS_URL``, or a private redis-server on 127.0.0.1 started here and stopped by its pid.

    Sets ``REDIS_URL`` and ``EXAMPLES_QUEUE`` for ``examples.celeryconfig``
    (read when the example app is first used) and for the workers started
    here: the examples send to a queue of their own, ``redislock-examples``,
    so that a worker of yours on the same Redis does not take their messages.
    """
    url = os.environ.get("REDIS_URL")
    server = None
    if not url:
        server = RedisServer().start()
        url = server.url
        say(f"(started a private redis-server, pid {server.pid}, at {url})")
    os.environ.update(REDIS_URL=url, EXAMPLES_QUEUE=QUEUE)
    try:
        yield url
    finally:
        if server is not None:
            server.close()


class Worker:
    """``celery -A examples.tasks worker`` (prefork) in a session of its own, stopped by its pid.

    Its log goes to a temporary file (``log_lines()``); ``with Worker():``
    starts it, waits until it consumes, and stops it.
    """

    def __init__(self, concurrency: int = 2, name: str = "example") -> None:
        self.name = f"{name}-{os.getpid()}"
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "examples.tasks",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-Q",
            QUEUE,
            "-n",
            f"{self.name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
        ]
        fd, log = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "the worker is not started"
        return self.process.pid

    def start(self) -> Worker:
        """Start the worker and wait until it consumes (its "ready." log line)."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self.wait_for_log(f"{self.name}@", "ready.")
        except RuntimeError:
            self.stop()
            raise
        return self

    def wait_for_log(self, *parts: str, timeout: float = WORKER_TIMEOUT) -> list[str]:
        """The log lines that contain every one of ``parts``, once there is one;
        ``RuntimeError`` with the log's end if none comes within ``timeout`` or the worker exits."""
        deadline = time.monotonic() + timeout
        while not (lines := self.log_lines(*parts)):
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log_lines()[-30:])
                raise RuntimeError(
                    f"the worker did not log {' ... '.join(parts)!r}; its log ends with:\n{tail}"
                )
            time.sleep(0.02)  # a polling step with a deadline
        return lines

    def log_lines(self, *parts: str) -> list[str]:
        """The worker's log lines that contain every one of ``parts``."""
        lines = self.log.read_text(errors="replace").splitlines()
        return [line for line in lines if all(part in line for part in parts)]

    def stop(self) -> None:
        """Warm shutdown (SIGTERM) by pid; SIGKILL to its process group if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc is not None:  # what the worker said helps explain the failure
            print("\n".join(self.log_lines()[-30:]), file=sys.stderr)
        self.log.unlink(missing_ok=True)
