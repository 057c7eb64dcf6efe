"""benchmarks/gpu_host.py (issue 50: the host's cost of a replay on a no-op GPU) runs at a tiny
size and tells the truth about what it timed: every execution between its first verification
call and its last timed one replayed a captured graph (by asyncgraph's statistics and by the
no-op backend's own count of `replay()` calls), batches formed and replayed their buckets'
graphs, every peer's output matched asyncgraph's, and the report carries issue 50's targets.
Structure and counts only: the figures are the benchmark's, never asserted here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph.bench import suite
from asyncgraph.bench.harness import Context, Settings, environment
from benchmarks import gpu_host
from benchmarks.gpu import batch_buckets

pytestmark = pytest.mark.usefixtures("leak_check")

TINY = Settings(size="tiny", rounds=2, warmup=1, sample_s=0.002)
CASES = ["replay, 1 caller", f"replay, {gpu_host.CALLERS} callers",
         f"batched, {gpu_host.CALLERS} callers"]
LIMITS = [gpu_host.REPLAY_LIMIT_US, gpu_host.REPLAY_LIMIT_US, gpu_host.BATCHED_LIMIT_US]


@pytest.mark.timeout(120)
@pytest.mark.asyncio(loop_factories=["asyncio"])  # the benchmark's structure, not the loop's
async def test_every_timed_execution_replayed_and_the_report_has_issue_50s_targets() -> None:
    cases = await gpu_host.run(Context(TINY))
    report = suite.Report(environment(), {"size": TINY.size}, cases)
    data = json.loads(suite.to_json(report))

    assert [c["case"] for c in data["cases"]] == CASES
    for case, limit in zip(data["cases"], LIMITS, strict=True):
        name = case["case"]
        peers = case["peers"]
        assert peers[0]["name"].startswith("asyncgraph"), name
        assert peers[1]["name"].startswith("direct"), name  # the baseline
        for peer in peers:  # each timed in every round, and answering as asyncgraph does
            assert peer["matched"] is True and not peer["failed"], (name, peer)
            assert peer["samples"] == TINY.rounds and len(peer["rounds"]) == TINY.rounds
            assert peer["extra"]["median us"] == pytest.approx(peer["median_s"] * 1e6)
        (target,) = case["targets"]
        assert (target["number"], target["op"], target["limit"], target["unit"]) == (
            50, "<=", limit, "us"), name
        assert target["value"] == pytest.approx(peers[0]["median_s"] * 1e6)
        assert target["met"] == (target["value"] <= limit and target["all_replayed"])

        # the counts the figure stands on: every execution in the window replayed
        details = case["details"]
        window = details["graphs_window"]
        executions = details["executions_window"]
        assert details["graphs"]["capturable"] is True, details["graphs"]["reason"]
        assert executions > 0
        assert window["replays"] == executions == details["backend_replays_window"], name
        assert details["not_replays_window"] == {}, name
        assert all(window[k] == 0 for k in gpu_host.NOT_REPLAYS if k in window), window
        assert target["all_replayed"] is True and case["metrics"]["all replayed"] is True
        assert "all replayed" in target["note"] and "NOT" not in target["note"]
        assert case["metrics"]["settled"] is True, name

    one, many, batched = data["cases"]
    assert one["details"]["graphs"]["instances"] == 1  # one caller: one instance replays
    assert one["metrics"]["longest loop iteration ms"] is None  # 64 callers' figure only
    for case in (many, batched):  # the loop's longest iteration under 64 callers is reported
        assert case["metrics"]["longest loop iteration ms"] > 0
    # 64 callers: whole rounds of 64 executions, sharing the instances a signature may have
    assert many["details"]["executions_window"] % gpu_host.CALLERS == 0
    assert 1 <= many["details"]["graphs"]["instances"] <= 8
    # batched: requests of one row in whole rounds, one execution (and one replay) per batch,
    # every batch at one of the buckets' sizes
    details = batched["details"]
    assert details["batches_window"] == details["executions_window"] > 0
    assert details["requests_window"] % gpu_host.CALLERS == 0
    assert details["requests_window"] >= details["batches_window"]
    buckets = set(batched["params"]["buckets"])
    assert buckets == set(batch_buckets(1, gpu_host.CALLERS))
    assert {int(size) for size in details["batching"]["by_size"]} <= buckets
    assert [p["name"] for p in batched["peers"]] == [
        "asyncgraph (batched)", "direct bucket", "direct bucket, gathered"]


def test_a_window_with_a_non_replay_flags_its_figure_and_misses_its_target() -> None:
    """A fallback, a warm-up or a capture among the executions timed, or a replay count the
    backend does not confirm: "NOT all replayed", and the target is not met whatever its
    value."""
    replayed = gpu_host.Window(10, 10, {"replays": 10, "fallbacks": 0})
    assert replayed.all_replayed and replayed.verdict().endswith(": all replayed")
    for window in (
        gpu_host.Window(10, 9, {"replays": 9, "fallbacks": 1}),
        gpu_host.Window(10, 10, {"replays": 10, "captures": 1}),
        gpu_host.Window(10, 9, {"replays": 10}),  # the backend saw fewer replays
        gpu_host.Window(0, 0, {"replays": 0}),  # nothing timed is no proof
    ):
        assert not window.all_replayed, window
        assert "NOT all replayed" in window.verdict()
        target = gpu_host.ReplayTarget(50, "t", 1.0, "<=", 40.0, "us",
                                       all_replayed=window.all_replayed)
        assert not target.met and not target.as_dict()["met"]
    assert gpu_host.ReplayTarget(50, "t", 1.0, "<=", 40.0, "us").met


@pytest.mark.timeout(120)
def test_the_command_prints_the_suites_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_host.main(["--quick", "--rounds", "1", "--warmup", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["size"] == "quick" and data["settings"]["rounds"] == 1
    assert [c["case"] for c in data["cases"]] == CASES
    # what scripts/bench_record.py reads: a value for each named target
    targets = [t for c in data["cases"] for t in c["targets"]]
    assert [t["limit"] for t in targets] == LIMITS
    assert all(isinstance(t["value"], float) and t["name"] for t in targets)
