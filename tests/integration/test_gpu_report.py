"""scripts/gpu_report.py, the command that turns a GPU run into a report (issue 36, section 3;
issue 50, item 6: the summary's table of issue-50 targets, read from the bench's JSON).

Without CUDA it runs nothing and writes nothing, and says what it would have run: the phases
and the GPU tests (a subprocess, as `make gpu-report` starts it). Its pure parts run here too:
the junit XML read into the summary (a failure, errors in setup and teardown, a skip), the
"may be poisoned" detection, the outcomes log a killed pytest leaves, and the budget and time
limit bookkeeping with a phase that sleeps past its limit. What needs a GPU (the phases' own
work: the tests, probes, benchmark and example on CUDA) is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_report", module)
    spec.loader.exec_module(module)
    return module


gr = _load()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.timeout(300)
def test_without_cuda_it_names_the_phases_and_the_gpu_tests_writes_nothing_and_exits_0(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_report.py"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "No CUDA GPU here" in text and "nothing was run or written" in text
    for phase in gr.PHASE_NAMES:
        assert f"\n  {phase} (cap " in text, phase
    for module in ("tests/integration/test_gpu_executor.py",
                   "tests/integration/test_cuda_graphs.py",
                   "tests/integration/test_cuda_graph_segments.py",
                   "tests/integration/test_streams.py", "tests/integration/test_trio_gpu.py"):
        assert module in text, module
    assert "-m benchmarks.gpu --quick" in text and "examples/gpu_check.py" in text
    assert f"--json {out / gr.BENCH_JSON}" in text  # the figures the targets table reads
    # the real-GPU tests, collected with the report's plugin selecting them
    assert "test_gpu_exported_model_matches_eager[asyncio-1]" in text
    assert "test_gpu_captured_exported_model_matches_eager" in text
    assert "test_protect_outputs_records" not in text  # a simulated test: not in that list
    assert not out.exists()


# -- junit XML and the summary -------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="2" skipped="1"
tests="6" time="0.1">
<testcase classname="tests.integration.test_demo" name="test_pass"
 file="tests/integration/test_demo.py" line="11" time="0.001" />
<testcase classname="tests.integration.test_demo" name="test_fail"
 file="tests/integration/test_demo.py" line="14" time="0.002">
<failure message="AssertionError: one is not two&#10;assert 1 == 2">def test_fail():
        x = 1
&gt;       assert x == 2, "one is not two"
E       AssertionError: one is not two
E       assert 1 == 2

tests/integration/test_demo.py:17: AssertionError</failure>
<system-out>--------------------------------- Captured Log ---------------------------------

--------------------------------- Captured Out ---------------------------------
printed by test_fail
</system-out></testcase>
<testcase classname="tests.integration.test_demo" name="test_teardown_error"
 file="tests/integration/test_demo.py" line="21" time="0.001">
<error
 message="failed on teardown with &quot;AssertionError: leak check failed: grew 105472&quot;">
@pytest.fixture
    def bad_teardown():
        yield
&gt;       raise AssertionError("leak check failed: grew 105472")
E       AssertionError: leak check failed: grew 105472

tests/integration/test_demo.py:10: AssertionError</error></testcase>
<testcase classname="tests.integration.test_demo" name="test_skip"
 file="tests/integration/test_demo.py" line="24" time="0.000">
<skipped type="pytest.skip" message="needs a CUDA GPU (torch.cuda.is_available())">
tests/integration/test_demo.py:25: needs a CUDA GPU</skipped></testcase>
<testcase classname="tests.integration.test_demo" name="test_setup_error[asyncio]"
 file="tests/integration/test_demo.py" line="18" time="0.001">
<error
 message="failed on setup with &quot;RuntimeError: CUDA error: an illegal memory access&quot;">
@pytest.fixture
    def bad_setup():
&gt;       raise RuntimeError("CUDA error: an illegal memory access")
E       RuntimeError: CUDA error: an illegal memory access

tests/integration/test_demo.py:5: RuntimeError</error></testcase>
<testcase classname="tests.integration.test_demo.TestC" name="test_m"
 file="tests/integration/test_demo.py" line="29" time="0.001">
<failure message="assert [1] == [2]">self = &lt;test_demo.TestC object&gt;

    def test_m(self):
&gt;       assert [1] == [2]
E       assert [1] == [2]

tests/integration/test_demo.py:31: AssertionError</failure></testcase>
</testsuite></testsuites>
"""


