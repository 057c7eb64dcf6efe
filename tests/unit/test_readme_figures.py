"""Every figure the README states is tied to the benchmark output that produced it, or dated.

* A performance table is a README table whose last column is "source". Its source cell links a
  results file under benchmarks/results/cpu/ (written by scripts/bench_record.py around
  `asyncgraph bench --json` and the other benchmark commands) and names, in a code span, the
  figure in it: a target's name (or the start of it), or a path `section > name` for a
  command that prints text. In a table with one figure per row the figure is the "measured"
  cell; in a table with a figure per graph each such column's header carries the graph's key
  in a code span, which replaces `{graph}` in the row's key.
* Each figure cell's first figure must equal the referenced value at the README's rounding;
  the other figures with a unit in the cell (ms, us, req/s, x) must equal, at their rounding,
  a value of the same case (a peer's median time, a peer's extra such as its throughput, a
  metric, a target); a "needs" cell must equal the target's operator and limit.
* Every other figure with a unit anywhere in the README (ms, us, x, req/s, GB, MB, s, min,
  %) must carry a date (YYYY-MM-DD) in the same sentence or table row.
* The docs this repository keeps describe history by date, never by rounds of work
  ("session 17", "the fourth session").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = "benchmarks/results/cpu/"

UNIT = r"(?:ms|us|µs|req/s|requests/s|GB|MB|KB|s|min|minutes|seconds|%)"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A figure: a number (or a range a-b) with a unit; a ratio is written `1.05x` (no space, so
# shapes such as `8x64` and counts such as `8 x Linear` are not ratios).
FIGURE = re.compile(
    rf"(?<![\w.-])({NUMBER})(?:-({NUMBER}))?(?:(x)(?![\w])|\s?({UNIT})(?![\w/]))"
)
BOLD = re.compile(rf"\*\*({NUMBER})\s?(x|{UNIT})?\*\*")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
SESSION = re.compile(
    r"\bsessions? \d+|\b(?:first|second|third|fourth|fifth|sixth|previous|earlier|later|next|"
    r"this|that) session\b|\bsession's machine",
    re.IGNORECASE,
)
OWN_DOCS = ["README.md", "CHANGELOG.md", "ARCHITECTURE.md", "benchmarks/README.md",
            "docs/compiled.md", "docs/gpu.md", "docs/support.md", "docs/scale-out.md"]


# -- reading the README ---------------------------------------------------------------------


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def split_cells(line: str) -> list[str]:
    """A table row's cells; `|` inside code spans (`a\\|b`) is escaped in the README."""
    return cells(line.replace("\\|", "\u2502"))


def tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """(line number of the header, header cells, rows) of every table outside code fences."""
    out: list[tuple[int, list[str], list[list[str]]]] = []
    lines = text.splitlines()
    fenced = False
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            fenced = not fenced
        if (not fenced and lines[i].startswith("|") and i + 1 < len(lines)
                and re.match(r"^\|[\s|:-]+\|$", lines[i + 1].strip())):
            header = split_cells(lines[i])
            j = i + 2
            rows = []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(split_cells(lines[j]))
                j += 1
            out.append((i + 1, header, rows))
            i = j
            continue
        i += 1
    return out


def performance_tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    return [t for t in tables(text) if t[1][-1].lower() == "source"]


def figures(cell: str) -> list[tuple[str, str]]:
    """(number as written, unit) of each figure in a cell; a range gives both ends."""
    cell = LINK_TARGET.sub("]", CODE_SPAN.sub("", cell))
    found = []
    # "A vs B ms": A has B's unit
    for m in re.finditer(rf"(?<![\w.-])({NUMBER}) vs (?={NUMBER}\s?({UNIT})(?![\w/]))", cell):
        found.append((m.group(1), m.group(2)))
    for m in FIGURE.finditer(cell):
        unit = m.group(3) or m.group(4)
        found.append((m.group(1), unit))
        if m.group(2):
            found.append((m.group(2), unit))
    return found


def as_written(value: float, written: str) -> str:
    digits = len(written.split(".")[1]) if "." in written else 0
    return f"{value:.{digits}f}"


def same(value: float, written: str) -> bool:
    return as_written(value, written.replace(",", "")) == written.replace(",", "")


# -- reading a results file -------------------------------------------------------------------


