"""Smoke test of the benchmark suite: tiny sizes, one round, structure and outputs only.

Timing is never asserted here (a shared CI machine decides nothing about speed); what is
checked is that every scenario runs, every peer produced a result, every peer's output matched
asyncgraph's, and the JSON report has the shape `asyncgraph bench --json` promises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph.bench import suite
from asyncgraph.bench.harness import Settings
from asyncgraph.tools.profile import collect, example_inputs

pytestmark = pytest.mark.usefixtures("leak_check")

EXPECTED_CASES = {
    "chain": ["chain"],
    "transformer": ["transformer (export)", "transformer (core-aten)"],
    "wide": ["wide", "wide (skewed)"],
    "concurrent": ["concurrent"],
    "memory": ["memory"],
    "steady_state": ["steady_state"],
}


async def test_suite_tiny_runs_every_peer_and_matches() -> None:
    report = await suite.run_scenarios(list(suite.SCENARIOS), Settings(size="tiny"))
    data = json.loads(suite.to_json(report))

    assert set(data) >= {"environment", "settings", "elapsed_s", "ok", "failures", "cases"}
    assert data["settings"]["size"] == "tiny"
    cases = [c["case"] for c in data["cases"]]
    assert cases == [c for names in EXPECTED_CASES.values() for c in names]
    assert data["mismatches"] == []
    for case in data["cases"]:
        assert case["peers"][0]["name"].startswith("asyncgraph")
        assert len(case["peers"]) >= 3, case["case"]
        for peer in case["peers"]:
            where = f"{case['case']} / {peer['name']}"
            assert peer["matched"] is True, f"{where}: {peer['error']}"
            assert not peer["failed"], where
            assert peer["samples"] >= 1, where
            if case["columns"] == "time":
                assert peer["median_s"] is not None and peer["median_s"] > 0, where
            else:
                assert peer["extra"], where
        for target in case["targets"]:
            assert set(target) >= {"number", "name", "value", "op", "limit", "met"}
            assert target["value"] is not None, f"{case['case']}: {target['name']}"
    numbers = {t["number"] for c in data["cases"] for t in c["targets"]}
    assert numbers == {1, 2, 3, 4, 5, 6}


def test_select_rejects_unknown_scenarios() -> None:
    assert suite.select(["wide", "chain"]) == ["chain", "wide"]
    with pytest.raises(ValueError, match="unknown scenario"):
        suite.select(["nope"])


async def test_scenarios_run_without_dask_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """dask is a peer, not a dependency (issue 53 item 6: the suite imported it, so an
    installed `asyncgraph bench` needed it): where it does not import, every scenario that
    times it runs without its peers, and each of those cases says so in one line."""
    for name in [m for m in sys.modules if m.partition(".")[0] == "dask"] + ["dask"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import dask...` now fails
    report = await suite.run_scenarios(["chain", "memory"], Settings(size="tiny"))

    assert [case.case for case in report.cases] == ["chain", "memory"]
    for case in report.cases:
        names = [peer.name for peer in case.peers]
        assert not [n for n in names if n.startswith("dask")], names
        assert all(peer.matched for peer in case.peers), case.case
        [note] = case.notes
        assert note.startswith("dask peers left out: dask is not importable")
        assert "pip install dask (asyncgraph's dev extra has it)" in note
    console = Console(record=True, width=300)
    suite.render(report, console)
    assert console.export_text().count("dask peers left out") == 2


async def test_with_dask_its_peers_run_and_no_note_is_added() -> None:
    report = await suite.run_scenarios(["memory"], Settings(size="tiny"))
    [case] = report.cases
    assert {"dask get_sync", "dask threaded"} <= {peer.name for peer in case.peers}
    assert case.notes == []


def test_optional_scenarios_have_the_names_their_modules_give() -> None:
    for name, module in suite.OPTIONAL.items():
        assert name == suite.checkout_module(module).NAME


async def test_an_optional_scenario_without_a_checkout_is_skipped_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """From a wheel install `-s onnxruntime` finds no benchmarks/ort.py: one skipped case
    naming the script and how to run it, not a traceback."""
    monkeypatch.setitem(sys.modules, "benchmarks", None)
    monkeypatch.setitem(sys.modules, "benchmarks.ort", None)
    monkeypatch.setattr(suite, "CHECKOUT", tmp_path)
    report = await suite.run_scenarios(["onnxruntime"], Settings(size="tiny"))

    [case] = report.cases
    assert case.case == "onnxruntime (skipped)" and case.peers == []
    assert case.metrics["skipped"] == (
        "benchmarks.ort is a script of asyncgraph's source checkout (benchmarks/), run there "
        f"with `python -m benchmarks.ort`; none is importable here or next to the package "
        f"({tmp_path})"
    )
    assert not report.failures and not report.mismatches


async def test_profile_collects_every_node(tmp_path: Path) -> None:
    import asyncgraph

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ep = torch.export.export(model, (torch.randn(3, 8),))
    path = tmp_path / "m.pt2"
    torch.export.save(ep, path)
    ex = asyncgraph.Executor(path, asyncgraph.ExecutorConfig(trace=True))
    try:
        metrics = await collect(ex, example_inputs(ex), runs=2, warmup=1)
    finally:
        await ex.aclose()
    assert metrics.total_nodes_count == ex.plan.num_nodes == len(metrics.time_per_node)
    assert sum(metrics.instances_per_node_type.values()) == metrics.total_nodes_count
    assert sum(metrics.placement_counts.values()) == metrics.total_nodes_count
    assert abs(sum(metrics.percent_per_node_type.values()) - 100) < 1e-6
    assert all(n.mean_us > 0 for n in metrics.time_per_node)
    assert json.loads(json.dumps(metrics.as_dict()))["runs"] == 2


class _Elementwise(torch.nn.Module):
    """Many tiny elementwise ops: every node is placed inline, on the loop thread."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(20):
            x = x * 1.001 + 0.01
            x = torch.relu(x) if i % 2 else x
        return x


