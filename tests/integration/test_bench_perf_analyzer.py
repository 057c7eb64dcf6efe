"""benchmarks/perf_analyzer.py without perf_analyzer: its output parser on a captured sample,
and the skip that says why when no perf_analyzer runs. perf_analyzer itself never runs here
(it is an optional benchmark dependency, not part of the test tier)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph.bench import suite
from asyncgraph.bench.harness import Context, Settings
from benchmarks import perf_analyzer

# perf_analyzer 2.60.0 against `asyncgraph serve --max-batch-size 32`, gRPC, -b 4,
# --concurrency-range 1:4:3 (2026-11-28); the concurrency-4 block trimmed to what is parsed,
# and a third level that failed to stabilise, as perf_analyzer reports one.
SAMPLE = """\
*** Measurement Settings ***
  Batch size: 4
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Measurement window: 1000 msec
  Using synchronous calls for inference

Request concurrency: 1
  Client:
    Request count: 3754
    Throughput: 4144.49 infer/sec
    Avg latency: 957 usec (standard deviation 584 usec)
    p50 latency: 899 usec
    p90 latency: 1077 usec
    p95 latency: 1163 usec
    p99 latency: 1927 usec
    Avg gRPC time: 946 usec ((un)marshal request/response 4 usec + response wait 942 usec)
  Server:
    Inference count: 15016
    Execution count: 3754
    Successful request count: 3754
    Avg request latency: 397 usec (overhead 94 usec + queue 1 usec + compute input 118 usec + \
compute infer 160 usec + compute output 23 usec)

Request concurrency: 4
  Client:
    Request count: 3846
    Throughput: 4251.52 infer/sec
    Avg latency: 3753 usec (standard deviation 1605 usec)
    p50 latency: 3353 usec
    p90 latency: 5580 usec
    p95 latency: 6972 usec
    p99 latency: 8178 usec
  Server:
    Avg request latency: 636 usec (overhead 94 usec + queue 1 usec)

Request concurrency: 7
Failed to obtain stable measurement within 10 measurement windows for concurrency 7. \
Please try to increase the --measurement-interval.
Inferences/Second vs. Client Average Batch Latency
Concurrency: 1, throughput: 4144.49 infer/sec, latency 957 usec
Concurrency: 4, throughput: 4251.52 infer/sec, latency 3753 usec
"""


def test_parse_output_reads_each_level_and_leaves_out_an_unstable_one() -> None:
    got = perf_analyzer.parse_output(SAMPLE)
    assert got == [
        perf_analyzer.Measurement(1, 4144.49, 957, 899, 1077, 1163, 1927),
        perf_analyzer.Measurement(4, 4251.52, 3753, 3353, 5580, 6972, 8178),
    ]


def test_figures_count_requests_as_inferences_over_the_batch() -> None:
    run = perf_analyzer.Run("batching", "grpc", ("-b", "4"))
    first = perf_analyzer.parse_output(SAMPLE)[0]
    figures = perf_analyzer.figures_of(run, first)
    assert (run.label, figures["throughput"], figures["requests_per_s"]) == (
        "grpc -b 4", 4144.49, 1036.1)
    shm = perf_analyzer.Run("plain", "http", ("--shape=input:1,64", "--shared-memory", "system"))
    assert shm.label == "http --shared-memory system"
    assert perf_analyzer.figures_of(shm, first)["requests_per_s"] == 4144.5


def test_failure_reason_quotes_perf_analyzer() -> None:
    text = "error: failed to get model config: GET /v2/models/mlp/config: Not Found\n"
    assert perf_analyzer.failure_reason(99, text) == (
        "perf_analyzer exited 99: error: failed to get model config: "
        "GET /v2/models/mlp/config: Not Found")


def test_without_perf_analyzer_the_scenario_is_skipped_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "perf_analyzer"
    monkeypatch.setenv("PERF_ANALYZER", str(missing))
    assert "perf-analyzer" in suite.select(["perf-analyzer"])
    cases = asyncio.run(perf_analyzer.run(Context(Settings(size="tiny"))))
    assert [c.case for c in cases] == ["perf_analyzer (skipped)"]
    why = cases[0].metrics["skipped"]
    assert f"{missing}: not an executable file" in why
    assert "PERF_ANALYZER" in why
