"""benchmarks/first_burst.py runs and reports a lag per round, cold and warm (structure only:
the figures are the benchmark's, never asserted here)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime", reason="the default path's fast form needs onnxruntime")
pytest.importorskip("onnxscript", reason="the default path's fast form needs onnxruntime")

from benchmarks import first_burst

pytestmark = pytest.mark.timeout(300)


def test_each_graph_and_cache_state_reports_its_rounds_and_worst_lag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import os

    cache = os.environ.get("ASYNCGRAPH_CACHE_DIR")
    first_burst.main(["--graph", "mlp", "--rounds", "2", "--json"])
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert [c["case"] for c in cases] == ["mlp, cold cache", "mlp, warm cache"]
    for case in cases:
        assert len(case["rounds"]) == 2
        (target,) = case["targets"]
        assert target["number"] == 54 and target["op"] == "<=" and target["limit"] == 5.0
        worst = max(r["lag_p99_ms"] for r in case["rounds"])  # rounded to 0.01 ms there
        assert target["value"] == pytest.approx(worst, abs=0.01)
    assert os.environ.get("ASYNCGRAPH_CACHE_DIR") == cache  # the test process's, put back
