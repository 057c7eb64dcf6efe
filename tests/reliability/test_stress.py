"""The stress harness (asyncgraph.testing.run_stress and `asyncgraph stress`).

CI runs a short soak (a few hundred executions with cancellations, timeouts, faults, delays
and weight swaps); `--run-slow` runs long ones. The harness must also *fail* when something is
wrong: wrong results and unexpected errors are reported as violations.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from asyncgraph import BatchingConfig, ExecutorConfig, GraphBuilder
from asyncgraph.cli.main import app
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import (
    LoopLagMonitor,
    ReferenceRunner,
    StressConfig,
    perturbed_weights,
    random_inputs,
    run_stress,
)
from tests.support.soak import soak

pytestmark = pytest.mark.usefixtures("leak_check")


class Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 2 * width)
        self.b = torch.nn.Linear(width, 2 * width)
        self.out = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * torch.sigmoid(self.b(x))
        return self.norm(x + self.out(h))


@pytest.fixture(scope="module")
def block_ep() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(Block().eval(), (torch.randn(16, 32),))


def async_graph() -> Graph:
    async def fetch(x: float) -> float:
        await asyncio.sleep(0.0005)
        return x * 2

    def crunch(x: float) -> float:
        return x**2 + 1

    b = GraphBuilder()
    x = b.input("x")
    y = b.call(fetch, x)
    z = b.call(crunch, x, placement="worker")
    b.output(b.call(lambda p, q: p - q, y, z, name="mix", placement="inline"))
    return b.build()


async def test_short_soak_exported_program(block_ep: torch.export.ExportedProgram) -> None:
    config = StressConfig(
        executions=240, concurrency=16, cancel_rate=0.1, timeout_rate=0.1, fault_rate=0.1,
        delay_rate=0.2, max_delay_s=0.001, swap_weights_every=30, seed=1,
    )
    report = await run_stress(
        block_ep, config, executor_config=ExecutorConfig(max_concurrent_executions=4)
    )
    assert report.ok, report.summary()
    total = report.completed + report.cancelled + report.timed_out + report.faulted
    assert total == config.executions and report.errors == 0
    assert report.completed > 0 and report.faulted > 0
    assert report.weight_swaps == (config.executions - 1) // config.swap_weights_every
    assert 1 <= report.frames_high_water <= report.max_frames == 4
    assert report.loop_lag_p99_ms <= report.loop_lag_max_ms
    assert "mismatches   0" in report.summary()


@pytest.mark.parametrize("seed", [1, 2])
async def test_short_soak_with_dynamic_batching(seed: int) -> None:
    """Cancellations, timeouts, faults (a faulted batch retries its requests alone), delays and
    weight swaps, with concurrent requests stacked into batches."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(Block().eval(), (torch.randn(16, 32),), dynamic_shapes=({0: batch},))
    config = StressConfig(
        executions=240, concurrency=16, cancel_rate=0.1, timeout_rate=0.1, fault_rate=0.1,
        delay_rate=0.2, max_delay_s=0.001, swap_weights_every=30, seed=seed,
    )
    executor_config = ExecutorConfig(
        max_concurrent_executions=4, batching=BatchingConfig(max_batch_size=64)
    )
    report = await run_stress(ep, config, executor_config=executor_config)
    assert report.ok, report.summary()
    total = report.completed + report.cancelled + report.timed_out + report.faulted
    assert total == config.executions and report.errors == 0 and report.completed > 0
    assert "mismatches   0" in report.summary()