def load(path: str) -> dict[str, Any]:
    file = ROOT / path
    assert file.is_file(), f"{path}: no such results file"
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def resolve(record: dict[str, Any], key: str) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """(value, its case or section, its target or {}) for a key of a source cell."""
    report = record["report"]
    if " > " in key:
        node: Any = report
        section: dict[str, Any] = report
        for part in key.split(" > "):
            assert isinstance(node, dict) and part in node, f"no {part!r} in the results"
            section, node = node, node[part]
        return float(node), section, {}
    hits = [(t, c) for c in report["cases"] for t in c["targets"] if t["name"].startswith(key)]
    assert len(hits) == 1, f"key {key!r} names {len(hits)} targets in the results, not one"
    target, case = hits[0]
    assert target["value"] is not None, f"{key!r}: the run measured nothing"
    return float(target["value"]), case, target


def values_of(where: dict[str, Any]) -> list[tuple[float, str]]:
    """Every figure a cell may quote beside its first one: peers' medians (ms and us), their
    extras (throughput in req/s, *_ms), metrics, targets, or a text section's values."""
    out: list[tuple[float, str]] = []
    if "peers" not in where:  # a section of a text report
        return [(float(v), "any") for v in where.values() if isinstance(v, int | float)]
    for p in where["peers"]:
        if p.get("median_s") is not None:
            out += [(p["median_s"] * 1e3, "ms"), (p["median_s"] * 1e6, "us")]
        for k, v in p.get("extra", {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                unit = "req/s" if k == "throughput" else "ms" if k.endswith("_ms") else "any"
                out.append((float(v), unit))
    for v in where.get("metrics", {}).values():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out.append((float(v), "any"))
    for t in where.get("targets", []):
        if t["value"] is not None:
            out.append((float(t["value"]), t.get("unit") or "any"))
    return out


def unit_matches(written: str, known: str) -> bool:
    if known == "any":
        return True
    aliases = {"requests/s": "req/s", "µs": "us"}
    return aliases.get(written, written) == known


def check_cell(cell: str, record: dict[str, Any], key: str, where: str) -> list[str]:
    if cell in ("", "-"):
        return []
    bold = BOLD.search(cell)
    if bold:  # the quoted figure is the bold one; a count such as **2** has no unit
        rest = figures(cell.replace(bold.group(0), ""))
        found = [(bold.group(1), bold.group(2) or ""), *rest]
    else:
        found = figures(cell)
    if not found:
        return [f"{where}: no figure in {cell!r}"]
    value, case, target = resolve(record, key)
    errors = []
    number, unit = found[0]
    if not same(value, number):
        errors.append(f"{where}: {number}{unit} but the results say "
                      f"{as_written(value, number)} ({key!r})")
    if target and (target.get("unit") or "") != unit:
        errors.append(f"{where}: unit {unit!r}, the target's is {target['unit']!r}")
    known = values_of(case)
    for number, unit in found[1:]:
        if not any(unit_matches(unit, u) and same(v, number) for v, u in known):
            errors.append(f"{where}: {number} {unit} is no figure of the results' case "
                          f"for {key!r}")
    return errors


def check_needs(cell: str, target: dict[str, Any], where: str) -> list[str]:
    if cell in ("", "-") or not target:
        return []
    m = re.match(rf"^(<=|>=)\s*({NUMBER})\s*(x|ms|us)?$", cell.replace("**", ""))
    if not m:
        return [f"{where}: needs {cell!r} is not 'op limit'"]
    errors = []
    if m.group(1) != target["op"] or float(m.group(2)) != float(target["limit"]):
        errors.append(f"{where}: needs {cell!r}, the target is {target['op']} {target['limit']}")
    return errors


def tied_rows(text: str) -> tuple[set[int], list[str]]:
    """The line numbers of performance-table rows, and every error in those tables."""
    tied: set[int] = set()
    errors: list[str] = []
    for start, header, rows in performance_tables(text):
        keyed = {i: CODE_SPAN.findall(h) for i, h in enumerate(header[:-1])}
        graph_cols = {i: k[0].strip("`") for i, k in keyed.items() if k}
        lower = [h.lower() for h in header]
        measured = [lower.index("measured")] if "measured" in lower else []
        needs = lower.index("needs") if "needs" in lower else None
        columns = graph_cols or {i: "" for i in measured}
        if not columns:
            errors.append(f"README line {start}: a source table with no figure column")
        for n, row in enumerate(rows):
            line_no = start + 2 + n
            tied.add(line_no)
            where = f"README line {line_no}"
            src = row[-1]
            link = re.search(rf"\(({re.escape(RESULTS)}[^)]+\.json)\)", src)
            key = CODE_SPAN.search(src)
            if not link or not key:
                errors.append(f"{where}: the source cell needs a link to {RESULTS}*.json "
                              f"and a key in a code span: {src!r}")
                continue
            record = load(link.group(1))
            for i, graph in columns.items():
                k = key.group(0).strip("`").replace("{graph}", graph)
                try:
                    errors += check_cell(row[i], record, k, where)
                    if needs is not None and row[i] not in ("", "-"):
                        errors += check_needs(row[needs], resolve(record, k)[2], where)
                except AssertionError as exc:
                    errors.append(f"{where}: {exc}")
    return tied, errors


def undated(text: str, tied: set[int]) -> list[str]:
    """Figures with a unit outside the performance tables whose sentence or row has no date."""
    errors = []
    lines = text.splitlines()
    fenced = False
    paragraph: list[tuple[int, str]] = []

    def sentences(block: list[tuple[int, str]]) -> None:
        if not block:
            return
        joined = " ".join(t for _, t in block)
        for sentence in re.split(r"(?<=[.;!?])\s+(?=[A-Z(`*\[])", joined):
            if figures(sentence) and not DATE.search(sentence):
                errors.append(f"README line {block[0][0]}: {figures(sentence)} undated in "
                              f"{sentence[:120]!r}")

    for no, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or no in tied:
            continue
        if line.startswith("|"):
            sentences(paragraph)
            paragraph = []
            if figures(line) and not DATE.search(line):
                errors.append(f"README line {no}: {figures(line)} undated in row {line[:100]!r}")
            continue
        if not line.strip() or line.startswith("#"):
            sentences(paragraph)
            paragraph = []
            continue
        paragraph.append((no, line))
    sentences(paragraph)
    return errors


# -- the tests --------------------------------------------------------------------------------


def test_readme_has_performance_tables() -> None:
    text = README.read_text()
    perf = performance_tables(text)
    assert len(perf) >= 2, "the README's performance tables lost their source column"
    assert sum(len(rows) for _, _, rows in perf) >= 10


def test_every_performance_figure_equals_its_results_file() -> None:
    _, errors = tied_rows(README.read_text())
    assert not errors, "\n".join(errors)


def test_every_other_figure_is_dated() -> None:
    text = README.read_text()
    tied, _ = tied_rows(text)
    errors = undated(text, tied)
    assert not errors, "\n".join(errors)


def test_results_files_record_date_machine_and_load() -> None:
    files = sorted((ROOT / RESULTS).glob("*.json"))
    assert files, f"no results in {RESULTS}"
    for file in files:
        record = json.loads(file.read_text())
        for field in ("date", "command", "machine", "load_average_start", "load_average_end",
                      "report"):
            assert field in record, f"{file.name}: no {field}"
        assert DATE.fullmatch(record["date"]), f"{file.name}: date {record['date']!r}"
        assert record["machine"].get("cores"), f"{file.name}: no core count"


def test_readme_cites_each_results_file_it_quotes_with_its_command() -> None:
    text = README.read_text()
    quoted = set(re.findall(rf"\(({re.escape(RESULTS)}[^)]+\.json)\)", text))
    for path in quoted:
        command = re.sub(r"^\.venv[^/ ]*/bin/", "", load(path)["command"])
        assert command in text, f"{Path(path).name}: its command {command!r} is not shown"


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_history_is_dated_not_counted_in_sessions(doc: str) -> None:
    text = (ROOT / doc).read_text()
    hits = [f"{doc}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1)
            if SESSION.search(line)]
    assert not hits, "history by rounds of work, not by date:\n" + "\n".join(hits)


# -- the checks check ---------------------------------------------------------------------------


def test_a_changed_figure_is_caught() -> None:
    """The checks above fail on a README whose figure moved away from its results file."""
    text = README.read_text()
    start, _, _ = performance_tables(text)[0]
    lines = text.splitlines()
    line = lines[start + 1]  # the first row
    m = re.search(r"\*\*(\d+\.\d+)", line)
    assert m, "the first performance row has no bold figure"
    changed = f"{float(m.group(1)) + 0.5:.{len(m.group(1).split('.')[1])}f}"
    lines[start + 1] = line.replace(f"**{m.group(1)}", f"**{changed}", 1)
    _, errors = tied_rows("\n".join(lines))
    assert errors, "a changed figure passed"


def test_an_undated_figure_is_caught() -> None:
    assert undated("Batching gives 2.6x the throughput.\n", set())
    assert not undated("On 2026-11-23 batching gave 2.6x the throughput.\n", set())
    assert not undated("A shape of 8x64 and 8 x Linear(64).\n", set())
    assert figures("(4.30 vs 3.24 ms)") == [("4.30", "ms"), ("3.24", "ms")]