def _report(runs: list, tmp_path: Path, phases: list | None = None) -> object:
    return gr.Report(
        info={"device": "NVIDIA H200", "torch": "2.11.0+cu130", "python": "3.12.3"},
        phases=phases or [gr.PhaseResult("tests", "FAILED", 12.0, 240.0)], runs=runs, env=None,
        probes={}, bench="", example="", commands={}, started="2026-11-26 21:23", took_s=12.0,
        budget_s=480.0, argv=[], revision="commit abc1234", name="2026-11-26-nvidia-h200-torch2",
    )


def test_junit_is_read_into_counts_failures_with_their_assertions_and_a_report(
    tmp_path: Path,
) -> None:
    junit = tmp_path / "tests-real.xml"
    junit.write_text(JUNIT)
    cases = gr.parse_junit(junit, root=tmp_path)
    run = gr.summarize_run("real", "real GPU", cases)
    assert run.counts == {"passed": 1, "failed": 2, "error": 2, "skipped": 1}
    demo = "tests/integration/test_demo.py"
    assert [(c.nodeid, c.outcome, c.when) for c in run.failures] == [
        (f"{demo}::test_fail", "failed", "call"),
        (f"{demo}::test_teardown_error", "error", "teardown"),
        (f"{demo}::test_setup_error[asyncio]", "error", "setup"),
        (f"{demo}::TestC::test_m", "failed", "call"),
    ]
    fail = run.failures[0]
    assert gr.error_lines(fail.text) == ["AssertionError: one is not two", "assert 1 == 2"]
    assert gr.raised_at(fail.text) == f"{demo}:17: AssertionError"
    assert "printed by test_fail" in fail.output
    assert run.failures[1].message.startswith("AssertionError: leak check failed")

    # a failure that may poison the CUDA context: the one test after it is suspect
    assert run.poison is not None
    case, why, after, failed_after = run.poison
    assert case.nodeid == f"{demo}::test_setup_error[asyncio]"
    assert "illegal memory access" in why
    assert (after, failed_after) == (1, 1)

    report = _report([run], tmp_path)
    gr.write_failure_files(tmp_path, [run])
    files = sorted((tmp_path / "failures").iterdir())
    assert len(files) == 4
    assert "E       assert 1 == 2" in files[0].read_text()
    for for_commit in (False, True):
        md = gr.render(report, for_commit=for_commit)
        assert md.index("## Summary") < md.index("| tests | FAILED |") < md.index(
            "## Failures and errors")
        assert "real GPU: 1 passed, 2 failed, 2 errors, 1 skipped" in md
        assert "MAY BE POISONED" in md and "later results may be poisoned" in md
        assert "AssertionError: one is not two" in md  # the assertion, and its traceback:
        assert '>       assert x == 2, "one is not two"' in md
        assert f"Raised at `{demo}:17: AssertionError`" in md
        assert "failures/real-01-test-fail.txt" in md


def test_what_may_poison_the_cuda_context() -> None:
    def case(message: str, text: str = "", outcome: str = "failed") -> object:
        return gr.Case("t.py::x", outcome, "call", message, text)

    assert "capture under way" in gr.poison_reason(case(
        "RuntimeError: captures_underway.empty() INTERNAL ASSERT FAILED"))
    assert gr.poison_reason(case("", "E   RuntimeError: CUDA error: an illegal memory access"))
    assert gr.poison_reason(case("Failed: Timeout (>120.0s) from pytest-timeout."))
    assert gr.poison_reason(case("RuntimeError: operation not permitted when stream is capturing"))
    assert gr.poison_reason(case("assert 1 == 2", "E   assert 1 == 2")) is None
    # the source lines of a long traceback do not count, only what was raised
    source = '    with pytest.raises(RuntimeError, match="CUDA error"):\nE   assert 3 == 4'
    assert gr.poison_reason(case("assert 3 == 4", source)) is None
    assert gr.poison_reason(case("CUDA error", outcome="passed")) is None
    assert gr.poison_reason(case("CUDA error", outcome="skipped")) is None


