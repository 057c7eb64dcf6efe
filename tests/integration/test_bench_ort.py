"""The ONNX Runtime peer of the benchmark suite (benchmarks/ort.py, `asyncgraph bench -s
onnxruntime`): structure and outputs only, never a time.

The quick scenario runs where onnxruntime, onnx and onnxscript are installed (the
`onnxruntime` extra); the rest runs everywhere: the scenario's registration, its skip without
onnxruntime, and the batcher written around ORT, on a fake session.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.soak import full_soak

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph.bench import suite
from asyncgraph.bench.harness import Settings
from benchmarks import ort

pytestmark = pytest.mark.usefixtures("leak_check")

WHY = "onnxruntime, onnx and onnxscript: pip install -e '.[onnxruntime]'"


def test_onnxruntime_runs_only_when_named() -> None:
    assert "onnxruntime" not in suite.select(None)
    assert suite.select(["onnxruntime", "chain"]) == ["chain", "onnxruntime"]
    with pytest.raises(ValueError, match=r"choose from .*onnxruntime"):
        suite.select(["onnx"])


async def test_skipped_with_the_reason_without_onnxruntime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ort, "check_onnxruntime", lambda: "onnxruntime: not importable")
    report = await suite.run_scenarios(["onnxruntime"], Settings(size="tiny"))
    data = json.loads(suite.to_json(report))
    [case] = data["cases"]
    assert case["peers"] == [] and case["targets"] == []
    assert case["metrics"]["skipped"] == "onnxruntime: not importable"
    assert data["ok"] and data["mismatches"] == []


class FakeSession:
    """What OrtBatcher uses of an InferenceSession: inputs' names and run(); doubles the
    input, records each batch's rows, and fails a batch holding a row of -1."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def get_inputs(self) -> list[Any]:
        class Input:
            name = "x"

        return [Input()]

    def run(self, outputs: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = feeds["x"]
        self.batches.append(len(x))
        if (x == -1).any():
            raise RuntimeError("bad row")
        return [x * 2]


async def test_ort_batcher_batches_up_to_max_rows_two_in_flight() -> None:
    session = FakeSession()
    batcher = ort.OrtBatcher(session, max_rows=8, in_flight=2)
    xs = [torch.full((1, 3), float(i)) for i in range(40)]
    outs = await asyncio.gather(*(batcher(x) for x in xs))
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, x * 2)
    assert sum(session.batches) == 40 and max(session.batches) == 8
    assert batcher.batches == len(session.batches) and batcher.rows == 40
    # a batch that fails fails its requests; the batcher goes on
    results = await asyncio.gather(batcher(torch.full((1, 3), -1.0)), batcher(xs[1]),
                                   return_exceptions=True)
    assert isinstance(results[0], RuntimeError) and batcher._running == 0
    torch.testing.assert_close(await batcher(xs[2]), xs[2] * 2)


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of ONNX exports for the module: the quick scenario runs on each event loop,
    and the second run reads the first one's exports (about 25 s of exporting saved)."""
    return tmp_path_factory.mktemp("onnx-exports")


@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_factories=["asyncio"])  # the benchmark's structure, not the loop's
@full_soak("~30 s of ONNX exports and timed rounds")
async def test_quick_scenario_runs_every_peer_and_matches(
    export_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asyncgraph bench -s onnxruntime --quick`'s scenario, two rounds, exports in a
    temporary folder: every case and peer is there, every output matched asyncgraph's, every
    ratio was taken."""
    for module in ("onnxruntime", "onnx", "onnxscript"):
        pytest.importorskip(module, reason=WHY)
    monkeypatch.setattr(ort, "CACHE", export_cache)
    report = await suite.run_scenarios(
        ["onnxruntime"], Settings(size="quick", rounds=2, warmup=0))
    data = json.loads(suite.to_json(report))

    assert data["settings"]["size"] == "quick"
    assert data["mismatches"] == []
    assert [c["case"] for c in data["cases"]] == [
        "mlp latency", "mlp x 64 callers", "bert latency", "bert x 64 callers",
        "encoder latency", "encoder x 64 callers",
    ]
    ort_latency = {ort.ort_name(t) for t in ort.ORT_THREADS}
    ort_concurrent = {f(t) for t in ort.ORT_THREADS
                      for f in (ort.ort_thread_name, ort.ort_batcher_name)}
    for case in data["cases"]:
        names = [p["name"] for p in case["peers"]]
        assert names[0] == ort.PLAIN, case["case"]
        assert not {ort.COMPILED, ort.AUTOTUNED} & set(names), "--quick compiles nothing"
        if case["columns"] == "time":
            onnx_segments = {ort.onnx_segments_name(t) for t in ort.ORT_THREADS}
            assert ort.ONNX_SEGMENTS in onnx_segments and len(onnx_segments) == 2
            assert set(names) == {ort.PLAIN, ort.SCRIPTED, ort.DEFAULT, "eager model(x)"} \
                | ort_latency | onnx_segments
            assert case["params"]["onnxruntime_reference"] in ort_latency
            # issue 40's: plain, scripted, ONNX segments of 1 and 2 threads; 54's: default path
            assert len(case["targets"]) == 5
        else:
            assert set(names) == {ort.PLAIN, ort.SCRIPTED, ort.BATCHED, ort.SCRIPTED_BATCHED,
                                  ort.ONNX_SEGMENTS, ort.ONNX_BATCHED, ort.ONNX_BATCHED_SMALL,
                                  ort.DEFAULT, ort.DEFAULT_BATCHED} | ort_concurrent
            assert case["params"]["callers"] == 64
            assert 1 <= case["params"]["mean_batch_rows"] <= ort.MAX_BATCH
            # issue 40's: 3 unbatched, 4 batched vs to_thread, 4 vs the batcher; 54's: the
            # default path unbatched, batched vs to_thread and vs the batcher
            assert len(case["targets"]) == 14
            # the default path's verdicts, reached under the load measured
            assert "default path, unbatched verdicts (loaded)" in case["params"]
            assert "default path, batched verdicts (loaded)" in case["params"]
        for peer in case["peers"]:
            where = f"{case['case']} / {peer['name']}"
            assert peer["matched"] is True, f"{where}: {peer['error']}"
            assert not peer["failed"], where
            assert peer["samples"] == 2, where
            if case["columns"] == "time":
                assert peer["median_s"] > 0, where
            else:
                assert peer["extra"]["throughput"] > 0, where
        for target in case["targets"]:
            issue = ort.DEFAULT_ISSUE if "default path" in target["name"] else ort.ISSUE
            assert target["number"] == issue, target["name"]
            assert target["value"] is not None and target["value"] > 0, target["name"]
            assert target["rounds"] is not None, target["name"]
    assert _exports(export_cache) == 2 * len(ort.GRAPHS)  # static and dynamic batch


def _exports(folder: Path) -> int:
    return len(list(folder.rglob("*.onnx")))
