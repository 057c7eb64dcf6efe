"""scripts/bench_record.py --runs N: every run kept, each target's spread, the median run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def bench_record() -> ModuleType:
    path = ROOT / "scripts" / "bench_record.py"
    spec = importlib.util.spec_from_file_location("bench_record", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_runs_record_the_spread_and_quote_the_median_run(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"  # one run's targets: the next line of VALUES each time
    script.write_text(
        "import json, pathlib\n"
        "VALUES = [[1.0, 10.0], [3.0, 30.0], [2.0, 20.0]]\n"
        "count = pathlib.Path(__file__).with_name('count')\n"
        "n = int(count.read_text()) if count.exists() else 0\n"
        "count.write_text(str(n + 1))\n"
        "a, b = VALUES[n]\n"
        "targets = [{'name': 'a', 'value': a}, {'name': 'b', 'value': b},\n"
        "           {'name': 'unmeasured', 'value': None}]\n"
        "print(json.dumps({'cases': [{'targets': targets}]}))\n")
    out = tmp_path / "r.json"
    assert bench_record().main([str(out), "--runs", "3", "--", sys.executable, str(script)]) == 0
    record = json.loads(out.read_text())
    assert record["spread"]["a"] == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [1.0, 3.0, 2.0]}
    assert record["median_run"] == 2 and record["report"]["cases"][0]["targets"][0]["value"] == 2.0
    assert [sorted(r["targets"]) for r in record["runs"]] == [["a", "b"]] * 3
    assert all({"started_utc", "load_average_start", "load_average_end", "wall_s"} <= set(r)
               for r in record["runs"])


def test_a_failing_run_fails_the_record(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = bench_record().main([str(out), "--runs", "2", "--", sys.executable, "-c",
                                "raise SystemExit(3)"])
    assert code == 3 and not out.exists()
