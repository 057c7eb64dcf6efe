"""Smoke and structure tests of benchmarks/gpu.py (issue 50, item 6), without a GPU: without
CUDA it says it cannot run, writes nothing and exits 0; its models export and run through the
Executor on the CPU, as they will on a GPU, the batched peer's dynamic-batch export and
bucketed batching too; it lists every section, peer and issue-50 target, and each target
reads peers it has; its warm-up stops when a round leaves the capture counts unchanged, and
only then. What needs CUDA (timing, CUDA graphs of eager per thread) is not run here."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph import Executor
from asyncgraph.cuda.capture import MAX_CAPTURES
from benchmarks import gpu

pytestmark = pytest.mark.usefixtures("leak_check")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.timeout(120)
def test_without_cuda_it_says_it_cannot_run_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick", "--json", str(out)], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot run" in proc.stdout and "Nothing was measured" in proc.stdout
    assert not out.exists()  # no figures: no JSON that could pass for a run


@pytest.mark.timeout(120)
async def test_the_benchmark_models_match_eager_through_the_executor() -> None:
    for name, (model, x) in gpu.models().items():
        model.eval()
        small = x[:2]
        ep = torch.export.export(model, (small,))
        async with Executor(ep) as ex:
            out = await ex.execute(small)
        with torch.no_grad():
            torch.testing.assert_close(out, model(small), msg=name)


# -- structure: sections, peers, targets -----------------------------------------------------


def test_every_section_lists_its_peers_and_the_defaults_measure_steady_state() -> None:
    keys = {(p.section, p.key) for p in gpu.PEERS}
    assert len(keys) == len(gpu.PEERS)  # no peer twice
    by_section = {s: {p.key for p in gpu.PEERS if p.section == s} for s in gpu.SECTIONS}
    assert by_section[gpu.ONE_CALLER] == {
        "asyncgraph-captured", "asyncgraph-uncaptured", "eager", "graph-of-eager",
        "torch-compile"}
    assert by_section[gpu.MANY_CALLERS] == {
        "asyncgraph", "asyncgraph-batched", "to-thread-eager", "thread-graphs"}
    assert by_section[gpu.STREAMS] == {
        f"{g}-{n}" for g in ("captured", "uncaptured") for n in ("1", "4", "auto")}
    assert gpu.peer(gpu.BASELINE).section == gpu.MANY_CALLERS
    assert all(p.asyncgraph == p.key.startswith(("asyncgraph", "captured", "uncaptured"))
               for p in gpu.PEERS)
    args = gpu.parse_args([])
    assert (args.callers, args.iterations) == (64, 50)
    assert args.rounds >= 50 and 2 <= args.max_warm_rounds <= 50
    assert args.models == list(gpu.MODEL_NAMES) == list(gpu.models())
    with pytest.raises(SystemExit):
        gpu.parse_args(["--models", "encoder,resnet"])


def test_every_issue_50_target_is_listed_and_reads_peers_the_benchmark_has() -> None:
    report = gpu.report_module()
    targets = report.ISSUE50_TARGETS
    assert report.ISSUE50_MODELS == gpu.MODEL_NAMES
    assert (report.ONE_CALLER, report.MANY_CALLERS, report.BASELINE) == (
        gpu.ONE_CALLER, gpu.MANY_CALLERS, gpu.BASELINE)
    bounds = {(t.key, t.model): (t.op, t.bound) for t in targets}
    assert bounds == {
        ("unbatched", "encoder"): (">=", 2), ("unbatched", "cnn"): (">=", 5),
        ("unbatched", "wide-mlp"): (">=", 5),
        ("batched", "encoder"): (">=", 3), ("batched", "cnn"): (">=", 10),
        ("batched", "wide-mlp"): (">=", 10),
        **{("one-caller", m): ("<=", 1.15) for m in gpu.MODEL_NAMES},
        **{("loop-lag", m): ("<=", 2.0) for m in gpu.MODEL_NAMES},
        ("wrong-outputs", None): ("<=", 0),
    }
    sections = {p.key: p.section for p in gpu.PEERS}
    for key, reads in report.TARGET_PEERS.items():
        for section, name in reads:
            assert sections.get(name) == section, (key, section, name)


def test_the_targets_of_a_run_that_measured_nothing_have_no_figure(tmp_path: Path) -> None:
    args = gpu.parse_args(["--json", str(tmp_path / "b.json")])
    results = gpu.Results(args.json, args)
    try:
        raise RuntimeError("dynamic export failed")
    except RuntimeError as exc:
        results.error(gpu.MANY_CALLERS, "cnn", "asyncgraph-batched", exc)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["complete"] is False and saved["errors"][0]["peer"] == "asyncgraph-batched"
    rows = gpu.report_module().target_rows(saved, None)
    assert len(rows) == len(gpu.report_module().ISSUE50_TARGETS)
    assert {r.verdict for r in rows} == {"no figure"}
    batched_cnn = next(r for r in rows if (r.target.key, r.target.model) == ("batched", "cnn"))
    assert "raised RuntimeError: dynamic export failed" in batched_cnn.figure


def test_batch_buckets_are_whole_requests_within_max_captures() -> None:
    assert gpu.batch_buckets(8, 64) == (8, 16, 32, 64, 128, 256, 512)
    assert gpu.batch_buckets(16, 1) == (16,)
    assert gpu.batch_buckets(4, 6) == (4, 8, 16, 24)
    for rows, callers in ((8, 64), (64, 64), (1, 128)):
        assert len(gpu.batch_buckets(rows, callers)) <= MAX_CAPTURES


# -- the warm-up rule ------------------------------------------------------------------------


def _stats_after_rounds(captures: list[int]) -> Any:
    """A statistics reader whose `captures` is captures[k] after round k (then the last)."""
    state = {"round": 0}

    async def one_round() -> None:
        state["round"] += 1

    def stats() -> dict[str, Any]:
        k = min(state["round"], len(captures) - 1)
        return {"captures": captures[k], "warmups": 2, "replays": 100 * state["round"]}

    return one_round, stats, state


def test_warm_up_runs_until_a_whole_round_captures_nothing() -> None:
    one_round, stats, state = _stats_after_rounds([0, 1, 4, 8, 8])
    rounds, settled = asyncio.run(gpu.warm_until_settled(one_round, stats, max_rounds=20))
    assert (rounds, settled) == (4, True)  # round 4 captured nothing (replays do not count)
    assert state["round"] == 4


def test_warm_up_is_bounded_and_says_when_captures_never_stopped() -> None:
    one_round, stats, _ = _stats_after_rounds(list(range(100)))
    assert asyncio.run(gpu.warm_until_settled(one_round, stats, max_rounds=5)) == (5, False)


def test_warm_up_of_a_peer_without_statistics_is_the_minimum() -> None:
    rounds: list[int] = []

    async def one_round() -> None:
        rounds.append(1)

    result = asyncio.run(gpu.warm_until_settled(one_round, lambda: None, max_rounds=20))
    assert result == (gpu.MIN_WARM_ROUNDS, True) and len(rounds) == gpu.MIN_WARM_ROUNDS


def test_statistics_deltas_and_wrong_outputs() -> None:
    before = {"captures": 8, "replays": 10, "capturable": True, "failed": []}
    after = {"captures": 8, "replays": 74, "capturable": True, "failed": []}
    assert gpu.stats_delta(before, after) == {"captures": 0, "replays": 64}
    assert gpu.stats_delta(None, after) == {}
    ref = torch.ones(4, 3)
    wrong, worst = gpu.count_wrong([ref.clone(), ref + 1e-4, ref * 2], ref)
    assert wrong == 1 and worst == pytest.approx(1.0)
    line = gpu.stats_line({**after, "instances": 8, "instance_waits": 3, "lease_failures": 0})
    for name in ("captures", "replays", "fallbacks", "instances", "instance_waits",
                 "lease_failures"):
        assert f"{name} " in line


# -- the batched peer's program and config, on the CPU ---------------------------------------


@pytest.mark.timeout(120)
async def test_the_batched_peer_matches_eager_through_the_executor_on_the_cpu() -> None:
    model, x = gpu.models()["wide-mlp"]
    model.eval()
    x = x[:2]
    callers = 4
    ep = gpu.dynamic_batch_export(model, x, callers)
    config = gpu.batched_config(x.shape[0], callers)
    assert config.cuda.graphs and config.batching is not None
    assert config.batching.buckets == (2, 4, 8)
    assert gpu.unbatched_config(64).max_concurrent_executions == 64
    async with Executor(ep, config) as ex:
        outs = await asyncio.gather(*(ex.execute(x) for _ in range(callers - 1)))
        stats = ex.batching_statistics()
    with torch.no_grad():
        expected = model(x)
    for out in outs:
        torch.testing.assert_close(out, expected)
    assert stats is not None and stats.requests == callers - 1
    assert set(stats.by_size) <= set(config.batching.buckets)  # every batch padded to a bucket
    assert stats.padded_rows > 0  # 3 requests of 2 rows: 6 rows, never a bucket


# -- the per-thread CUDA-graph peer's start, with the capture itself stubbed ---------------------


class _Recorded(gpu.ThreadGraphs):
    """ThreadGraphs whose `_capture` (CUDA) only records the thread, or raises on `fail_on`."""

    def __init__(self, workers: int, fail_on: int | None = None) -> None:
        super().__init__(torch.nn.Identity(), torch.zeros(1), workers)
        self.threads: list[int] = []
        self.fail_on = fail_on

    def _capture(self) -> Any:
        import threading

        self.threads.append(threading.get_ident())
        if len(self.threads) == self.fail_on:
            raise RuntimeError("capture failed: operation not permitted when stream is capturing")
        return None


@pytest.mark.timeout(30)
def test_every_worker_thread_captures_its_own_graph_once_before_timing() -> None:
    graphs = _Recorded(workers=5)
    try:
        graphs.start()
    finally:
        graphs.close()
    assert graphs.captured == 5
    assert len(set(graphs.threads)) == 5  # one per worker: no worker took two


@pytest.mark.timeout(30)
def test_a_worker_whose_capture_fails_stops_the_others_waiting() -> None:
    """The others would wait at the barrier for its 300 s timeout (past the bench phase's
    limit); the failed one aborts the barrier, so `start` raises the capture's error."""
    graphs = _Recorded(workers=4, fail_on=2)
    try:
        with pytest.raises(RuntimeError, match="capture failed"):
            graphs.start()
    finally:
        graphs.close()
    assert graphs.captured < 4
