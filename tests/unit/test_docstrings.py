"""The package's docstrings and comments say why in words; dated figures live in one file.

Issue 53, item 6: benchmark figures quoted with their date (YYYY-MM-DD) in docstrings and
comments went stale with the code around them, and nothing tied them to a record. A decision's
docstring keeps the reason in words and links the section of
benchmarks/results/cpu/design_measurements.md that holds the figure, its date and machine.
Checked over every module of asyncgraph/ (kernels/ included, through its link), from the
source's syntax: comments, and every string that stands alone as a statement (module, class
and function docstrings, and the attribute docstrings after a field). Other strings (messages,
data) may hold a date.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import asyncgraph

PACKAGE = Path(asyncgraph.__file__).parent
ROOT = PACKAGE.parent
MEASUREMENTS = ROOT / "benchmarks" / "results" / "cpu" / "design_measurements.md"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
LINK = re.compile(r"design_measurements\.md#([\w-]+)")

def _modules() -> Iterator[Path]:
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder) / name


def _prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every string statement of a module's source."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, node.value.value


def _dated(path: Path) -> list[str]:
    """'line: date' of each date the module's comments and docstrings quote."""
    return [f"{line + text.count(chr(10), 0, date.start())}: {date.group()}"
            for line, text in _prose(path.read_text()) for date in DATE.finditer(text)]


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_no_module_quotes_a_dated_figure_in_a_docstring_or_comment() -> None:
    quoting = {_name(p): dated for p in _modules() if (dated := _dated(p))}
    assert not quoting, (
        f"dated figures in docstrings or comments (move each, with its date and machine, to "
        f"{MEASUREMENTS.relative_to(ROOT)} and link its section): {quoting}"
    )


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_design_measurement_names_a_section_of_it() -> None:
    sections = {_anchor(line.lstrip("#")) for line in MEASUREMENTS.read_text().splitlines()
                if line.startswith("## ")}
    links = {(_name(p), anchor) for p in _modules() for anchor in LINK.findall(p.read_text())}
    assert links, "no module links a design measurement: the check would pass on nothing"
    missing = sorted(f"{name}: #{anchor}" for name, anchor in links if anchor not in sections)
    assert not missing, f"links to sections {MEASUREMENTS.name} does not have: {missing}"
