"""Run one benchmark command and keep its output as a results file the README can quote.

    python scripts/bench_record.py benchmarks/results/cpu/NAME.json -- CMD [ARG ...]

The file holds the date (UTC), the machine (CPU model, core count, kernel), the load average
before and after, the git commit, the command and its wall time, and the report: the JSON the
command printed on stdout (`asyncgraph bench --json`, `python -m benchmarks.ort --json`,
`python -m benchmarks.nativert_compare --json`), or, for `python -m benchmarks.overhead`, which
prints text, its "  name  value" lines parsed into sections. tests/unit/test_readme_figures.py
checks the README's performance tables against these files.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
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


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    started = datetime.datetime.now(datetime.UTC)
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    load_end = list(os.getloadavg())
    if proc.returncode not in (0, 1):  # bench --check-less runs exit 0; 1 is a missed target
        print(f"error: {' '.join(command)} exited {proc.returncode}", file=sys.stderr)
        return proc.returncode
    try:
        report: Any = json.loads(proc.stdout)
        kind = "json"
    except json.JSONDecodeError:
        report, kind = parse_text(proc.stdout), "text"
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
    if kind == "text":
        record["stdout"] = proc.stdout
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{out}: {wall:.0f} s, load {load_start[0]:.2f} -> {load_end[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