async def test_profile_times_of_an_inline_model_add_up(tmp_path: Path) -> None:
    """Issue #37: node time (a mean) against wall (a median) made `wall - node time` negative.
    Every figure is now a mean over the same executions: wall = nodes running + no node
    running, with no node running >= 0, and on one thread summed node time = nodes running
    = critical path."""
    import asyncgraph

    ep = torch.export.export(_Elementwise(), (torch.randn(4, 8),))
    ex = asyncgraph.Executor(ep, asyncgraph.ExecutorConfig(trace=True))
    try:
        metrics = await collect(ex, example_inputs(ex), runs=30, warmup=2)
    finally:
        await ex.aclose()
    assert set(metrics.placement_counts) == {"inline"}, metrics.placement_counts
    assert metrics.outside_nodes_us >= 0
    assert metrics.wall_time_us == pytest.approx(
        metrics.busy_time_us + metrics.outside_nodes_us)
    assert metrics.wall_time_us >= metrics.busy_time_us >= metrics.critical_path_us > 0
    assert metrics.total_time_us == pytest.approx(sum(n.mean_us for n in metrics.time_per_node))
    # one thread: no two spans overlap, and the graph is one chain
    assert metrics.total_time_us == pytest.approx(metrics.busy_time_us)
    assert metrics.critical_path_us == pytest.approx(metrics.busy_time_us)


