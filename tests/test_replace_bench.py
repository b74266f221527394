"""bench/replace_bench.py at its smallest: fewer calls than threads still sends every call."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from examples._support import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # it imports lock_bench by name
_spec = importlib.util.spec_from_file_location("replace_bench", ROOT / "bench" / "replace_bench.py")
assert _spec is not None and _spec.loader is not None
replace_bench: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replace_bench)


def test_fewer_calls_than_threads_are_all_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--calls 2 --threads 4``: two threads send a call each (no thread sent ``2 // 4`` calls,
    a rate of 0 calls/s, and a ZeroDivisionError in the ratio)."""
    out = tmp_path / "replace.json"
    monkeypatch.setattr(
        sys, "argv", ["replace_bench.py", "--calls", "2", "--threads", "4", "--json", str(out)]
    )
    replace_bench.main()
    results = json.loads(out.read_text())
    assert results["replace_calls_per_s"] > 0 and results["refused_calls_per_s"] > 0
