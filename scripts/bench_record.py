"""Run one benchmark command and keep its output as a results file the README can quote.

    python scripts/bench_record.py benchmarks/results/cpu/NAME.json [--runs N] -- CMD [ARG ...]

The file holds the date (UTC), the machine (CPU model, core count, kernel), the load average
before and after, the git commit, the command and its wall time, and the report: the JSON the
command printed on stdout (`asyncgraph bench --json`, `python -m benchmarks.ort --json`,
`python -m benchmarks.nativert_compare --json`), or, for `python -m benchmarks.overhead`, which
prints text, its "  name  value" lines parsed into sections. tests/unit/test_readme_figures.py
checks the README's performance tables against these files.

With `--runs N` the command runs N times, one after the other, each in a process of its own:
on a shared machine a figure moves between runs (the load, the CPU a process lands on), and a
result that holds in one run only is not a result. The file then keeps every run's start, load
and targets (`runs`), each target's median, minimum and maximum over the runs (`spread`), and
as `report` the median run: the one whose targets lie closest to their medians (the sum of
|log(value / median)| over the targets), a run that happened, quoted whole.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_text(text: str) -> dict[str, dict[str, float]]:
    """`benchmarks.overhead`'s output: a header line ending in ':' opens a section, and each
    indented line is a name, then one or more numbers (the first is kept; a second, a ratio,
    is kept as 'NAME ratio')."""
    sections: dict[str, dict[str, float]] = {}
    current: dict[str, float] | None = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith(":"):
            current = sections.setdefault(line.rstrip().rstrip(":"), {})
            continue
        m = re.match(r"^\s+(.*?)\s+(-?[\d.]+)(?:\s+(-?[\d.]+))?\s*$", line)
        if m and current is not None:
            current[m.group(1)] = float(m.group(2))
            if m.group(3) is not None:
                current[m.group(1) + " ratio"] = float(m.group(3))
    return sections


def targets_of(report: Any) -> dict[str, float]:
    """A JSON report's targets that have a value, by name."""
    if not isinstance(report, dict):
        return {}
    return {t["name"]: t["value"] for case in report.get("cases", [])
            for t in case.get("targets", []) if isinstance(t.get("value"), int | float)}


def spread_of(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target's median, minimum, maximum and values over the runs that measured it."""
    names = sorted({name for run in runs for name in run["targets"]})
    spread = {}
    for name in names:
        values = [run["targets"][name] for run in runs if name in run["targets"]]
        spread[name] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values), "runs": values}
    return spread


def median_run(runs: list[dict[str, Any]], spread: dict[str, dict[str, Any]]) -> int:
    """The index of the run whose targets lie closest to their medians."""
    def distance(run: dict[str, Any]) -> float:
        return sum(abs(math.log(v / spread[n]["median"])) for n, v in run["targets"].items()
                   if v > 0 and spread[n]["median"] > 0)
    return min(range(len(runs)), key=lambda i: distance(runs[i]))


def run_once(command: list[str]) -> tuple[int, dict[str, Any], str]:
    """One run: its exit code, its start, load and wall time, and its stdout."""
    started = datetime.datetime.now(datetime.UTC)
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    run = {"started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"), "load_average_start":
           load_start, "load_average_end": list(os.getloadavg()),
           "wall_s": round(time.perf_counter() - t0, 1)}
    return proc.returncode, run, proc.stdout


def main(argv: list[str]) -> int:
    runs_wanted = 1
    if len(argv) >= 3 and argv[1] == "--runs":
        runs_wanted = int(argv[2])
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--" or runs_wanted < 1:
        print(__doc__, file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    started = datetime.datetime.now(datetime.UTC)
    runs, outputs = [], []
    for _ in range(runs_wanted):
        code, run, stdout = run_once(command)
        if code not in (0, 1):  # bench --check-less runs exit 0; 1 is a missed target
            print(f"error: {' '.join(command)} exited {code}", file=sys.stderr)
            return code
        runs.append(run)
        outputs.append(stdout)
    try:
        reports: list[Any] = [json.loads(stdout) for stdout in outputs]
        kind = "json"
    except json.JSONDecodeError:
        reports, kind = [parse_text(stdout) for stdout in outputs], "text"
    for run, report in zip(runs, reports, strict=True):
        run["targets"] = targets_of(report)
    spread = spread_of(runs)
    chosen = median_run(runs, spread) if len(runs) > 1 else 0
    report, proc_stdout = reports[chosen], outputs[chosen]
    load_start, load_end = runs[0]["load_average_start"], runs[-1]["load_average_end"]
    wall = sum(run["wall_s"] for run in runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    record = {
        "date": started.strftime("%Y-%m-%d"),
        "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(command),
        "commit": commit,
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": "shared development machine: other jobs ran beside the benchmark",
        },
        "load_average_start": load_start,
        "load_average_end": load_end,
        "wall_s": round(wall, 1),
        "output": kind,
        "report": report,
    }
    if len(runs) > 1:
        record["median_run"] = chosen
        record["runs"] = runs
        record["spread"] = spread
    if kind == "text":
        record["stdout"] = proc_stdout
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{out}: {wall:.0f} s, load {load_start[0]:.2f} -> {load_end[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
