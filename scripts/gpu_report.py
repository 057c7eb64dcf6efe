"""One command that turns a GPU run into a report (issue 36, section 3; `make gpu-report`).

    python scripts/gpu_report.py [--out DIR] [--budget-s 480] [--phases env tests ...]
                                 [--per-test-timeout 120] [--commit-copy] [--dry-run]

On a machine with a CUDA GPU, torch and the project installed (no package index needed), in
one call that stays within `--budget-s` (480 s: under 8 minutes on one GPU), it runs these
phases, each in subprocesses of its own under its own time limit, so that one hang cannot eat
the budget (a phase killed by its limit is reported as TIMEOUT with its partial output kept;
a phase the budget no longer admits is reported as "not run: budget"):

- env: versions (Python, torch, CUDA, the device and its driver, asyncgraph), the imports
  asyncgraph and its tests need, and one capture and replay through the real backend
  (scripts/gpu_probes.py env);
- tests: every test that needs CUDA, in two pytest processes, so that a failure that breaks
  the CUDA context in the first cannot spoil the second: the real-GPU tests (those skipped
  without CUDA with "needs a CUDA GPU", found in the modules `gpu_test_modules()` lists), then the
  other tests of those modules (the simulated GPU). Each with pytest-timeout's per-test limit
  (`--per-test-timeout` caps every test's own), `--junitxml`, `-rfE --tb=long`, the full output
  in a log, and every outcome appended to a JSON-lines file as it happens (what is left when a
  hang gets the process killed). The summary counts passed / failed / errors / skipped from the
  junit XML, lists every failure with its assertion, where it was raised and its traceback
  (also written to failures/), and says so when a failure may have poisoned the CUDA context
  for the results after it (a CUDA error, an illegal memory access, `captures_underway`, ...);
- probes: the host wait's added latency on asyncio, uvloop and trio; a forced capture failure
  followed by `empty_cache()` and memory growth; 64 frames replaying at once, every output
  checked against eager (scripts/gpu_probes.py: issue 36, items 1, 2 and 7);
- bench: `python -m benchmarks.gpu --quick --json OUT/bench.json` (issue 50, item 6: one
  caller; 64 callers unbatched, batched into bucket graphs, `to_thread(eager)` and per-thread
  CUDA graphs of eager, each warmed until its captures stop, then 50 rounds; streams), its
  graph statistics per case in the JSON;
- example: `python examples/gpu_check.py --skip-tests` (its tests are the tests phase's).

It writes one directory (default build/gpu-report/DATE-DEVICE-torchVERSION/): README.md, a
summary table first (phase, status, key figures, time), and under it issue 50's targets
(`ISSUE50_TARGETS`: each with its ratio or figure from the bench's JSON and the concurrency
probe, its bound and whether it is met, "no figure" where its case could not run), then the
details (failures with their
assertions and tracebacks, probe tables, bench output, environment), and the raw logs, junit
XML and probe JSON beside it. It also writes DATE-DEVICE-torchVERSION.md there, the same
summary and failures in one file to commit as benchmarks/results/gpu/DATE-DEVICE-torchVERSION.md
(`--commit-copy` copies it there itself), and prints its path. Exit status: 0 when every phase
was ok, 1 otherwise.

Without CUDA it prints what it would have run (the phases, their commands and limits, and the
test list) and exits 0, writing nothing.

This file is also the pytest plugin the tests phase loads (`-p gpu_report`, scripts/ on
PYTHONPATH): it selects the real-GPU or the simulated tests, caps each test's timeout, and logs
each outcome as it happens. Standard library only (pytest inside pytest); it never imports
torch itself (scripts/gpu_probes.py and the pytest processes do), so the process that keeps the
budget holds no CUDA context.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:  # the plugin half: pytest is there whenever pytest loads this module
    import pytest

    _hookimpl: Callable[..., Any] = pytest.hookimpl
except ImportError:  # pragma: no cover - the script half runs without pytest too
    def _hookimpl(**_: Any) -> Callable[[Any], Any]:
        return lambda f: f

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

PHASE_NAMES = ("env", "tests", "probes", "bench", "example")
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 20.0  # kept back from every phase: a killed phase's grace, and the summary
MIN_PHASE_S = 20.0  # a phase that would get less is not started
MIN_STEP_S = 5.0
PER_TEST_TIMEOUT_S = 120.0
BENCH_CAP_S = 240.0  # 3 models x 4 peers x (warm-up + 50 rounds of 64 callers), and exports
BENCH_JSON = "bench.json"

# The modules of tests that need CUDA: real-GPU tests (skipped without it) and the simulated
# GPU's. gpu_test_modules() adds any other test file that uses the real-GPU marker.
GPU_TEST_MODULES = (
    "tests/integration/test_gpu_executor.py",
    "tests/integration/test_cuda_graphs.py",
    "tests/integration/test_cuda_graph_segments.py",
    "tests/integration/test_streams.py",
    "tests/integration/test_trio_gpu.py",
    "tests/integration/test_bench_gpu.py",
    "tests/integration/test_host_wait.py",
    "tests/unit/test_protect_outputs.py",
    "tests/unit/test_stream_plan.py",
    "tests/integration/test_stream_count.py",
)
REAL_GPU_REASON = "needs a CUDA GPU"  # tests/support/real_gpu.py's needs_gpu skip reason
# a file using the marker: `@needs_gpu`, `pytestmark = needs_gpu` (or in a list), the reason
_USES_MARKER = re.compile(r"(@|=\s*\[?|,\s*)needs_gpu\b|reason=\"" + re.escape(REAL_GPU_REASON))
_NOT_GPU_TESTS = frozenset({"tests/integration/test_gpu_report.py"})  # this script's own tests

ENV_SELECT = "GPU_REPORT_SELECT"  # "real": only the real-GPU tests; "simulated": the others
ENV_OUTCOMES = "GPU_REPORT_OUTCOMES"  # a JSON-lines file: one line per test start and outcome
ENV_TIMEOUT_CAP = "GPU_REPORT_TIMEOUT_CAP"  # seconds: no test's timeout above it


def gpu_test_modules(root: Path = ROOT) -> list[str]:
    """The GPU test modules that exist, then every other test file using the real-GPU marker
    (found by reading the files, without importing them)."""
    found = [m for m in GPU_TEST_MODULES if (root / m).is_file()]
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in found or "/support/" in rel or rel in _NOT_GPU_TESTS:
            continue
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if _USES_MARKER.search(text):
                found.append(rel)
    return found


# == the pytest plugin ===========================================================================


def is_real_gpu_test(item: Any) -> bool:
    """A test skipped without CUDA with the real-GPU reason (tests/support/real_gpu.py)."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if not reason and len(mark.args) > 1:
            reason = str(mark.args[1])
        if REAL_GPU_REASON in reason:
            return True
    return False