async def test_profile_a_slow_execution_weighs_on_wall_and_node_time_alike() -> None:
    """The reported case: one execution's node stalls (a GC pause, a preemption). Node time
    was a mean and wall a median, so the stall raised one and not the other and `wall - node
    time` went negative; both are now means over the same executions."""
    import time

    import asyncgraph

    calls = 0

    def stall_once(x: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 5:  # the 3rd profiled execution, after the 2 warm-up ones
            time.sleep(0.05)
        return x + 1

    b = asyncgraph.GraphBuilder()
    v = b.input("x")
    v = b.call(stall_once, v, placement="inline")
    for _ in range(10):
        v = b.call(lambda x: x + 1, v, placement="inline")
    b.output(v)
    ex = asyncgraph.Executor(b.build(), asyncgraph.ExecutorConfig(trace=True))
    try:
        metrics = await collect(ex, [1], runs=20, warmup=2)
    finally:
        await ex.aclose()
    assert calls == 22
    assert metrics.outside_nodes_us >= 0
    assert metrics.wall_time_us >= metrics.busy_time_us == pytest.approx(metrics.total_time_us)
    # the stall is in the node's mean and in the wall's mean: >= 50 ms / 20 runs each
    assert metrics.time_per_node[0].mean_us >= 50_000 / 20
    assert metrics.wall_time_us >= metrics.time_per_node[0].mean_us


async def test_profile_times_of_a_parallel_model_are_ordered(tmp_path: Path) -> None:
    """Nodes overlapping on worker threads: summed node time may pass the wall, but nodes
    running (the union of the spans) and the critical path never do."""
    import asyncgraph

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ls = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum((torch.relu(layer(x)) for layer in self.ls), torch.zeros(()))

    ep = torch.export.export(Wide().eval(), (torch.randn(32, 128),))
    config = asyncgraph.ExecutorConfig(trace=True, max_parallel_ops=2)
    ex = asyncgraph.Executor(ep, config)
    try:
        metrics = await collect(ex, example_inputs(ex), runs=10, warmup=2)
    finally:
        await ex.aclose()
    assert metrics.outside_nodes_us >= 0
    assert metrics.wall_time_us >= metrics.busy_time_us >= metrics.critical_path_us > 0
    assert metrics.total_time_us >= metrics.busy_time_us * (1 - 1e-9)
    assert metrics.total_time_us == pytest.approx(sum(n.mean_us for n in metrics.time_per_node))


async def test_nativert_compare_tiny_runs_its_graphs_and_peers(tmp_path: Path) -> None:
    """benchmarks/nativert_compare.py at tiny sizes: its graph builders and the asyncgraph peers
    run and agree with eager; nativert joins where this torch has a working PyModelRunner
    (the torch 2.11 leg of `make test`), AOTInductor and compiled segments never (minutes)."""
    from asyncgraph.bench.harness import Context
    from benchmarks import nativert_compare as nc

    has_nativert = nc.check_nativert()[0] is not None
    options = nc.Options(compiled=False, nativert=has_nativert, cache=tmp_path)
    cases = await nc.run(Context(Settings(size="tiny")), options)

    assert [c.case for c in cases] == [
        "mlp latency", "mlp x 4 callers", "bert latency", "bert x 4 callers",
        "encoder latency", "chain latency",
    ]
    assert cases[0].params["nodes"] == 24
    for case in cases:
        names = [p.name for p in case.peers]
        assert names[0] == "asyncgraph", case.case
        assert (nc.NATIVERT in names or nc.NATIVERT_THREAD in names) == has_nativert, case.case
        for peer in case.peers:
            assert peer.matched is True, f"{case.case} / {peer.name}: {peer.error}"
            assert peer.samples >= 1, f"{case.case} / {peer.name}"
    batched = cases[1].peer(nc.BATCHED)
    assert batched.extra["throughput"] > 0
    targets = [t for c in cases for t in c.targets]
    assert sorted({t.number for t in targets}) == ([1, 2, 3, 4] if has_nativert else [])


def test_nativert_compare_cache_key_follows_graph_and_weights() -> None:
    """Compiled packages are cached by this key: a stale package for changed weights or a
    changed graph would be timed as if it were the current model."""
    from benchmarks import nativert_compare as nc

    model = nc.mlp(8, layers=2)
    x = torch.randn(1, 8)
    key = nc.digest(torch.export.export(model, (x,)))
    assert nc.digest(torch.export.export(nc.mlp(8, layers=2), (x,))) == key
    assert nc.digest(torch.export.export(nc.mlp(8, layers=3), (x,))) != key
    with torch.no_grad():
        model[0].weight[0, 0] += 1  # the program shares the module's parameters
    assert nc.digest(torch.export.export(model, (x,))) != key


def test_round_spread_takes_each_ratio_within_its_round() -> None:
    """A machine that slows down between rounds moves both peers: the round-by-round ratio
    stays put while each peer's own spread is wide."""
    from asyncgraph.bench.harness import CaseResult, PeerResult, Target

    slow_down = [1.0, 1.5, 2.0, 3.0, 4.0]
    fast = PeerResult("asyncgraph", rounds=[0.5 * s for s in slow_down], median_s=1.0)
    base = PeerResult("peer", rounds=slow_down, median_s=2.0)
    case = CaseResult("s", "c", "d", peers=[fast, base])
    assert case.round_spread("asyncgraph", "peer") == pytest.approx((0.5, 0.5))
    assert case.round_spread("peer", "asyncgraph") == pytest.approx((2.0, 2.0))
    assert case.round_spread("asyncgraph", "absent") is None
    assert case.ratio("absent", "peer") is None
    one_round = CaseResult("s", "c", "d", peers=[
        PeerResult("asyncgraph", rounds=[1.0]), PeerResult("peer", rounds=[2.0])])
    assert one_round.round_spread("asyncgraph", "peer") is None
    case.targets.append(Target(1, "t", case.ratio("asyncgraph", "peer"), "<=", 0.6,
                               rounds=case.round_spread("asyncgraph", "peer")))
    report = suite.Report(environment={}, settings={}, cases=[case])
    console = Console(record=True, width=200)
    console.print(suite._targets_table(report))
    assert "0.5-0.5" in console.export_text()


async def test_alternate_counts_calls_per_sample_again_once_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer whose first calls are slow (profiling) gets as many calls per sample as a peer
    that was warm from the start, counted from the last warm-up round (on a fake clock)."""
    from asyncgraph.bench import harness

    now = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])

    def peer(name: str, cold_calls: int) -> harness.Peer:
        made = [0]

        async def call() -> None:
            made[0] += 1
            now[0] += 0.010 if made[0] <= cold_calls else 0.001

        return harness.Peer(name, call)

    peers = [peer("warming", cold_calls=5), peer("warm", cold_calls=0)]
    results = {p.name: harness.PeerResult(p.name) for p in peers}
    settings = Settings(rounds=3, warmup=2, sample_s=0.020)
    await harness.alternate(peers, settings, lambda: None, results)
    for name in ("warming", "warm"):
        assert results[name].calls_per_sample == 20, name  # 20 ms / 1 ms
        assert results[name].rounds == pytest.approx([0.001] * 3), name
