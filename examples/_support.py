"""What the runnable examples share: a Redis to use, worker and beat subprocesses, all stopped by pid."""

from __future__ import annotations

import os
import shutil
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
#: Longest wait for a worker or beat to start or stop.
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


class CeleryProcess:
    """A ``celery -A examples.tasks ...`` subprocess in a session of its own, stopped by its pid.

    Its log goes to a temporary file (``log_lines()``); ``with process:``
    starts it, waits until its log has a line with every one of ``ready``,
    and stops it. ``env`` is added to the environment it inherits when started.
    """

    def __init__(self, name: str, args: list[str], ready: tuple[str, ...], env: dict[str, str]) -> None:
        self.name = name
        self.args = [sys.executable, "-m", "celery", "-A", "examples.tasks", *args]
        self.ready = ready
        self.env = env
        fd, log = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} is not started"
        return self.process.pid

    def launch(self) -> None:
        """Start the process, without waiting for it to be ready (see ``start``)."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                cwd=ROOT,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        """Wait for the ready line; stop the process and raise ``RuntimeError`` if none comes."""
        try:
            self.wait_for_log(*self.ready)
        except RuntimeError:
            self.stop()
            raise

    def start(self) -> CeleryProcess:
        """Start the process and wait until it is ready."""
        self.launch()
        self.wait_ready()
        return self

    def wait_for_log(self, *parts: str, timeout: float = WORKER_TIMEOUT) -> list[str]:
        """The log lines that contain every one of ``parts``, once there is one;
        ``RuntimeError`` with the log's end if none comes within ``timeout`` or the process exits."""
        deadline = time.monotonic() + timeout
        while not (lines := self.log_lines(*parts)):
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log_lines()[-30:])
                raise RuntimeError(
                    f"{self.name} did not log {' ... '.join(parts)!r}; its log ends with:\n{tail}"
                )
            time.sleep(0.02)  # a polling step with a deadline
        return lines

    def log_lines(self, *parts: str) -> list[str]:
        """The process's log lines that contain every one of ``parts``."""
        lines = self.log.read_text(errors="replace").splitlines()
        return [line for line in lines if all(part in line for part in parts)]

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM, by pid), without waiting (see ``stop``)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM) by pid; SIGKILL to its process group if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.terminate()
        try:
            self.process.wait(timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def cleanup(self) -> None:
        """Remove what the process left on disk (its log); called once it is stopped."""
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> CeleryProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc is not None:  # what the process said helps explain the failure
            print(f"--- {self.name}'s log ends with:", file=sys.stderr)
            print("\n".join(self.log_lines()[-30:]), file=sys.stderr)
        self.cleanup()


class Worker(CeleryProcess):
    """``celery -A examples.tasks worker`` (prefork) on the examples' queue; ready when it consumes."""

    def __init__(self, concurrency: int = 2, name: str = "example") -> None:
        name = f"{name}-{os.getpid()}"
        args = ["worker", "-P", "prefork", "-c", str(concurrency), "-Q", QUEUE, "-n", f"{name}@%h"]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
        super().__init__(name, args, (f"{name}@", "ready."), {})

    def __enter__(self) -> Worker:
        self.start()
        return self


class Beat(CeleryProcess):
    """``celery beat`` for the example app, sending ``examples.celeryconfig.beat_schedule``
    (its job every ``every`` seconds) with a schedule file of its own, in a temporary
    directory named after the beat and removed when the beat is stopped."""

    def __init__(self, name: str, every: float) -> None:
        name = f"{name}-{os.getpid()}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        args = ["beat", "-l", "INFO", "-s", str(self.dir / "schedule")]
        super().__init__(name, args, ("beat: Starting...",), {"EXAMPLES_BEAT_EVERY": str(every)})

    def cleanup(self) -> None:
        super().cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Beat:
        self.start()
        return self
