"""The lock metrics of a worker, for Prometheus: OpenTelemetry's Prometheus exporter.

A worker of your own loads this module with ``-I`` (``--include``)::

    celery -A examples.tasks worker -P prefork -c 2 -I examples.prometheus_worker

Its main process serves http://127.0.0.1:9464/metrics (``METRICS_PORT``): the
crash releases, counted there. Each prefork pool child runs the tasks and serves
its own port, ``METRICS_PORT + 1 + its index`` (Celery's ``%I``, which a new
child takes over from the one it replaces): scrape them all. Threads, gevent or
solo pools: the main process's port alone.

Run: ``python -m examples.prometheus_worker`` from the repository's root starts such
a worker, runs a task twice at once and prints the child's ``redislock_`` lines.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import urllib.request
from typing import Any

from billiard.process import current_process
from celery.signals import worker_init, worker_process_init
from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server

#: The main process's port; pool child ``i`` serves ``PORT + 1 + i``.
PORT = int(os.environ.get("METRICS_PORT", "9464"))
#: Where Linux says which ports a bind to port 0 takes.
EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


@worker_init.connect
def _export_from_the_main_process(**_: Any) -> None:
    """Before the pool starts: the SDK's provider, read by the exporter, served on ``PORT``."""
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    start_http_server(PORT, addr="127.0.0.1")


@worker_process_init.connect
def _export_from_a_pool_child(**_: Any) -> None:
    """A prefork child inherits the provider; it serves its own counts on a port of its own."""
    index: int = getattr(current_process(), "index", 0)  # set on each child by billiard's pool
    start_http_server(PORT + 1 + index, addr="127.0.0.1")


def free_ports(count: int) -> int:
    """A port P such that P to P + count - 1 are all free on 127.0.0.1 now, below the kernel's
    ephemeral range (``ip_local_port_range``): the worker binds them only later, and meanwhile
    a bind to port 0 (any other program's, a parallel test's server) takes its port from that
    range, never one of these."""
    try:
        with open(EPHEMERAL_PORTS) as ranges:  # Linux: "32768 60999" by default
            ephemeral = int(ranges.read().split()[0])
    except OSError:
        ephemeral = 49152  # elsewhere (macOS, the BSDs): IANA's dynamic ports
    while True:
        port = random.randrange(10_000, ephemeral - count)
        with contextlib.ExitStack() as probes:
            try:
                for each in range(port, port + count):
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", each))
            except OSError:  # one of them is taken: try others
                continue
            return port


def scrape(port: int) -> list[str]:
    """The ``redislock_`` lines of the metrics served on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return [line for line in text.splitlines() if line.startswith("redislock_")]


def main() -> None:
    from examples._support import QUEUE, CeleryProcess, redis_url, say
    from examples.tasks import sync_account

    port = int(os.environ.get("METRICS_PORT") or free_ports(3))  # the main process and 2 children
    with redis_url():
        name = f"metrics-{os.getpid()}"
        args = [
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-Q",
            QUEUE,
            "-n",
            f"{name}@%h",
            "-I",
            "examples.prometheus_worker",
        ]
        args += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
        with CeleryProcess(name, args, (f"{name}@", "ready."), {"METRICS_PORT": str(port)}):
            results = [sync_account.delay(3) for _ in range(2)]
            for result in results:
                result.get(timeout=60)
                result.forget()
            say("two sync_account(3) at once in a 2-process worker: one waited for the other's lock")
            lines = sorted(line for child in (1, 2) for line in scrape(port + child))
            main_lines = scrape(port)  # it runs no task; a dead pool child's crash releases count there
        say(f"the worker's main process serves port {port} ({len(main_lines)} redislock_ lines)")
        say(f"the pool children's metrics (ports {port + 1} and {port + 2}), their lock outcomes:")
        for line in lines:
            if line.startswith(("redislock_lock_acquisitions_total", "redislock_lock_wait_seconds_count")):
                say(f"  {line}")


if __name__ == "__main__":
    main()