@_hookimpl(trylast=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    select = os.environ.get(ENV_SELECT, "")
    if select in ("real", "simulated"):
        keep, drop = [], []
        for item in items:
            (keep if is_real_gpu_test(item) == (select == "real") else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    cap = float(os.environ.get(ENV_TIMEOUT_CAP, "0") or 0)
    if cap > 0 and config.pluginmanager.hasplugin("timeout"):
        import pytest as _pytest

        try:
            default = float(config.getini("timeout") or 0)
        except (ValueError, TypeError):
            default = 0.0
        for item in items:
            mark = item.get_closest_marker("timeout")
            own = float(mark.args[0]) if mark is not None and mark.args else default
            limit = min(own, cap) if own > 0 else cap
            item.add_marker(_pytest.mark.timeout(limit), append=False)


def _log_outcome(row: dict[str, Any]) -> None:
    path = os.environ.get(ENV_OUTCOMES)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _log_outcome({"event": "start", "nodeid": nodeid, "t": round(time.time(), 2)})


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _log_outcome({"event": "finish", "nodeid": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and report.passed:
        return
    if report.when == "teardown" and report.skipped:
        return
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = str(crash.message)
    elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        message = str(report.longrepr[2])  # a skip: (file, line, reason)
    _log_outcome({
        "event": "report", "nodeid": report.nodeid, "when": report.when,
        "outcome": report.outcome, "seconds": round(report.duration, 3),
        "message": message[:2000], "text": report.longreprtext[-30000:],
    })


# == phases, steps and the budget ===============================================================


@dataclasses.dataclass
class Step:
    """One subprocess of a phase: its command, log file (in the output directory) and cap."""

    name: str
    argv: list[str]
    log: str
    cap_s: float
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    grace_s: float = 3.0  # after SIGINT (pytest writes its junit XML then), before SIGTERM


@dataclasses.dataclass
class Phase:
    name: str
    cap_s: float
    steps: list[Step]
    what: str = ""


@dataclasses.dataclass
class StepResult:
    name: str
    log: str
    rc: int | None = None  # None: not run
    seconds: float = 0.0
    limit_s: float = 0.0
    timed_out: bool = False
    note: str = ""


@dataclasses.dataclass
class PhaseResult:
    name: str
    status: str  # ok, FAILED, TIMEOUT, NOT RUN
    seconds: float = 0.0
    limit_s: float = 0.0
    steps: list[StepResult] = dataclasses.field(default_factory=list)
    note: str = ""


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def run_step(step: Step, out_dir: Path, timeout_s: float, base_env: dict[str, str]) -> StepResult:
    """Run `step` in a session of its own, its output appended to its log; past `timeout_s`
    its process group gets SIGINT, then SIGTERM, then SIGKILL, and what it wrote is kept."""
    log_path = out_dir / step.log
    result = StepResult(step.name, step.log, limit_s=round(timeout_s, 1))
    env = {**base_env, **step.env}
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(step.argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            result.rc = proc.wait(timeout=timeout_s)
        except KeyboardInterrupt:  # the run is interrupted: its child goes too
            _signal_group(proc, signal.SIGKILL)
            raise
        except subprocess.TimeoutExpired:
            result.timed_out = True
            for sig, grace in ((signal.SIGINT, step.grace_s), (signal.SIGTERM, 3.0),
                               (signal.SIGKILL, 10.0)):
                _signal_group(proc, sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            result.rc = proc.poll()
        result.seconds = round(time.monotonic() - start, 1)
        if result.timed_out:
            result.note = f"TIMEOUT: killed after {timeout_s:.0f} s (partial output kept)"
            log.write(f"\n### {result.note}\n".encode())
    return result


def run_phases(
    phases: Sequence[Phase], out_dir: Path, budget_s: float, *,
    reserve_s: float = RESERVE_S, min_phase_s: float = MIN_PHASE_S,
    min_step_s: float = MIN_STEP_S, clock: Callable[[], float] = time.monotonic,
    echo: Callable[[str], None] = print, base_env: dict[str, str] | None = None,
    results: list[PhaseResult] | None = None,
) -> list[PhaseResult]:
    """Run the phases in order within `budget_s`: each under min(its cap, what the budget has
    left less `reserve_s`); one that would get less than `min_phase_s` is not started. Inside a
    phase, each step under min(its cap, what the phase has left). Each phase's result is
    appended to `results` (returned) as soon as it has one."""
    env = dict(os.environ if base_env is None else base_env)
    start = clock()
    deadline = start + budget_s
    results = [] if results is None else results
    for phase in phases:
        left = deadline - clock() - reserve_s
        limit = min(phase.cap_s, left)
        if limit < min_phase_s:
            note = (f"not run: budget ({max(0.0, left):.0f} s left, needs at least "
                    f"{min_phase_s:.0f} s)")
            echo(f"[+{clock() - start:5.0f}s] SKIP  {phase.name}: {note}")
            results.append(PhaseResult(phase.name, "NOT RUN", note=note,
                                       steps=[StepResult(s.name, s.log) for s in phase.steps]))
            continue
        phase_start = clock()
        phase_deadline = phase_start + limit
        result = PhaseResult(phase.name, "ok", limit_s=round(limit, 1))
        for step in phase.steps:
            step_limit = min(step.cap_s, phase_deadline - clock())
            if step_limit < min(min_step_s, 0.9 * limit):
                sr = StepResult(step.name, step.log, note="not run: the phase's time limit")
                result.steps.append(sr)
                echo(f"[+{clock() - start:5.0f}s] SKIP  {step.name}: {sr.note}")
                continue
            echo(f"[+{clock() - start:5.0f}s] BEGIN {step.name} (limit {step_limit:.0f} s) "
                 f"-> {step.log}")
            sr = run_step(step, out_dir, step_limit, env)
            result.steps.append(sr)
            echo(f"[+{clock() - start:5.0f}s] END   {step.name}: rc {sr.rc} after "
                 f"{sr.seconds:.0f} s{'  TIMEOUT' if sr.timed_out else ''}")
        result.seconds = round(clock() - phase_start, 1)
        if any(s.timed_out for s in result.steps):
            result.status = "TIMEOUT"
        elif any(s.rc not in (0, None) for s in result.steps):
            result.status = "FAILED"
        elif any(s.rc is None for s in result.steps):
            result.status = "FAILED"
            result.note = "a step was not run: the phase's time limit"
        results.append(result)
    return results


# == test results: junit XML, the outcomes log, poisoning ======================================


@dataclasses.dataclass
class Case:
    """One outcome of one test (a test failing in its call and erroring in its teardown has
    two)."""

    nodeid: str
    outcome: str  # passed, failed, error, skipped
    when: str = "call"  # setup, call, teardown, collection
    message: str = ""
    text: str = ""
    seconds: float = 0.0
    output: str = ""


_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _nodeid(case: ET.Element, root: Path) -> str:
    classname = case.get("classname", "")
    name = case.get("name", "")
    file = case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        return "::".join(p for p in (file, *rest.split("."), name) if p)
    if not classname:  # a collection error: name is the module's dotted path
        return name.replace(".", "/") + ".py" if name else "?"
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        candidate = "/".join(parts[:k]) + ".py"
        if (root / candidate).is_file():
            return "::".join([candidate, *parts[k:], name])
    return f"{classname}::{name}"


def _meaningful_output(case: ET.Element) -> str:
    """The captured stdout, stderr and log of a testcase, without pytest's empty headers."""
    chunks = []
    for tag in ("system-out", "system-err"):
        for el in case.findall(tag):
            text = el.text or ""
            body = "\n".join(line for line in text.splitlines()
                             if line.strip() and not re.fullmatch(r"-+ Captured \w+ -+", line))
            if body.strip():
                chunks.append(text.strip())
    return "\n".join(chunks)


def parse_junit(path: Path, root: Path = ROOT) -> list[Case]:
    """Every outcome in a pytest junit XML file, in run order."""
    cases: list[Case] = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        nodeid = _nodeid(tc, root)
        seconds = float(tc.get("time", 0) or 0)
        output = _meaningful_output(tc)
        found = False
        for child in tc:
            tag = child.tag
            if tag not in ("failure", "error", "skipped"):
                continue
            found = True
            message = child.get("message", "")
            text = child.text or ""
            if tag == "skipped":
                cases.append(Case(nodeid, "skipped", "setup", message, text, seconds))
                continue
            when = "call"
            m = re.match(r"failed on (setup|teardown) with ", message)
            if m:
                when = m.group(1)
                message = message[m.end():].strip().strip('"')
            elif message == "collection failure" or not tc.get("classname"):
                when = "collection"
            # a failure is the test's own assertion; an error is outside its call (a fixture's
            # setup or teardown, the collection of its module)
            outcome = "failed" if tag == "failure" and when == "call" else "error"
            cases.append(Case(nodeid, outcome, when, message, text, seconds, output))
        if not found:
            cases.append(Case(nodeid, "passed", "call", seconds=seconds))
    return cases


def parse_outcomes(path: Path) -> tuple[list[Case], str | None]:
    """The outcomes the plugin logged as they happened (when a killed run left no junit XML),
    and the test that was running when the process ended, if any."""
    cases: list[Case] = []
    running: str | None = None
    if not path.exists():
        return cases, None
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("event") == "start":
            running = row.get("nodeid")
            continue
        if row.get("event") == "finish":
            running = None
            continue
        when, outcome = row.get("when", "call"), row.get("outcome", "")
        if outcome == "passed":
            kind = "passed"
        elif outcome == "skipped":
            kind = "skipped"
        else:
            kind = "failed" if when == "call" else "error"
        cases.append(Case(row.get("nodeid", "?"), kind, when, row.get("message", ""),
                          row.get("text", ""), float(row.get("seconds", 0) or 0)))
    return cases, running


# Failures after which the CUDA context or torch's caching allocator may be broken for the
# rest of the process: the later results of that run may follow from it.
POISON_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"captures_underway", "the caching allocator still counts a capture under way"),
    (r"illegal memory access", "an illegal memory access (the CUDA context is lost)"),
    (r"device-side assert", "a device-side assert (the CUDA context is lost)"),
    (r"cudaErrorStreamCapture\w*|operation not permitted when stream is capturing"
     r"|stream is capturing", "a CUDA call that broke a capture"),
    (r"CUDA error", "a CUDA error"),
    (r"CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+", "a cuBLAS or cuDNN error"),
    (r"INTERNAL ASSERT FAILED", "an internal assert of torch"),
    (r"CUDA out of memory", "CUDA out of memory"),
    (r"Timeout \(?>", "a test stopped by its timeout (its kernels or capture may still run)"),
)


def error_lines(text: str) -> list[str]:
    """The `E   ` lines of a pytest traceback: the exception and the assertion's explanation."""
    return [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]


def raised_at(text: str) -> str:
    """The last `path:line: Exception` line of a pytest traceback: where it was raised."""
    found = re.findall(r"^(\S+?\.py:\d+: \S+)\s*$", text, re.MULTILINE)
    return found[-1] if found else ""


def poison_reason(case: Case) -> str | None:
    """Why `case` may have poisoned the CUDA context for the tests after it, or None. Reads
    the failure's message and exception lines only, not the source lines around them."""
    if case.outcome not in ("failed", "error"):
        return None
    lines = [case.message, *error_lines(case.text)]
    for pattern, why in POISON_PATTERNS:
        for line in lines:
            if re.search(pattern, line):
                return f"{why}: {' '.join(line.split())[:200]}"
    return None


@dataclasses.dataclass
class PytestRun:
    """One pytest process's results, summarised."""

    key: str
    title: str
    source: str  # junit, outcomes (cut short), none
    cases: list[Case]
    counts: dict[str, int]
    failures: list[Case]
    poison: tuple[Case, str, int, int] | None = None  # case, why, tests after, failures after
    running: str | None = None  # the test running when the process was killed


def summarize_run(key: str, title: str, cases: list[Case], source: str = "junit",
                  running: str | None = None) -> PytestRun:
    worst: dict[str, str] = {}
    for case in cases:
        current = worst.get(case.nodeid)
        if current is None or _RANK[case.outcome] > _RANK[current]:
            worst[case.nodeid] = case.outcome
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for outcome in worst.values():
        counts[outcome] += 1
    failures = [c for c in cases if c.outcome in ("failed", "error")]
    run = PytestRun(key, title, source, cases, counts, failures, running=running)
    for i, case in enumerate(cases):
        why = poison_reason(case)
        if why is not None:
            later = cases[i + 1:]
            after = len({c.nodeid for c in later} - {case.nodeid})
            failed_after = len({c.nodeid for c in later if c.outcome in ("failed", "error")}
                               - {case.nodeid})
            run.poison = (case, why, after, failed_after)
            break
    return run


def load_run(out_dir: Path, key: str, title: str) -> PytestRun | None:
    """The results of one pytest step: its junit XML, else the outcomes its plugin logged."""
    junit = out_dir / f"tests-{key}.xml"
    outcomes = out_dir / f"tests-{key}.jsonl"
    logged, running = parse_outcomes(outcomes)  # running: a test that started, never finished
    if junit.exists():
        try:
            return summarize_run(key, title, parse_junit(junit), "junit", running)
        except ET.ParseError:
            pass
    if outcomes.exists():
        return summarize_run(key, title, logged, "outcomes log (no junit XML: the run was cut "
                             "short)", running)
    return None


def counts_line(run: PytestRun) -> str:
    c = run.counts
    if not run.cases:
        return f"{run.title}: no test ran (none selected, or the run stopped before the first)"
    return (f"{run.title}: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
            f"{c['skipped']} skipped")


# == reading what the phases left ===============================================================


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_log(path: Path, max_lines: int | None = None) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    if max_lines is not None:
        lines = text.splitlines()
        if len(lines) > max_lines:
            cut = len(lines) - max_lines
            text = "\n".join([*lines[:max_lines], f"... ({cut} more lines in the log)"])
    return text


def env_figures(env: dict[str, Any] | None) -> str:
    if not env:
        return "no result"
    parts = [f"{env.get('device', 'no device')}, torch {env.get('torch')} "
             f"(CUDA {env.get('torch_cuda')}), Python {env.get('python')}"]
    check = env.get("capture_check") or {}
    stats = check.get("stats") or {}
    if check:
        if check.get("error"):
            parts.append(f"capture check ERROR {check['error'][:120]}")
        else:
            parts.append(f"capture check: {stats.get('captures')} captures, "
                         f"{stats.get('replays')} replays, max diff {check.get('maxdiff')}"
                         f"{'' if check.get('ok') else ' (NOT OK)'}")
    if env.get("missing_required"):
        parts.append(f"MISSING {', '.join(env['missing_required'])}")
    return "; ".join(parts)


def wait_figures(wait: dict[str, Any] | None) -> str:
    if not wait or not wait.get("rows"):
        return "wait: no result"
    cells = [f"{r['loop']} +{r.get('asyncgraph_p50_us', '?')} us"
             for r in wait["rows"] if r.get("target_us") == 300]
    return "wait added at 300 us (p50): " + ", ".join(cells)


def capture_failure_figures(cf: dict[str, Any] | None) -> str:
    if not cf:
        return "capture failure: no result"
    if cf.get("error"):
        return f"capture failure: ERROR {cf['error'][:100]}"
    tried = cf.get("tried") or []
    chosen = next((t for t in tried if (t.get("stats") or {}).get("failures")), None)
    if chosen is None:
        return "capture failure: no capture could be made to fail"
    growth = chosen.get("growth_after_failure") or {}
    return (f"capture failure ({chosen.get('trigger')}): empty_cache "
            f"{str(chosen.get('empty_cache', '?'))[:60]}, +{growth.get('allocated_MiB')} MiB "
            f"allocated / +{growth.get('reserved_MiB')} MiB reserved over "
            f"{growth.get('runs')} runs")


def concurrency_figures(cc: dict[str, Any] | None) -> str:
    if not cc:
        return "64 frames: no result"
    parts = []
    for key in ("graphs", "no_graphs"):
        d = cc.get(key) or {}
        if "error" in d:
            parts.append(f"{key.replace('_', ' ')} ERROR")
        elif d:
            parts.append(f"{key.replace('_', ' ')} {d.get('bad')} bad of {d.get('calls')}")
    return f"{cc.get('callers', 64)} frames: " + (", ".join(parts) or "no result")


_STREAMS = re.compile(r"^(.*?): latency on 1 stream / on (\d+) streams: ([\d.]+)x", re.MULTILINE)


def bench_figures(text: str, bench: dict[str, Any] | None = None,
                  concurrency: dict[str, Any] | None = None) -> str:
    """The bench phase's cell: its issue-50 targets counted (from its JSON), its errors."""
    parts = []
    if bench is not None:
        rows = target_rows(bench, concurrency)
        verdicts = [r.verdict for r in rows]
        parts.append(f"issue-50 targets: {verdicts.count(MET)} met, {verdicts.count(NOT_MET)} "
                     f"not met, {verdicts.count(NO_FIGURE)} no figure (see the targets table)")
        unbatched = [r for r in rows if r.target.key == "unbatched" and r.value is not None]
        if unbatched:
            parts.append("64 callers unbatched / to_thread(eager): " + ", ".join(
                f"{r.target.model} x{r.value:.2f}" for r in unbatched))
        errors = bench.get("errors") or []
        if errors:
            parts.append(f"{len(errors)} cases raised: " + ", ".join(
                f"{e.get('model')}/{e.get('peer')}" for e in errors[:6]))
        if not bench.get("complete"):
            parts.append("cut short (the JSON holds the cases it finished)")
    if "Traceback" in text:
        parts.append("a traceback in the output")
    if "cannot run" in text:
        parts.append("said it cannot run (no CUDA)")
    return "; ".join(parts) or "see the output"


def example_figures(text: str) -> str:
    found = _STREAMS.findall(text)
    parts = [f"{name.strip()} 1/{n} streams x{r}" for name, n, r in found]
    if "Traceback" in text:
        parts.append("a traceback in the output")
    return "; ".join(parts) or "see the output"


# == issue 50's targets ==========================================================================

MET, NOT_MET, NO_FIGURE = "met", "NOT MET", "no figure"
ISSUE50_MODELS = ("encoder", "cnn", "wide-mlp")
ISSUE50_CALLERS = 64
ISSUE50_MIN_ROUNDS = 50  # timed rounds of the 64-caller cases, after their warm-up
# benchmarks/gpu.py's sections and the peers the targets read (its PEERS)
ONE_CALLER, MANY_CALLERS = "one-caller", "many-callers"
BASELINE = "to-thread-eager"


@dataclasses.dataclass(frozen=True)
class Target:
    """One bound of issue 50's table ("Targets"): a figure of benchmarks/gpu.py's JSON (or of
    the `concurrency` probe), `op` ">=" or "<=" `bound`, for one model (None: all)."""

    key: str
    what: str
    model: str | None
    op: str
    bound: float
    unit: str  # "x" a ratio, "ms", "" a count


_UNBATCHED_BOUNDS = {"encoder": 2.0, "cnn": 5.0, "wide-mlp": 5.0}
_BATCHED_BOUNDS = {"encoder": 3.0, "cnn": 10.0, "wide-mlp": 10.0}

ISSUE50_TARGETS: tuple[Target, ...] = (
    *(Target("unbatched", f"{ISSUE50_CALLERS} callers, unbatched, all replaying / "
             "to_thread(eager)", m, ">=", b, "x") for m, b in _UNBATCHED_BOUNDS.items()),
    *(Target("batched", f"{ISSUE50_CALLERS} callers, batched into bucket graphs / "
             "to_thread(eager)", m, ">=", b, "x") for m, b in _BATCHED_BOUNDS.items()),
    *(Target("one-caller", "one caller, captured / a CUDA graph of eager", m, "<=", 1.15, "x")
      for m in ISSUE50_MODELS),
    *(Target("loop-lag", f"loop lag p99 under {ISSUE50_CALLERS} callers", m, "<=", 2.0, "ms")
      for m in ISSUE50_MODELS),
    Target("wrong-outputs", "64 frames replaying at once: wrong outputs", None, "<=", 0, ""),
)

#: (section, peer) of benchmarks/gpu.py that each kind of target reads: its figure, then
#: what it is divided by (ratios) or the other cases it covers.
TARGET_PEERS: dict[str, tuple[tuple[str, str], ...]] = {
    "unbatched": ((MANY_CALLERS, "asyncgraph"), (MANY_CALLERS, BASELINE)),
    "batched": ((MANY_CALLERS, "asyncgraph-batched"), (MANY_CALLERS, BASELINE)),
    "one-caller": ((ONE_CALLER, "asyncgraph-captured"), (ONE_CALLER, "graph-of-eager")),
    "loop-lag": ((MANY_CALLERS, "asyncgraph"), (MANY_CALLERS, "asyncgraph-batched")),
    "wrong-outputs": ((MANY_CALLERS, "asyncgraph"), (MANY_CALLERS, "asyncgraph-batched")),
}


@dataclasses.dataclass
class TargetRow:
    target: Target
    value: float | None  # None: no figure
    figure: str  # the figure and what it is made of, or why there is none
    verdict: str  # MET, NOT_MET, NO_FIGURE


def _bench_case(bench: dict[str, Any] | None, section: str, model: str | None,
                peer: str) -> dict[str, Any] | None:
    for case in (bench or {}).get("cases") or []:
        if (case.get("section"), case.get("model"), case.get("peer")) == (section, model, peer):
            return dict(case)
    return None


def _why_missing(bench: dict[str, Any] | None, section: str, model: str | None,
                 peer: str) -> str:
    if bench is None:
        return "the benchmark left no results"
    for err in bench.get("errors") or []:
        if (err.get("section"), err.get("model"), err.get("peer")) == (section, model, peer):
            return f"{peer} raised {str(err.get('error'))[:160]}"
    if model is not None and model not in ((bench.get("args") or {}).get("models") or [model]):
        return f"{model} was not selected (--models)"
    done = "" if bench.get("complete") else " (the run was cut short)"
    return f"{peer} was not measured{done}"


def _judge(target: Target, value: float) -> str:
    ok = value >= target.bound if target.op == ">=" else value <= target.bound
    return MET if ok else NOT_MET


def _ratio_row(target: Target, bench: dict[str, Any] | None) -> TargetRow:
    (section, ours_key), (_, theirs_key) = TARGET_PEERS[target.key]
    ours = _bench_case(bench, section, target.model, ours_key)
    theirs = _bench_case(bench, section, target.model, theirs_key)
    if ours is None or theirs is None:
        missing = ours_key if ours is None else theirs_key
        return TargetRow(target, None, _why_missing(bench, section, target.model, missing),
                         NO_FIGURE)
    if target.key == "one-caller":
        value = ours["ms"] / theirs["ms"]
        figure = f"x{value:.2f} ({ours['ms']:.3f} ms / {theirs['ms']:.3f} ms)"
        verdict = _judge(target, value)
        if not (ours.get("graphs") or {}).get("replays"):
            figure += "; NOT captured (no replays)"
            verdict = NOT_MET
        return TargetRow(target, value, figure, verdict)
    value = ours["calls_per_s"] / theirs["calls_per_s"]
    figure = f"x{value:.2f} ({ours['calls_per_s']:,.0f}/s / {theirs['calls_per_s']:,.0f}/s)"
    verdict = _judge(target, value)
    timed = ours.get("graphs_timed") or {}
    if not ours.get("all_replaying"):
        figure += (f"; NOT all replaying: {timed.get('replays', 0)} replays of "
                   f"{ours.get('executions')} executions, {timed.get('fallbacks', 0)} fallbacks")
        if not (ours.get("graphs") or {}).get("capturable"):
            figure += f", not captured whole ({(ours.get('graphs') or {}).get('reason')})"
        verdict = NOT_MET
    if not ours.get("settled", True):
        figure += f"; still capturing after {ours.get('warm_rounds')} warm-up rounds"
    if ours.get("callers") != ISSUE50_CALLERS:
        figure += f"; {ours.get('callers')} callers, not {ISSUE50_CALLERS}"
        verdict = NOT_MET
    if int(ours.get("rounds") or 0) < ISSUE50_MIN_ROUNDS:
        figure += f"; {ours.get('rounds')} timed rounds, fewer than {ISSUE50_MIN_ROUNDS}"
        verdict = NOT_MET
    return TargetRow(target, value, figure, verdict)


def _lag_row(target: Target, bench: dict[str, Any] | None) -> TargetRow:
    lags = []
    for section, key in TARGET_PEERS["loop-lag"]:
        case = _bench_case(bench, section, target.model, key)
        if case is not None and case.get("lag_p99_ms") is not None:
            lags.append((key, float(case["lag_p99_ms"])))
    if not lags:
        return TargetRow(target, None, _why_missing(bench, MANY_CALLERS, target.model,
                                                    "asyncgraph"), NO_FIGURE)
    value = max(lag for _, lag in lags)
    figure = f"{value:.2f} ms (" + ", ".join(f"{k} {lag:.2f}" for k, lag in lags) + ")"
    return TargetRow(target, value, figure, _judge(target, value))


def _wrong_row(target: Target, bench: dict[str, Any] | None,
               concurrency: dict[str, Any] | None) -> TargetRow:
    wrong, parts = 0, []
    graphs = (concurrency or {}).get("graphs") or {}
    if "bad" in graphs:
        wrong += int(graphs["bad"])
        parts.append(f"probe: {graphs['bad']} of {graphs.get('calls')} (distinct inputs)")
    elif concurrency is not None:
        why = graphs.get("error") or concurrency.get("error") or concurrency.get("skipped")
        parts.append(f"probe: no result ({str(why)[:120]})")
    else:
        parts.append("probe: not run")
    checked = 0
    for case in (bench or {}).get("cases") or []:
        if (case.get("section"), case.get("peer")) in TARGET_PEERS["wrong-outputs"]:
            wrong += int(case.get("wrong_outputs", 0))
            checked += int(case.get("checked_outputs", 0))
    if checked:
        parts.append(f"benchmark: {wrong - int(graphs.get('bad', 0))} of {checked} checked")
    if not parts or ("bad" not in graphs and not checked):
        why = "; ".join(parts) or "neither the probe nor the benchmark left results"
        return TargetRow(target, None, why, NO_FIGURE)
    return TargetRow(target, float(wrong), "; ".join(parts), _judge(target, float(wrong)))


def target_rows(bench: dict[str, Any] | None,
                concurrency: dict[str, Any] | None) -> list[TargetRow]:
    """Every issue-50 target with its figure from benchmarks/gpu.py's JSON (`bench`) and the
    `concurrency` probe's, or "no figure" and why."""
    rows = []
    for target in ISSUE50_TARGETS:
        if target.key == "loop-lag":
            rows.append(_lag_row(target, bench))
        elif target.key == "wrong-outputs":
            rows.append(_wrong_row(target, bench, concurrency))
        else:
            rows.append(_ratio_row(target, bench))
    return rows


def targets_table(rows: Sequence[TargetRow]) -> str:
    out = ["| target | model | figure | bound | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        t = r.target
        bound = f"{t.op} {t.bound:g}{' ' + t.unit if t.unit == 'ms' else t.unit}"
        out.append(f"| {_cell(t.what)} | {t.model or 'all'} | {_cell(r.figure)} | {bound} "
                   f"| {r.verdict} |")
    return "\n".join(out)


# == the report ===================================================================================


@dataclasses.dataclass
class Report:
    info: dict[str, Any]
    phases: list[PhaseResult]
    runs: list[PytestRun]
    env: dict[str, Any] | None
    probes: dict[str, dict[str, Any] | None]
    bench: str
    example: str
    commands: dict[str, list[str]]
    started: str
    took_s: float
    budget_s: float
    argv: list[str]
    revision: str
    name: str
    bench_json: dict[str, Any] | None = None  # benchmarks/gpu.py --json

    def targets(self) -> list[TargetRow]:
        return target_rows(self.bench_json, self.probes.get("concurrency"))


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _fence(text: str, max_lines: int | None = None) -> str:
    lines = text.rstrip("\n").splitlines()
    if max_lines is not None and len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines)"]
    body = "\n".join(lines)
    fence = "```"
    while fence in body:
        fence += "`"
    return f"{fence}\n{body}\n{fence}"


def phase_figures(report: Report, phase: PhaseResult) -> str:
    if phase.status == "NOT RUN":
        return phase.note
    extra = ""
    if phase.status == "TIMEOUT":
        killed = [s.name for s in phase.steps if s.timed_out]
        extra = f" (TIMEOUT: {', '.join(killed)} killed by its limit; partial output kept)"
    if phase.name == "env":
        return env_figures(report.env) + extra
    if phase.name == "tests":
        parts = [counts_line(r) for r in report.runs]
        for r in report.runs:
            if r.poison is not None:
                parts.append(f"{r.title} after {r.poison[0].nodeid}: MAY BE POISONED")
            if r.running:
                parts.append(f"killed while running {r.running}")
        return ("; ".join(parts) or "no results") + extra
    if phase.name == "probes":
        p = report.probes
        skipped = [f"{k}: {v['skipped']}" for k, v in p.items() if v and v.get("skipped")]
        if skipped:
            return "; ".join(skipped) + extra
        return "; ".join([wait_figures(p.get("wait")),
                          capture_failure_figures(p.get("capture_failure")),
                          concurrency_figures(p.get("concurrency"))]) + extra
    if phase.name == "bench":
        return bench_figures(report.bench, report.bench_json,
                             report.probes.get("concurrency")) + extra
    if phase.name == "example":
        return example_figures(report.example) + extra
    return extra.strip()


def summary_table(report: Report) -> str:
    rows = ["| phase | status | key figures | time |", "|---|---|---|---|"]
    for phase in report.phases:
        when = ("-" if phase.status == "NOT RUN"
                else f"{phase.seconds:.0f} s of {phase.limit_s:.0f} s")
        rows.append(f"| {phase.name} | {phase.status} | {_cell(phase_figures(report, phase))} "
                    f"| {when} |")
    return "\n".join(rows)


def failure_file(run: PytestRun, index: int, case: Case) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", case.nodeid.split("::", 1)[-1]).strip("-")[:60]
    return f"failures/{run.key}-{index:02d}-{slug}.txt"


def write_failure_files(out_dir: Path, runs: Sequence[PytestRun]) -> None:
    for run in runs:
        for i, case in enumerate(run.failures, 1):
            path = out_dir / failure_file(run, i, case)
            path.parent.mkdir(parents=True, exist_ok=True)
            parts = [f"{case.nodeid}\n{case.outcome} in {case.when}\n\n{case.message}\n",
                     case.text]
            if case.output:
                parts.append("\n\n---- captured output ----\n" + case.output)
            path.write_text("\n".join(parts))


def failures_section(report: Report, *, for_commit: bool, max_lines: int = 300) -> list[str]:
    out = ["## Failures and errors", ""]
    any_failure = False
    for run in report.runs:
        if run.source != "junit":
            out += [f"{run.title}: results from the {run.source}.", ""]
        if run.running:
            out += [f"**{run.title}: the process was killed while `{run.running}` ran** (it "
                    "hung, or the phase's limit came first); the tests after it did not run.", ""]
        if run.poison is not None:
            case, why, after, failed_after = run.poison
            out += [f"**{run.title}: later results may be poisoned.** `{case.nodeid}` "
                    f"({case.outcome} in {case.when}) shows {why}. Such a failure can leave the "
                    "CUDA context or torch's caching allocator broken for the rest of the "
                    f"process: the {after} tests after it in this run ({failed_after} of them "
                    "failed or errored) may fail because of it, not of their own code. Read "
                    "this failure first.", ""]
        if not run.failures:
            continue
        any_failure = True
        out += [f"### {run.title}: {len(run.failures)} failures and errors, in run order", ""]
        for i, case in enumerate(run.failures, 1):
            kind = "failed" if case.outcome == "failed" else f"error in {case.when}"
            out += [f"#### {i}. `{case.nodeid}` ({kind})", ""]
            assertion = error_lines(case.text)[:15] or [case.message]
            out += ["Assertion:", "", _fence("\n".join(assertion)), ""]
            where = raised_at(case.text)
            if where:
                out += [f"Raised at `{where}`.", ""]
            name = failure_file(run, i, case)
            if for_commit:
                out += [f"Traceback (`--tb=long`; in the run's directory: `{name}`):", ""]
            else:
                out += [f"Traceback (`--tb=long`; the full text with captured output: "
                        f"[{name}]({name})):", ""]
            out += [_fence(case.text or case.message, max_lines), ""]
    if not any_failure:
        out += ["None." if report.runs else "No test results.", ""]
    return out


def probes_section(report: Report) -> list[str]:
    out = ["## Probes (issue 36, items 1, 2 and 7)", ""]
    wait = report.probes.get("wait")
    out += ["### The host wait's added latency (item 1)", ""]
    if not wait:
        out += ["Not run or no result.", ""]
    elif wait.get("skipped") or wait.get("error"):
        out += [f"{wait.get('skipped') or wait.get('error')}", ""]
    if wait and wait.get("rows"):
        out += [f"Each wait: GPU work of `torch.cuda._sleep` ({wait.get('cycles_per_us')} cycles "
                "per us), awaited; added = the awaited time minus the GPU time (CUDA timing "
                f"events around the kernel), {wait['rows'][0].get('n')} waits per cell. "
                f"asyncgraph's wait: `{wait.get('wait')}`. The blocking "
                "`event.synchronize()` is the floor (launch and wake-up, no loop).", ""]
        has_old = any("old_poll_p50_us" in r for r in wait["rows"])
        head = ("| loop | GPU us (target / measured) | sync p50 / p99 | asyncgraph p50 / p99 "
                "| handed to the thread (of n + 5) |")
        if has_old:
            head += " sleeping poll of before p50 / p99 |"
        out += [head, "|---" * (head.count("|") - 1) + "|"]
        for r in wait["rows"]:
            row = (f"| {r['loop']} | {r['target_us']} / {r['gpu_us']} | +{r['sync_p50_us']} / "
                   f"+{r['sync_p99_us']} | +{r['asyncgraph_p50_us']} / "
                   f"+{r['asyncgraph_p99_us']} | {r.get('handed_to_thread')} |")
            if has_old:
                row += f" +{r.get('old_poll_p50_us', '-')} / +{r.get('old_poll_p99_us', '-')} |"
            out.append(row)
        out.append("")
        for loop, err in (wait.get("errors") or {}).items():
            out += [f"- {loop}: {err}"]
        out.append("")
    cf = report.probes.get("capture_failure")
    out += ["### A forced capture failure, then `empty_cache()` and memory (item 2)", ""]
    if not cf:
        out += ["Not run or no result.", ""]
    elif cf.get("skipped") or cf.get("error"):
        out += [f"{cf.get('skipped') or cf.get('error')}", ""]
        if cf.get("traceback"):
            out += [_fence(cf["traceback"], 60), ""]
    if cf and cf.get("tried"):
        runs = cf["tried"]
        for t in runs:
            s = t.get("stats") or {}
            out.append(f"- trigger `{t.get('trigger')}` ({t.get('forced', '-')}): plan "
                       f"\"{t.get('plan', '-')}\"; captures {s.get('captures')}, failures "
                       f"{s.get('failures')}, fallbacks {s.get('fallbacks')}; outputs vs eager: "
                       f"max diff {t.get('maxdiff')}")
            for reason in (s.get("failed") or [])[:1]:
                out.append(f"  - capture failed: `{_cell(reason)[:400]}`")
            if t.get("run_error") or t.get("error"):
                out.append(f"  - ERROR `{_cell(t.get('run_error') or t.get('error'))}`")
            if "empty_cache" in t:
                out.append(f"  - `torch.cuda.empty_cache()` after it: {t['empty_cache']}")
            g = t.get("growth_after_failure")
            if g:
                out.append(f"  - over {g.get('runs')} more executions of that Executor, outputs "
                           "dropped: allocated "
                           f"+{g.get('allocated_MiB')} MiB, reserved +{g.get('reserved_MiB')} "
                           f"MiB (every output kept would be "
                           f"{g.get('if_every_output_were_kept_MiB')} MiB)" if "error" not in g
                           else f"  - growth: ERROR {g['error']}")
        for key, label in (("plain_before", "before"), ("plain_after", "after")):
            g = cf.get(key)
            if g:
                out.append(f"- a plain stream-path Executor, {label}: allocated "
                           f"+{g.get('allocated_MiB')} MiB, reserved +{g.get('reserved_MiB')} "
                           f"MiB over {g.get('runs')} executions (every output kept would be "
                           f"{g.get('if_every_output_were_kept_MiB')} MiB)" if "error" not in g
                           else f"- plain Executor {label}: ERROR {g['error']}")
        if "torch_cuda_graph_after" in cf:
            out.append(f"- `torch.cuda.graph` capture and replay after it: "
                       f"{cf['torch_cuda_graph_after']}")
        if "leak" in cf:
            out.append(f"- leak (growth of at least half of every output kept): "
                       f"{'YES' if cf['leak'] else 'no'}")
        if cf.get("note"):
            out.append(f"- {cf['note']}")
        out.append("")
    cc = report.probes.get("concurrency")
    out += ["### 64 frames replaying at once (item 7)", ""]
    if not cc:
        out += ["Not run or no result.", ""]
    elif cc.get("skipped") or cc.get("error"):
        out += [f"{cc.get('skipped') or cc.get('error')}", ""]
    if cc and (cc.get("graphs") or cc.get("no_graphs")):
        out += [f"{cc.get('callers')} concurrent callers with distinct inputs, {cc.get('rounds')} "
                f"rounds, {cc.get('model')}, one stream per frame; every output compared with "
                "eager.", "",
                "| run | outputs checked | mismatches | max diff | live graphs | replays | "
                "capture failures |", "|---|---|---|---|---|---|---|"]
        for key in ("graphs", "no_graphs"):
            d = cc.get(key) or {}
            if "error" in d:
                out.append(f"| {key} | ERROR {_cell(d['error'])} | | | | | |")
            elif d:
                out.append(f"| {key} | {d.get('calls')} | {d.get('bad')} | {d.get('maxdiff')} | "
                           f"{d.get('live_graphs')} | {d.get('replays')} | {d.get('failures')} |")
        out += ["", f"Capture streams made: {cc.get('capture_streams_made')}, distinct: "
                f"{cc.get('capture_streams_distinct')} (fewer distinct than made: frames share a "
                "capture stream, and with it a cuBLAS workspace).", ""]
    return out


def env_section(report: Report) -> list[str]:
    env = report.env
    out = ["## Environment", ""]
    if not env:
        return [*out, "The env phase left no result.", ""]
    keys = ("device", "device_count", "capability", "memory_total_GiB", "driver", "python",
            "platform", "torch", "torch_cuda", "cudnn", "allow_tf32_matmul", "cuda_functions",
            "asyncgraph_path")
    out += ["| | |", "|---|---|"]
    out += [f"| {k} | {_cell(env[k])} |" for k in keys if k in env]
    out += [f"| {k} | {_cell(v)} |" for k, v in env.items() if k.startswith("env_")]
    out += ["", "Imports: " + ", ".join(f"{m} {v}" for m, v in (env.get("imports") or {}).items()),
            ""]
    check = env.get("capture_check")
    if check:
        out += ["One capture and replay through the real backend (a small exported program run "
                "by `Executor` with `cuda.graphs=True`):", "",
                _fence(json.dumps({k: v for k, v in check.items() if k != "traceback"},
                                  indent=1, default=str)), ""]
        if check.get("traceback"):
            out += [_fence(check["traceback"], 80), ""]
    return out


def render(report: Report, *, for_commit: bool) -> str:
    info = report.info
    title = (f"# GPU report: {info.get('device')}, torch {info.get('torch')}, "
             f"{report.started[:10]}")
    out = [title, "",
           f"`{shlex.join(['python', 'scripts/gpu_report.py', *report.argv])}` on "
           f"{report.revision}, Python {info.get('python')}; started {report.started} UTC, "
           f"took {report.took_s:.0f} s of a {report.budget_s:.0f} s budget.", "",
           "## Summary", "", summary_table(report), "",
           "### Issue-50 targets", "",
           "From the bench phase's JSON (benchmarks/gpu.py) and the concurrency probe; \"no "
           "figure\" where a case could not run.", "", targets_table(report.targets()), ""]
    for run in report.runs:
        if run.poison is not None:
            out += [f"**Warning:** {run.title}: a failure that may poison the CUDA context "
                    f"(`{run.poison[0].nodeid}`): later results of that run may follow from "
                    "it. See Failures.", ""]
    out += failures_section(report, for_commit=for_commit)
    out += probes_section(report)
    for name, text, cmd_key in (("Benchmark", report.bench, "bench"),
                                ("Example", report.example, "example")):
        cmd = report.commands.get(cmd_key)
        heading = f"## {name}" + (f": `{shlex.join(cmd)}`" if cmd else "")
        out += [heading, "", _fence(text, 200) if text.strip() else "No output.", ""]
    out += env_section(report)
    out += ["## Phases and commands", "", "| phase | step | rc | time | limit | note |",
            "|---|---|---|---|---|---|"]
    for phase in report.phases:
        for s in phase.steps:
            out.append(f"| {phase.name} | {s.name} | {s.rc if s.rc is not None else '-'} | "
                       f"{s.seconds:.0f} s | {s.limit_s:.0f} s | {_cell(s.note)} |")
    out.append("")
    for key, cmd in report.commands.items():
        out.append(f"- {key}: `{shlex.join(cmd)}`")
    out.append("")
    if not for_commit:
        out += ["## Files", "",
                "Logs: `env.log`, `tests-real.log`, `tests-simulated.log`, `probe-*.log`, "
                "`bench.log`, `example.log`; junit XML: `tests-*.xml`; outcomes as they happened: "
                "`tests-*.jsonl`; probe results: `*.json`; each failure's traceback: `failures/`; "
                f"to commit: `{report.name}.md` (as `benchmarks/results/gpu/{report.name}.md`).",
                ""]
    else:
        out += [f"Raw logs, junit XML and probe JSON stayed in the run's directory "
                f"(build/gpu-report/{report.name}/ by default); not committed.", ""]
    return "\n".join(out)


# == the run ======================================================================================


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def report_name(info: dict[str, Any], when: datetime.datetime) -> str:
    torch_version = str(info.get("torch", "unknown")).replace("+", "-")
    return f"{when:%Y-%m-%d}-{slug(str(info.get('device', 'unknown')))}-torch{slug(torch_version)}"


def unique_path(path: Path) -> Path:
    if not path.exists():
        return path
    for k in range(2, 1000):
        candidate = path.with_name(f"{path.stem}-{k}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise RuntimeError(f"no free name next to {path}")


_DETECT = (
    "import json, sys, importlib.util\n"
    "row = {'python': sys.version.split()[0]}\n"
    "try:\n"
    "    import torch\n"
    "    row['torch'] = torch.__version__\n"
    "    row['cuda'] = bool(torch.cuda.is_available())\n"
    "    if row['cuda']:\n"
    "        row['device'] = torch.cuda.get_device_name(0)\n"
    "        row['devices'] = torch.cuda.device_count()\n"
    "except Exception as exc:\n"
    "    row['error'] = f'{type(exc).__name__}: {exc}'\n"
    "row['pytest_timeout'] = importlib.util.find_spec('pytest_timeout') is not None\n"
    "print(json.dumps(row))\n"
)


def detect(python: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """torch's version and whether CUDA is there, from a subprocess (this one holds no CUDA
    context)."""
    try:
        proc = subprocess.run([python, "-c", _DETECT], capture_output=True, text=True,
                              timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"torch's import and CUDA check took over {timeout_s:.0f} s"}
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        return {"error": f"rc {proc.returncode}: {proc.stderr.strip()[-1500:]}"}


def git_revision() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "a checkout without git"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
        changed = len([line for line in dirty.stdout.splitlines() if line.strip()])
        return f"commit {head.stdout.strip()}" + (
            f" with {changed} changed tracked files" if changed else "")
    except (OSError, subprocess.TimeoutExpired):
        return "a checkout without git"


def command_for_tests(python: str, junit: str, modules: Sequence[str], per_test_s: float,
                   has_timeout: bool) -> list[str]:
    """The pytest command of a tests step (this module loaded as its plugin)."""
    argv = [python, "-m", "pytest", "-v", "-rfE", "--tb=long", "-p", "no:cacheprovider",
            "-p", "no:benchmark", "-p", "gpu_report", f"--junitxml={junit}",
            "-o", "junit_family=xunit1", "-o", "junit_logging=all",
            "-o", "junit_log_passing_tests=false", "--durations=15"]
    if has_timeout:
        argv += [f"--timeout={per_test_s:.0f}", "--timeout-method=signal"]
    return [*argv, *modules]


def build_phases(python: str, out_dir: Path, modules: Sequence[str], *, per_test_s: float,
                 has_timeout: bool, bench_args: Sequence[str],
                 wanted: Sequence[str] = PHASE_NAMES) -> list[Phase]:
    """The phases in run order, their steps' commands written for the output directory
    `out_dir` (junit XML, outcomes and JSON land there)."""
    probes = str(SCRIPTS / "gpu_probes.py")
    scripts_path = os.pathsep.join([str(SCRIPTS), str(ROOT)])

    def tests_step(key: str, cap: float) -> Step:
        argv = command_for_tests(python, str(out_dir / f"tests-{key}.xml"), modules, per_test_s,
                              has_timeout)
        return Step(f"tests-{key}", argv, f"tests-{key}.log", cap, env={
            ENV_SELECT: key, ENV_OUTCOMES: str(out_dir / f"tests-{key}.jsonl"),
            ENV_TIMEOUT_CAP: f"{per_test_s:.0f}",
            "PYTHONPATH": scripts_path + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }, grace_s=10.0)

    def probe_step(name: str, cap: float) -> Step:
        return Step(f"probe-{name}", [python, probes, name, str(out_dir / f"{name}.json")],
                    f"probe-{name}.log", cap)

    all_phases = {
        "env": Phase("env", 90, [probe_step("env", 90)],
                     "versions, imports, one capture and replay through the real backend"),
        "tests": Phase("tests", 270, [tests_step("real", 170), tests_step("simulated", 150)],
                       "the real-GPU tests, then the simulated-GPU tests of the same modules, "
                       "in two pytest processes"),
        "probes": Phase("probes", 150, [probe_step("wait", 60),
                                        probe_step("capture_failure", 60),
                                        probe_step("concurrency", 75)],
                        "host wait latency; a forced capture failure; 64 frames at once"),
        "bench": Phase("bench", BENCH_CAP_S, [Step(
            "bench", [python, "-m", "benchmarks.gpu", *bench_args, "--json",
                      str(out_dir / BENCH_JSON)], "bench.log", BENCH_CAP_S)],
            "benchmarks/gpu.py: one caller, 64 callers (unbatched, batched, to_thread(eager), "
            "per-thread CUDA graphs of eager), streams; the issue-50 targets"),
        "example": Phase("example", 90, [Step("example", [python, "examples/gpu_check.py",
                                                          "--skip-tests"], "example.log", 90)],
                         "examples/gpu_check.py (its tests are the tests phase's)"),
    }
    return [all_phases[name] for name in PHASE_NAMES if name in wanted]


def collect_real_gpu_tests(python: str, modules: Sequence[str],
                           timeout_s: float = 180.0) -> tuple[list[str], str]:
    """The real-GPU tests' node ids (pytest --collect-only with this plugin), or an error."""
    env = {**os.environ, ENV_SELECT: "real",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop(ENV_OUTCOMES, None)
    try:
        proc = subprocess.run(
            [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "-p", "no:benchmark", "-p", "gpu_report", *modules],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return [], f"collection took over {timeout_s:.0f} s"
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode not in (0, 5) and not ids:
        return [], f"collection failed (rc {proc.returncode}): {proc.stdout[-1500:]}"
    return ids, ""


def print_plan(phases: Sequence[Phase], budget_s: float, modules: Sequence[str],
               real_tests: Sequence[str] | None, collect_note: str) -> None:
    print(f"Within a budget of {budget_s:.0f} s, phase by phase (each phase's limit is the "
          "smaller of its cap and what the budget has left):")
    for phase in phases:
        print(f"\n  {phase.name} (cap {phase.cap_s:.0f} s): {phase.what}")
        for step in phase.steps:
            print(f"    {step.name} (cap {step.cap_s:.0f} s): {shlex.join(step.argv)}")
    print(f"\nThe GPU test modules ({len(modules)}); the tests phase runs their real-GPU tests "
          "in one pytest process and the rest (the simulated GPU) in another:")
    for m in modules:
        print(f"  {m}")
    if real_tests is not None:
        print(f"\nThe real-GPU tests (skipped here: '{REAL_GPU_REASON}'), {len(real_tests)}:")
        for t in real_tests:
            print(f"  {t}")
    if collect_note:
        print(f"\n(collecting the real-GPU tests: {collect_note})")


def parse_phases(values: Sequence[str] | None) -> list[str]:
    if not values:
        return list(PHASE_NAMES)
    wanted = [v.strip() for value in values for v in value.split(",") if v.strip()]
    unknown = [w for w in wanted if w not in PHASE_NAMES]
    if unknown:
        raise SystemExit(f"unknown phases {unknown}; choose from {', '.join(PHASE_NAMES)}")
    return wanted


def make_report(out_dir: Path, info: dict[str, Any], phases: list[PhaseResult],
                commands: dict[str, list[str]], started: datetime.datetime, took_s: float,
                budget_s: float, argv: list[str], name: str) -> Report:
    runs = [r for r in (load_run(out_dir, "real", "real GPU"),
                        load_run(out_dir, "simulated", "simulated GPU")) if r is not None]
    return Report(
        info=info, phases=phases, runs=runs, env=read_json(out_dir / "env.json"),
        probes={p: read_json(out_dir / f"{p}.json")
                for p in ("wait", "capture_failure", "concurrency")},
        bench=read_log(out_dir / "bench.log"), example=read_log(out_dir / "example.log"),
        bench_json=read_json(out_dir / BENCH_JSON),
        commands=commands, started=f"{started:%Y-%m-%d %H:%M}", took_s=took_s,
        budget_s=budget_s, argv=argv, revision=git_revision(), name=name,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="the report directory (default build/gpu-report/DATE-DEVICE-torchV)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="the whole run's time, in seconds (default 480)")
    parser.add_argument("--phases", nargs="+", metavar="PHASE",
                        help=f"a subset of {', '.join(PHASE_NAMES)} (space- or comma-separated)")
    parser.add_argument("--per-test-timeout", type=float, default=PER_TEST_TIMEOUT_S,
                        help="no test's timeout above this, in seconds (pytest-timeout)")
    parser.add_argument("--bench-args", default="--quick",
                        help="arguments of python -m benchmarks.gpu (default --quick)")
    parser.add_argument("--commit-copy", action="store_true",
                        help="also copy the report to benchmarks/results/gpu/")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run and exit, even with a GPU")
    parser.add_argument("--no-collect", action="store_true",
                        help="without CUDA or with --dry-run: do not collect the test list")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter the phases run with (default this one)")
    args = parser.parse_args(argv)
    wanted = parse_phases(args.phases)
    t0 = time.monotonic()
    started = datetime.datetime.now(datetime.UTC)

    info = detect(args.python)
    if "torch" not in info:
        print(f"gpu_report: cannot import torch with {args.python}: {info.get('error')}",
              file=sys.stderr)
        return 1
    modules = gpu_test_modules()
    name = report_name(info, started)
    out_dir = args.out if args.out is not None else ROOT / "build" / "gpu-report" / name
    bench_args = shlex.split(args.bench_args)
    has_timeout = bool(info.get("pytest_timeout"))
    if not info.get("cuda") or args.dry_run:
        where = out_dir if args.out is not None else "build/gpu-report/DATE-DEVICE-torchVERSION/"
        if not info.get("cuda"):
            print(f"No CUDA GPU here (torch {info.get('torch')}: torch.cuda.is_available() is "
                  "False): nothing was run or written. On a machine with one, "
                  "`python scripts/gpu_report.py` would run these phases and write its report "
                  f"to {where}.")
        else:
            print(f"--dry-run on {info.get('device')}: nothing was run or written.")
        phases = build_phases(args.python, out_dir, modules, per_test_s=args.per_test_timeout,
                              has_timeout=has_timeout, bench_args=bench_args, wanted=wanted)
        real_tests, note = (None, "") if args.no_collect else collect_real_gpu_tests(
            args.python, modules)
        print_plan(phases, args.budget_s, modules, real_tests, note)
        return 0

    if args.out is None:
        out_dir = unique_path(out_dir)
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_report: {info.get('device')}, torch {info.get('torch')}, Python "
          f"{info.get('python')}; budget {args.budget_s:.0f} s; writing to {out_dir}")
    if not has_timeout:
        print("gpu_report: pytest-timeout is not installed: the tests run without per-test "
              "limits (only the phase's)")
    phases = build_phases(args.python, out_dir, modules, per_test_s=args.per_test_timeout,
                          has_timeout=has_timeout, bench_args=bench_args, wanted=wanted)
    commands = {s.name: s.argv for p in phases for s in p.steps}
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    left = args.budget_s - (time.monotonic() - t0)
    results: list[PhaseResult] = []
    try:
        run_phases(phases, out_dir, left, base_env=base_env, results=results)
    except KeyboardInterrupt:  # report what ran
        done = {r.name for r in results}
        results += [PhaseResult(p.name, "NOT RUN", note="not run: interrupted")
                    for p in phases if p.name not in done]
    took = time.monotonic() - t0
    if args.out is None:
        name = out_dir.name  # with the suffix unique_path may have added
    report = make_report(out_dir, info, results, commands, started, took, args.budget_s,
                         list(sys.argv[1:] if argv is None else argv), name)
    write_failure_files(out_dir, report.runs)
    (out_dir / "README.md").write_text(render(report, for_commit=False))
    commit_md = out_dir / f"{name}.md"
    commit_md.write_text(render(report, for_commit=True))
    (out_dir / "summary.json").write_text(json.dumps({
        "info": info, "took_s": round(took, 1), "budget_s": args.budget_s,
        "phases": [dataclasses.asdict(p) for p in results],
        "targets": [{"key": r.target.key, "what": r.target.what, "model": r.target.model,
                     "bound": f"{r.target.op} {r.target.bound:g}", "value": r.value,
                     "figure": r.figure, "verdict": r.verdict} for r in report.targets()],
        "tests": {r.key: {"counts": r.counts, "source": r.source,
                          "poisoned_after": r.poison[0].nodeid if r.poison else None,
                          "killed_while": r.running,
                          "failures": [c.nodeid for c in r.failures]} for r in report.runs},
    }, indent=1, default=str))
    print("\n" + summary_table(report) + "\n")
    print("Issue-50 targets:\n" + targets_table(report.targets()) + "\n")
    print(f"report: {out_dir / 'README.md'}")
    if args.commit_copy:
        target = unique_path(ROOT / "benchmarks" / "results" / "gpu" / commit_md.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(commit_md, target)
        print(f"to commit: {target} (copied)")
    else:
        print(f"to commit: {commit_md}  (as benchmarks/results/gpu/{commit_md.name}, or rerun "
              "with --commit-copy)")
    return 0 if all(p.status == "ok" for p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
