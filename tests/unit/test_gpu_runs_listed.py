"""benchmarks/results/gpu/README.md is the one list of real-GPU runs: every report in that
folder is in its table, and every link of the table points at a file that is there."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"


def _table_links() -> set[str]:
    text = (RESULTS / "README.md").read_text()
    table = text.split("\n\n| date |", 1)[1].split("\n\n", 1)[0]
    return {target.rstrip("/") for target in re.findall(r"\]\(([^)]+)\)", table)}


def test_every_report_in_the_folder_is_in_the_runs_table() -> None:
    links = _table_links()
    reports = {p.name for p in RESULTS.iterdir()
               if (p.suffix == ".md" and p.name != "README.md") or p.is_dir()}
    assert reports, "no reports found: the test would pass on nothing"
    missing = sorted(reports - links)
    assert not missing, f"runs not listed in benchmarks/results/gpu/README.md: {missing}"


def test_every_link_of_the_runs_table_exists() -> None:
    for target in _table_links():
        assert (RESULTS / target).exists(), f"benchmarks/results/gpu/README.md links {target}"


def test_the_other_pages_link_the_list_instead_of_counting_runs() -> None:
    root = RESULTS.parents[2]
    for page in ("README.md", "docs/gpu.md", "docs/support.md"):
        text = (root / page).read_text()
        assert "benchmarks/results/gpu" in text, f"{page} does not link the list of GPU runs"
        counted = re.findall(r"\b(?:one|two|three|four|five) (?:H200|H100|real-GPU) runs?\b", text)
        assert not counted, f"{page} counts runs: {counted}"