async def test_batching_reports_injected_retried_and_reached_faults_apart() -> None:
    """Issue #37: with batching, a faulted batch is retried request by request, so most
    injected faults never reach a caller; the report counts the three apart, consistently."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(Block().eval(), (torch.randn(16, 32),), dynamic_shapes=({0: batch},))
    config = StressConfig(
        executions=300, concurrency=16, cancel_rate=0.0, timeout_rate=0.0, fault_rate=0.3,
        delay_rate=0.0, seed=3,
    )
    executor_config = ExecutorConfig(
        max_concurrent_executions=2, batching=BatchingConfig(max_batch_size=64)  # 4 requests
    )
    report = await run_stress(ep, config, executor_config=executor_config)
    assert report.ok, report.summary()
    assert report.completed + report.faulted == config.executions and report.errors == 0
    assert report.retried_batches > 0
    assert report.injected_faults > report.faulted
    # each caller's fault and each retried batch had an injected fault of its own execution
    assert report.injected_faults >= report.faulted + report.retried_batches
    summary = report.summary()
    assert f"faulted      {report.faulted} (injected faults that reached callers)" in summary
    assert (f"injected     {report.injected_faults} fault(s), {report.retried_batches} failed "
            "batch(es) retried request by request") in summary


async def test_without_batching_no_batch_is_retried() -> None:
    config = StressConfig(executions=60, concurrency=1, cancel_rate=0, timeout_rate=0,
                          fault_rate=0.3, delay_rate=0.0, seed=9)
    report = await run_stress(async_graph(), config, inputs=lambda rng: [rng.uniform(-3, 3)])
    assert report.ok, report.summary()
    assert report.retried_batches == 0
    # one caller at a time, no cancellations: every injected fault reaches its caller
    assert report.injected_faults == report.faulted > 0


async def test_short_soak_async_graph() -> None:
    config = StressConfig(
        executions=200, concurrency=24, cancel_rate=0.15, timeout_rate=0.15, fault_rate=0.1,
        delay_rate=0.3, max_delay_s=0.002, seed=5,
    )
    report = await run_stress(async_graph(), config, inputs=lambda rng: [rng.uniform(-3, 3)])
    assert report.ok, report.summary()
    assert report.completed > 0 and report.faulted > 0
    assert report.cancelled + report.timed_out > 0, "no caller was cancelled or timed out"


async def test_replayable_with_one_caller() -> None:
    config = StressConfig(executions=60, concurrency=1, cancel_rate=0, timeout_rate=0,
                          fault_rate=0.3, delay_rate=0.0, seed=9)

    async def outcome(cfg: StressConfig) -> tuple[int, int]:
        report = await run_stress(async_graph(), cfg, inputs=lambda rng: [rng.uniform(0, 1)])
        assert report.ok, report.summary()
        return report.completed, report.faulted

    first = await outcome(config)
    assert await outcome(config) == first, "the same seed must replay the same run"
    others = {await outcome(StressConfig(**{**config.__dict__, "seed": s})) for s in (1, 2, 3)}
    assert others != {first}, "other seeds should make other decisions"


async def test_harness_reports_wrong_results() -> None:
    """A kernel that misbehaves on worker threads only: the executor's answers are wrong."""
    calls = itertools.count()

    def flaky(x: float) -> float:
        on_worker = threading.current_thread().name.startswith("asyncgraph")
        return x + (2.0 if on_worker and next(calls) % 3 == 0 else 1.0)

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(flaky, x, placement="worker"))
    config = StressConfig(executions=40, concurrency=4, cancel_rate=0, timeout_rate=0,
                          fault_rate=0, delay_rate=0, seed=0)
    report = await run_stress(b.build(), config, inputs=lambda rng: [rng.random()])
    assert not report.ok
    assert 0 < report.mismatches < report.completed
    assert any("differs from the reference" in v for v in report.violations)


async def test_harness_reports_unexpected_errors() -> None:
    def brittle(x: float) -> float:
        if x > 0.8:
            raise ZeroDivisionError("not an injected fault")
        return x

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(brittle, x, placement="worker"))
    config = StressConfig(executions=40, concurrency=4, cancel_rate=0, timeout_rate=0,
                          fault_rate=0, delay_rate=0, seed=3)
    report = await run_stress(b.build(), config, inputs=lambda rng: [rng.random() * 0.9])
    assert not report.ok and report.errors > 0
    assert any("unexpected ZeroDivisionError" in v for v in report.violations)
    assert "violation(s)" in report.summary()