def test_a_killed_run_is_read_from_its_outcomes_log(tmp_path: Path) -> None:
    rows = [
        {"event": "start", "nodeid": "t.py::a"},
        {"event": "report", "nodeid": "t.py::a", "when": "call", "outcome": "passed"},
        {"event": "finish", "nodeid": "t.py::a"},
        {"event": "start", "nodeid": "t.py::b"},
        {"event": "report", "nodeid": "t.py::b", "when": "call", "outcome": "failed",
         "message": "AssertionError: x", "text": "E   AssertionError: x"},
        {"event": "finish", "nodeid": "t.py::b"},
        {"event": "start", "nodeid": "t.py::hangs"},
    ]
    (tmp_path / "tests-real.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = gr.load_run(tmp_path, "real", "real GPU")
    assert run is not None and run.source.startswith("outcomes log")
    assert run.counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    assert run.running == "t.py::hangs"
    md = gr.render(_report([run], tmp_path), for_commit=True)
    assert "killed while `t.py::hangs` ran" in md


def test_a_phase_past_its_limit_is_killed_and_kept_and_the_budget_skips_the_rest(
    tmp_path: Path,
) -> None:
    py = sys.executable
    sleeper = "print('partial output', flush=True); import time; time.sleep(60)"
    phases = [
        gr.Phase("slow", 1.2, [gr.Step("sleeps", [py, "-c", sleeper], "sleeps.log", 30),
                               gr.Step("after", [py, "-c", "print('no')"], "after.log", 30)]),
        gr.Phase("late", 30, [gr.Step("late", [py, "-c", "print('never')"], "late.log", 30)]),
    ]
    lines: list[str] = []
    start = time.monotonic()
    results = gr.run_phases(phases, tmp_path, budget_s=1.5, reserve_s=0.0, min_phase_s=1.0,
                            echo=lines.append)
    assert time.monotonic() - start < 15
    slow, late = results
    assert slow.status == "TIMEOUT" and slow.limit_s == 1.2
    sleeps, after = slow.steps
    assert sleeps.timed_out and sleeps.note.startswith("TIMEOUT")
    log = (tmp_path / "sleeps.log").read_text()
    assert "partial output" in log and "### TIMEOUT" in log
    assert after.rc is None and after.note == "not run: the phase's time limit"
    assert not (tmp_path / "after.log").exists()
    assert late.status == "NOT RUN" and late.note.startswith("not run: budget")
    assert not (tmp_path / "late.log").exists()
    assert any("SKIP  late" in line for line in lines)
    table = gr.summary_table(_report([], tmp_path, results))
    assert "| slow | TIMEOUT |" in table and "| late | NOT RUN | not run: budget" in table


def test_a_step_that_fails_fails_its_phase(tmp_path: Path) -> None:
    py = sys.executable
    phases = [gr.Phase("good", 30, [gr.Step("ok", [py, "-c", "print('fine')"], "ok.log", 30)]),
              gr.Phase("bad", 30, [gr.Step("bad", [py, "-c", "raise SystemExit(3)"], "bad.log",
                                           30)])]
    good, bad = gr.run_phases(phases, tmp_path, budget_s=60, reserve_s=0, echo=lambda _: None)
    assert (good.status, good.steps[0].rc) == ("ok", 0)
    assert (bad.status, bad.steps[0].rc) == ("FAILED", 3)
    assert "fine" in (tmp_path / "ok.log").read_text()


def test_the_test_modules_and_the_report_name(tmp_path: Path) -> None:
    modules = gr.gpu_test_modules()
    assert modules[:4] == ["tests/integration/test_gpu_executor.py",
                           "tests/integration/test_cuda_graphs.py",
                           "tests/integration/test_cuda_graph_segments.py",
                           "tests/integration/test_streams.py"]
    # another test file using the real-GPU marker is found by reading it
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_new.py").write_text("@needs_gpu\ndef test_x(): ...\n")
    (tmp_path / "tests" / "unit" / "test_cpu.py").write_text("def test_y(): ...\n")
    assert gr.gpu_test_modules(tmp_path) == ["tests/unit/test_new.py"]
    import datetime

    when = datetime.datetime(2026, 11, 26, 21, 23, tzinfo=datetime.UTC)
    name = gr.report_name({"device": "NVIDIA H200", "torch": "2.11.0+cu130"}, when)
    assert name == "2026-11-26-nvidia-h200-torch2.11.0-cu130"


# -- issue 50's targets, from the bench's JSON ---------------------------------------------------


def _many(model: str, peer: str, calls_per_s: float, **extra: object) -> dict[str, object]:
    return {"section": "many-callers", "model": model, "peer": peer, "callers": 64, "rounds": 50,
            "calls_per_s": calls_per_s, "lag_p99_ms": 1.0, "settled": True, "warm_rounds": 3,
            "wrong_outputs": 0, "checked_outputs": 64, **extra}


def _replaying(executions: int, replays: int, fallbacks: int = 0) -> dict[str, object]:
    return {"graphs": {"capturable": True, "reason": None, "replays": 9999},
            "graphs_timed": {"replays": replays, "fallbacks": fallbacks},
            "executions": executions, "all_replaying": replays == executions and not fallbacks}


BENCH = {
    "complete": False, "args": {"models": ["encoder", "cnn", "wide-mlp"]},
    "cases": [
        _many("encoder", "to-thread-eager", 1000.0),
        _many("encoder", "asyncgraph", 2500.0, lag_p99_ms=2.5, **_replaying(3200, 3200)),
        _many("encoder", "asyncgraph-batched", 4000.0, lag_p99_ms=0.8, **_replaying(50, 50)),
        _many("cnn", "to-thread-eager", 1000.0),
        # fast enough, but a tenth fell back to the stream path: not "all replaying"
        _many("cnn", "asyncgraph", 6000.0, wrong_outputs=1, **_replaying(3200, 2880, 320)),
        {"section": "one-caller", "model": "encoder", "peer": "asyncgraph-captured", "ms": 0.46,
         "graphs": {"replays": 52}},
        {"section": "one-caller", "model": "encoder", "peer": "graph-of-eager", "ms": 0.42},
        {"section": "one-caller", "model": "cnn", "peer": "asyncgraph-captured", "ms": 0.2,
         "graphs": {"replays": 52}},
        {"section": "one-caller", "model": "cnn", "peer": "graph-of-eager", "ms": 0.1},
    ],
    "errors": [{"section": "many-callers", "model": "cnn", "peer": "asyncgraph-batched",
                "error": "BatchingError: no dynamic dim 0"}],
}
CONCURRENCY = {"callers": 64, "graphs": {"calls": 1280, "bad": 0}, "no_graphs": {"bad": 0}}


def test_each_issue_50_target_gets_its_ratio_and_verdict_or_no_figure() -> None:
    rows = {(r.target.key, r.target.model): r for r in gr.target_rows(BENCH, CONCURRENCY)}
    assert len(rows) == len(gr.ISSUE50_TARGETS) == 13

    def row(key: str, model: str | None) -> tuple[float | None, str, str]:
        r = rows[key, model]
        return r.value, r.verdict, r.figure

    value, verdict, figure = row("unbatched", "encoder")
    assert (value, verdict) == (2.5, "met") and figure.startswith("x2.50 (2,500/s / 1,000/s)")
    value, verdict, figure = row("unbatched", "cnn")
    assert (value, verdict) == (6.0, "NOT MET")
    assert "NOT all replaying: 2880 replays of 3200 executions, 320 fallbacks" in figure
    value, verdict, figure = row("unbatched", "wide-mlp")
    assert (value, verdict) == (None, "no figure")
    assert figure == "asyncgraph was not measured (the run was cut short)"
    assert row("batched", "encoder")[:2] == (4.0, "met")
    short = {**BENCH, "cases": [{**c, "rounds": 5} for c in BENCH["cases"]]}
    (encoder,) = [r for r in gr.target_rows(short, None)
                  if (r.target.key, r.target.model) == ("unbatched", "encoder")]
    assert encoder.verdict == "NOT MET" and "5 timed rounds, fewer than 50" in encoder.figure
    value, verdict, figure = row("batched", "cnn")
    assert verdict == "no figure" and "raised BatchingError: no dynamic dim 0" in figure
    value, verdict, figure = row("one-caller", "encoder")
    assert verdict == "met" and figure.startswith("x1.10 (0.460 ms / 0.420 ms)")
    assert row("one-caller", "cnn")[:2] == (2.0, "NOT MET")
    assert row("one-caller", "wide-mlp")[1] == "no figure"
    value, verdict, figure = row("loop-lag", "encoder")
    assert (value, verdict) == (2.5, "NOT MET")
    assert "asyncgraph 2.50" in figure and "asyncgraph-batched 0.80" in figure
    assert row("loop-lag", "cnn")[:2] == (1.0, "met")
    value, verdict, figure = row("wrong-outputs", None)
    assert (value, verdict) == (1.0, "NOT MET")
    assert "probe: 0 of 1280" in figure and "benchmark: 1 of 192 checked" in figure


def test_without_the_bench_or_the_probe_every_target_says_no_figure() -> None:
    rows = gr.target_rows(None, None)
    assert [r.verdict for r in rows] == ["no figure"] * len(gr.ISSUE50_TARGETS)
    assert all(r.value is None for r in rows)
    assert rows[0].figure == "the benchmark left no results"
    # the probe alone still answers the wrong-outputs target
    (wrong,) = [r for r in gr.target_rows(None, CONCURRENCY) if r.target.key == "wrong-outputs"]
    assert (wrong.value, wrong.verdict) == (0.0, "met")


def test_the_summary_shows_every_target_with_its_figure_or_no_figure(tmp_path: Path) -> None:
    phases = [gr.PhaseResult("bench", "ok", 90.0, 240.0)]
    for bench in (BENCH, None):
        report = _report([], tmp_path, phases)
        report.bench_json = bench
        report.probes = {"concurrency": CONCURRENCY}
        for for_commit in (False, True):
            md = gr.render(report, for_commit=for_commit)
            summary = md[md.index("## Summary"):md.index("## Failures and errors")]
            assert "### Issue-50 targets" in summary
            table = summary[summary.index("| target | model |"):]
            for target in gr.ISSUE50_TARGETS:
                assert f"| {target.what} | {target.model or 'all'} |" in table, target
            assert table.count("| no figure |") == (5 if bench else 12)
        cell = gr.phase_figures(report, phases[0])
        if bench:
            assert cell.startswith("issue-50 targets: 4 met, 4 not met, 5 no figure")
            assert "64 callers unbatched / to_thread(eager): encoder x2.50, cnn x6.00" in cell
            assert "1 cases raised: cnn/asyncgraph-batched" in cell


def test_the_bench_phase_writes_its_json_into_the_report_directory(tmp_path: Path) -> None:
    (bench_phase,) = gr.build_phases("python", tmp_path, [], per_test_s=60, has_timeout=True,
                                     bench_args=["--quick"], wanted=["bench"])
    (step,) = bench_phase.steps
    assert step.argv == ["python", "-m", "benchmarks.gpu", "--quick", "--json",
                         str(tmp_path / gr.BENCH_JSON)]
    assert bench_phase.cap_s == step.cap_s == gr.BENCH_CAP_S >= 200
    (tmp_path / gr.BENCH_JSON).write_text(json.dumps(BENCH))
    report = gr.make_report(tmp_path, {"device": "d", "torch": "t"}, [], {}, _started(), 1.0,
                            480.0, [], "name")
    assert report.bench_json == BENCH


def _started() -> object:
    import datetime

    return datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
