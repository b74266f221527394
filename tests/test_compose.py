"""docker-compose.yml, checked without Docker; and, where a Docker engine runs, the demo on
Redis in a container (pytest-celery's Redis vendor)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from celery import Celery
from celery.bin.celery import celery

from celery_redislock import LockedTask
from examples._support import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
#: Services that run the image built from Dockerfile.
APP_SERVICES = {name: service for name, service in SERVICES.items() if "build" in service}


def option(command: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``command``, if given."""
    for index, word in enumerate(command[:-1]):
        if word in names:
            return command[index + 1]
    return None


def test_the_file_has_redis_a_worker_two_beats_and_a_producer() -> None:
    roles = {name: service["command"][:4] for name, service in APP_SERVICES.items()}
    assert set(SERVICES) == {"redis", *APP_SERVICES}
    assert SERVICES["redis"]["image"].startswith("redis:")
    assert sorted(name for name, command in roles.items() if command[-1] == "worker") == ["worker"]
    assert sorted(name for name, command in roles.items() if command[-1] == "beat") == ["beat-1", "beat-2"]
    assert roles["producer"][:3] == ["python", "-m", "examples.producer"]


def test_the_image_is_built_from_the_repository_with_the_package_and_the_examples() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copies = re.findall(r"^COPY (.+)$", dockerfile, flags=re.MULTILINE)
    copied = {source for line in copies for source in line.split()[:-1]}  # the last word is the target
    assert {"celery_redislock", "examples", "pyproject.toml", "README.md"} <= copied
    assert all((ROOT / path).exists() for path in copied)
    assert re.search(r"^RUN pip install .*\.$", dockerfile, flags=re.MULTILINE)
    assert {service["build"] for service in APP_SERVICES.values()} == {"."}


@pytest.mark.parametrize("name", sorted(APP_SERVICES))
def test_every_command_names_a_module_and_app_that_exist(name: str) -> None:
    command = APP_SERVICES[name]["command"]
    assert isinstance(command, list), f"{name}: command must be a list (no shell parsing)"
    if command[0] == "celery":
        module, _, attribute = str(option(command, "-A", "--app")).partition(":")
        app = getattr(importlib.import_module(module), attribute or "app")
        assert isinstance(app, Celery)
        subcommand = next(word for word in command[1:] if word in celery.commands)
        assert subcommand in ("worker", "beat")
        # the options given exist for that subcommand
        known = {flag for param in celery.commands[subcommand].params for flag in param.opts}
        given = {
            word.split("=")[0] for word in command[command.index(subcommand) + 1 :] if word.startswith("-")
        }
        assert given <= known, f"{name}: unknown options {given - known}"
    else:
        assert command[:2] == ["python", "-m"]
        assert callable(importlib.import_module(command[2]).main)
        helped = subprocess.run(
            [sys.executable, "-m", command[2], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert helped.returncode == 0, helped.stderr
        for flag in (word for word in command[3:] if word.startswith("--")):
            assert flag in helped.stdout, f"{name}: {command[2]} has no option {flag}"


def test_ports_and_environment_agree() -> None:
    [published] = SERVICES["redis"]["ports"]
    host, host_port, container_port = published.split(":")
    assert host == "127.0.0.1" and container_port == "6379"  # redis-server's default port
    assert "--port" not in SERVICES["redis"]["command"]
    assert (
        f"redis://127.0.0.1:{host_port}/0" in (ROOT / "docker-compose.yml").read_text()
    )  # the header's hint
    for name, service in APP_SERVICES.items():
        url = urlsplit(service["environment"]["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", int(container_port)), name
        assert url.hostname in SERVICES
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert "EXAMPLES_QUEUE" not in service["environment"], name  # all on the default queue
    assert "healthcheck" in SERVICES["redis"]
    assert option(APP_SERVICES["worker"]["command"], "-Q", "--queues") is None  # it consumes that queue


def test_the_two_beats_share_the_schedule_not_the_schedule_file() -> None:
    beats = [service["command"] for name, service in APP_SERVICES.items() if name.startswith("beat")]
    assert len({option(command, "-A", "--app") for command in beats}) == 1
    assert len({option(command, "-s", "--schedule") for command in beats}) == len(beats)
    config = importlib.import_module("examples.celeryconfig")
    tasks = importlib.import_module("examples.tasks")
    for entry in config.beat_schedule.values():
        assert entry["task"] in tasks.app.tasks


def test_every_job_the_beats_send_runs_once_per_slot() -> None:
    """Two beats send each entry twice per slot: each entry must be opted in to once-per-slot
    (``lock_beat`` on its LockedTask, or in its options), with an interval the beats read as
    the compose file sets it (no EXAMPLES_BEAT_EVERY: the 10 s default)."""
    config = importlib.import_module("examples.celeryconfig")
    tasks = importlib.import_module("examples.tasks")
    beats = {name: service for name, service in APP_SERVICES.items() if name.startswith("beat")}
    assert all("EXAMPLES_BEAT_EVERY" not in service["environment"] for service in beats.values())
    assert config.beat_schedule
    for name, entry in config.beat_schedule.items():
        task = tasks.app.tasks[entry["task"]]
        opted = (entry.get("options") or {}).get("lock_beat")
        if opted is None:
            assert isinstance(task, LockedTask), f"{name}: {entry['task']} is not a LockedTask"
            assert task.lock_options is not None
            opted = task.lock_options.beat
        assert opted is True, f"{name}: not opted in to once-per-slot (lock_beat)"
        assert entry["schedule"] == 10.0 and name == "digest-every-10s"
    # the beats need no leader for that: each slot's marker decides
    assert not tasks.app.conf.get("redislock_beat_leader")


# -- where a Docker engine runs ----------------------------------------------------------------


def docker_unavailable() -> str | None:
    """Why no Docker engine can be used here (``None`` if one answers), asked within 5 s."""
    try:
        done = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=5
        )
    except FileNotFoundError:
        return "no docker command"
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer within 5 s"
    if done.returncode != 0:
        return (
            "no Docker engine reachable: " + (done.stderr.strip().splitlines() or ["docker info failed"])[-1]
        )
    return None


def test_the_demo_runs_on_redis_in_a_container(request: pytest.FixtureRequest) -> None:
    """The demo's scenario (a prefork worker, duplicates, a long task, a killed child) on the
    Redis image pytest-celery runs, instead of a local redis-server."""
    reason = docker_unavailable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("pytest_celery", reason="pytest-celery is not installed: pip install -e '.[docker]'")
    broker = request.getfixturevalue("celery_redis_broker")
    url = f"redis://127.0.0.1:{broker.container.port}/0"
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo"],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "locks left in Redis: none" in done.stdout