async def test_stress_refuses_buffer_mutations() -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.n.add_(1)
            return x + self.n

    ep = torch.export.export(Counter(), (torch.ones(2),))
    with pytest.raises(ValueError, match="mutates buffers"):
        await run_stress(ep, StressConfig(executions=1))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("executions", 0, "executions must be >= 1"),
        ("concurrency", 0, "concurrency must be >= 1"),
        ("cancel_rate", 1.5, "cancel_rate must be in"),
        ("fault_rate", -0.1, "fault_rate must be in"),
        ("swap_weights_every", -1, "swap_weights_every must be >= 0"),
        ("max_delay_s", -1.0, "max_delay_s must be >= 0"),
    ],
)
def test_stress_config_validation(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StressConfig(**{field: value})
    with pytest.raises(ValueError, match="cancel_rate \\+ timeout_rate"):
        StressConfig(cancel_rate=0.6, timeout_rate=0.6)


async def test_reference_runs_once_per_input_set_and_weights_version(
    block_ep: torch.export.ExportedProgram, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs the reference per distinct input set and weights version, not per
    execution, and progress reports both phases to the end."""
    runs = 0
    original = ReferenceRunner.run_flat

    async def counting(self: ReferenceRunner, inputs: Any) -> list[Any]:
        nonlocal runs
        runs += 1
        return await original(self, inputs)

    monkeypatch.setattr(ReferenceRunner, "run_flat", counting)
    seen: dict[str, tuple[int, int]] = {}
    config = StressConfig(executions=80, concurrency=8, cancel_rate=0, timeout_rate=0,
                          fault_rate=0, delay_rate=0, swap_weights_every=40, seed=4,
                          distinct_inputs=3)
    report = await run_stress(
        block_ep, config, progress=lambda phase, done, total: seen.update({phase: (done, total)})
    )
    assert report.ok, report.summary()
    assert report.completed == 80
    assert runs == report.reference_runs
    assert 3 <= runs <= 3 * (report.weight_swaps + 1) == 6
    assert seen == {"run": (80, 80), "verify": (80, 80)}
    assert report.total_s >= report.elapsed_s + report.verify_s


async def test_loop_lag_above_the_limit_is_a_violation() -> None:
    import time

    def hog(x: float) -> float:
        time.sleep(0.02)  # holds the event loop: it runs inline
        return x

    b = GraphBuilder()
    b.output(b.call(hog, b.input("x"), placement="inline"))
    config = StressConfig(executions=6, concurrency=2, cancel_rate=0, timeout_rate=0,
                          fault_rate=0, delay_rate=0, max_loop_lag_s=0.005)
    report = await run_stress(b.build(), config, inputs=lambda rng: [rng.random()])
    assert any("loop lag p99" in v and "exceeds 5.00 ms" in v for v in report.violations)


def test_cli_stress_checks_loop_lag_by_default(
    tmp_path: Path, block_ep: torch.export.ExportedProgram, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncgraph.testing as testing

    configs: list[StressConfig] = []
    original = testing.run_stress

    async def recording(program: Any, config: StressConfig, **kwargs: Any) -> Any:
        configs.append(config)
        return await original(program, config, **kwargs)

    monkeypatch.setattr(testing, "run_stress", recording)
    path = tmp_path / "block.pt2"
    torch.export.save(block_ep, path)
    base = ["stress", str(path), "--executions", "8", "--concurrency", "2"]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 0, result.output
    assert configs[-1].max_loop_lag_s == 0.1
    for word in ("run", "verification", "reference runs", "total"):
        assert word in result.output
    result = CliRunner().invoke(app, [*base, "--max-loop-lag-ms", "0"])
    assert result.exit_code == 0, result.output
    assert configs[-1].max_loop_lag_s is None
    assert "loop lag not checked" in result.output


async def test_harness_reports_a_blocked_loop() -> None:
    """A kernel that holds the loop for 30 ms: the heartbeat's lag p99 is over the 10 ms limit
    (a lower bound: a busy machine only makes the lag longer)."""

    async def hog(x: float) -> float:
        time.sleep(0.03)  # noqa: ASYNC251 - the defect under test: it blocks the loop
        return x

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(hog, x))
    config = StressConfig(executions=3, concurrency=1, cancel_rate=0, timeout_rate=0,
                          fault_rate=0, delay_rate=0, max_loop_lag_s=0.01, seed=0)
    report = await run_stress(b.build(), config, inputs=lambda rng: [rng.random()])
    assert report.completed == 3 and report.mismatches == 0
    assert report.loop_lag_max_ms >= report.loop_lag_p99_ms >= 20.0, report.summary()
    assert not report.ok
    assert any("loop lag p99" in v and "exceeds 10.00 ms" in v for v in report.violations)


# -- the reference runner and helpers -------------------------------------------------------------


async def test_reference_runner_matches_eager(block_ep: torch.export.ExportedProgram) -> None:
    model = block_ep.module()
    x = torch.randn(16, 32)
    ref = ReferenceRunner(block_ep)
    torch.testing.assert_close(await ref.run(x), model(x))
    torch.testing.assert_close(ref.run_flat_sync([x])[0], model(x))
    new = perturbed_weights(ref.weights, random.Random(1))
    assert set(new) == {k for k, v in ref.weights.items() if v.dtype.is_floating_point}
    swapped = ref.with_weights(new)
    model.load_state_dict({k: v for k, v in new.items()}, strict=False)
    torch.testing.assert_close(await swapped.run(x), model(x))
    (x2,) = random_inputs(block_ep, 4)
    assert x2.shape == (16, 32) and x2.dtype == torch.float32


async def test_reference_runner_awaits_async_kernels() -> None:
    ref = ReferenceRunner(async_graph())
    assert await ref.run(3.0) == 6.0 - 10.0
    with pytest.raises(TypeError, match="async kernel"):
        ref.run_flat_sync([3.0])
    with pytest.raises(ValueError, match="no tensor spec"):
        random_inputs(async_graph(), 0)


async def test_loop_lag_monitor_measures_a_blocked_loop() -> None:
    async with LoopLagMonitor() as monitor:
        await asyncio.sleep(0.01)
        time.sleep(0.03)  # noqa: ASYNC251 - hold the loop on purpose: the next beat is late
        await asyncio.sleep(0.01)
    assert monitor.max >= 0.02
    assert monitor.percentile(0) <= monitor.p99 <= monitor.max


# -- the CLI ---------------------------------------------------------------------------------------


def test_cli_stress(tmp_path: Path, block_ep: torch.export.ExportedProgram) -> None:
    path = tmp_path / "block.pt2"
    torch.export.save(block_ep, path)
    result = CliRunner().invoke(app, [
        "stress", str(path), "--executions", "60", "--concurrency", "8", "--cancel-rate", "0.1",
        "--timeout-rate", "0.1", "--fault-rate", "0.1", "--swap-weights-every", "10",
        "--seed", "2",
    ])
    assert result.exit_code == 0, result.output
    for word in ("completed", "cancelled", "timed out", "faults injected",
                 "faults reached callers", "mismatches", "frames high-water", "loop lag p99",
                 "no violation"):
        assert word in result.output
    assert "batches retried alone" not in result.output  # no batching


def test_cli_stress_with_batching(tmp_path: Path) -> None:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(Block().eval(), (torch.randn(16, 32),), dynamic_shapes=({0: batch},))
    path = tmp_path / "block.pt2"
    torch.export.save(ep, path)
    result = CliRunner().invoke(app, [
        "stress", str(path), "--executions", "60", "--concurrency", "8", "--cancel-rate", "0.1",
        "--fault-rate", "0.1", "--swap-weights-every", "10", "--max-batch-size", "64",
    ])
    assert result.exit_code == 0, result.output
    assert "no violation" in result.output
    rows = dict(re.findall(r"│ ([a-z ]+?) +│ +(\d+) │", result.output))
    injected, retried = int(rows["faults injected"]), int(rows["batches retried alone"])
    assert injected >= int(rows["faults reached callers"]) + retried


def test_cli_stress_refuses_a_bad_archive(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt2"
    path.write_bytes(b"this is not a zip file")
    result = CliRunner().invoke(app, ["stress", str(path), "--executions", "5"])
    assert result.exit_code == 1
    assert "not a zip file" in result.output


# -- long soaks (--run-slow; sized by ASYNCGRAPH_SOAK_SCALE, see tests/support/soak.py) -----


@pytest.mark.slow
async def test_long_soak_exported_program(block_ep: torch.export.ExportedProgram) -> None:
    config = StressConfig(
        executions=soak(5000), concurrency=64, cancel_rate=0.1, timeout_rate=0.1, fault_rate=0.05,
        delay_rate=0.2, max_delay_s=0.002, swap_weights_every=100, seed=11,
    )
    report = await run_stress(block_ep, config)
    assert report.ok, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
async def test_long_soak_async_graph(seed: int) -> None:
    config = StressConfig(
        executions=soak(2000), concurrency=128, cancel_rate=0.2, timeout_rate=0.2,
        fault_rate=0.1,
        delay_rate=0.5, max_delay_s=0.003, seed=seed,
    )
    report = await run_stress(async_graph(), config, inputs=lambda rng: [rng.uniform(-3, 3)])
    assert report.ok, report.summary()
