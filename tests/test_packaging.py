"""What ``python -m build`` makes: a wheel of the package alone and an sdist that can test itself.

The wheel holds ``celery_redislock`` and its metadata (the MIT ``LICENSE``
included) and nothing else: no tests, benchmarks or examples, and no path of
the machine that built it. The sdist holds what its own ``make test`` needs.
Skipped without the ``build`` package (``pip install -e '.[release]'``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip(
        "build", reason="python -m build needs the package build: pip install -e '.[release]'"
    )
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_wheel_holds_the_package_its_license_and_no_build_path(dist: Path) -> None:
    [wheel] = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        contents = b"".join(archive.read(name) for name in names)
    assert {name.split("/")[0] for name in names} == {"celery_redislock", "celery_redislock-0.1.0.dist-info"}
    assert "celery_redislock-0.1.0.dist-info/licenses/LICENSE" in names
    assert "celery_redislock/py.typed" in names
    assert str(ROOT).encode() not in contents and str(Path.home()).encode() not in contents


def test_the_sdist_holds_what_its_own_tests_need(dist: Path) -> None:
    [sdist] = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = ["LICENSE", "CHANGELOG.md", "README.md", "Makefile", "pyproject.toml", "tests/conftest.py"]
    needed += ["bench/chart.py", "bench/results/benchmarks.png", "examples/from_celery_once.py"]
    needed += ["docs/migrating.md", "docker-compose.yml", "Dockerfile"]
    assert sorted(set(needed) - names) == []


def test_benchmark_results_record_no_absolute_path() -> None:
    """A results file says how it was run (its arguments), with paths relative to the repository."""
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        recorded = json.loads(path.read_text())["args"]
        assert not [value for value in recorded.values() if str(value).startswith("/")], path
