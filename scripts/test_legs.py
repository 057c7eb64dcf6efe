"""Run every leg of `make test-all`, even after one fails, and end with one summary table.

Each leg is a make target. A pytest run inside it writes JUnit XML into the leg's folder
(the Makefile's JUNIT_DIR), which is where the passed / failed / skipped counts come from; a
leg without pytest (lint, types) counts as one check. The exit status is 1 when any leg
failed, so CI fails on any red leg but still shows all of them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

LEGS = {
    "fresh clone: make demo, make test": "fresh-clone",
    "soaks (full)": "soak",
    "torch 2.11": "test-torch-min",
    "python 3.12": "test-py312",
}


@dataclass
class Leg:
    name: str
    rc: int
    seconds: float
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    note: str = ""


def count(leg: Leg, folder: Path) -> None:
    """Add up the JUnit files a leg wrote; with none, the leg is one check (its exit code)."""
    files = sorted(folder.glob("*.xml"))
    if not files:
        leg.passed, leg.failed = (1, 0) if leg.rc == 0 else (0, 1)
        return
    for file in files:
        for suite in ET.parse(file).getroot().iter("testsuite"):
            tests = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            leg.failed += failed
            leg.skipped += skipped
            leg.passed += tests - failed - skipped
    if leg.rc != 0 and leg.failed == 0:
        leg.failed = 1
        leg.note = f"exit {leg.rc} outside the tests (install, collection or timeout)"


def run(name: str, target: str, root: Path, make_args: list[str]) -> Leg:
    folder = root.resolve() / "".join(c if c.isalnum() else "-" for c in name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"\n===== leg: {name} (make {target}) =====", flush=True)
    start = time.monotonic()
    rc = subprocess.call(["make", target, f"JUNIT_DIR={folder}", *make_args])
    leg = Leg(name, rc, time.monotonic() - start)
    count(leg, folder)
    if (folder / "NOT-RUN").exists():  # a leg this machine cannot run counts nothing
        leg.note = (folder / "NOT-RUN").read_text().strip()
        leg.passed = 0
    return leg


def table(legs: list[Leg]) -> str:
    rows = [("leg", "result", "passed", "failed", "skipped", "time", "note")]
    for leg in legs:
        result = "NOT RUN" if leg.note.startswith("NOT RUN") else "ok" if leg.rc == 0 else "FAILED"
        rows.append((leg.name, result, str(leg.passed), str(leg.failed), str(leg.skipped),
                     f"{leg.seconds / 60:.1f} min", leg.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
             for r in rows]
    passed, failed, skipped = (sum(getattr(leg, k) for leg in legs)
                               for k in ("passed", "failed", "skipped"))
    lines.append(f"summary: {passed} passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit-root", default="build/test-legs", type=Path)
    parser.add_argument("--leg", action="append", choices=list(LEGS),
                        help="run only these legs (repeatable); default: all")
    args, make_args = parser.parse_known_args()
    legs = [run(name, LEGS[name], args.junit_root, make_args)
            for name in (args.leg or list(LEGS))]
    print("\n===== summary =====")
    print(table(legs))
    return 0 if all(leg.rc == 0 for leg in legs) else 1


if __name__ == "__main__":
    sys.exit(main())
