"""Every Python snippet of README.md and docs/ runs as shown.

Each ```python block is checked for names it uses but never defines or imports (ruff's F821),
then run in a process of its own, in a folder holding the files the docs name (`mlp.pt2`,
`models/encoder/1/model.pt2`). A block may be marked on the line before it:

- `<!-- snippet: server -->`: it ends by serving (`asyncgraph.serve.run`); it runs with `run`
  replaced by a start that asks /v2/health/ready once and stops.
- `<!-- snippet: not run: WHY -->`: it needs what the test tier lacks (a GPU, Ray, a server
  on a fixed port, a compiled package); only the names are checked.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT_S = 180

SERVER_PRELUDE = textwrap.dedent("""
    import asyncio, httpx, asyncgraph.serve

    def _serve_once(app, host="127.0.0.1", port=8000, **options):
        async def main():
            async with asyncgraph.serve.running_server(app) as url:
                async with httpx.AsyncClient(base_url=url) as client:
                    answer = await client.get("/v2/health/ready")
            print("ready:", answer.status_code)
            assert answer.status_code == 200, answer.text

        asyncio.run(main())

    asyncgraph.serve.run = _serve_once
""")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    mark: str  # "", "server" or "not run: why"
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> list[Snippet]:
    found: list[Snippet] = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = lines[i - 1].strip() if i else ""
            mark = re.fullmatch(r"<!-- snippet: (.*) -->", before)
            found.append(Snippet(str(page.relative_to(ROOT)), i + 1,
                                 mark.group(1) if mark else "", "\n".join(lines[i + 1:end])))
    return found


SNIPPETS = snippets()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the files the snippets name."""
    root = tmp_path_factory.mktemp("snippets")
    torch.manual_seed(0)
    ep = torch.export.export(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),))
    torch.export.save(ep, root / "mlp.pt2")
    (root / "models" / "encoder" / "1").mkdir(parents=True)
    torch.export.save(ep, root / "models" / "encoder" / "1" / "model.pt2")
    return root


def test_the_docs_have_snippets() -> None:
    pages = {s.page for s in SNIPPETS}
    assert {"README.md", "docs/serving.md", "docs/compiled.md"} <= pages, pages
    assert all(s.mark in ("", "server") or s.mark.startswith("not run: ") for s in SNIPPETS), \
        [s.id for s in SNIPPETS]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_a_snippet_uses_only_names_it_defines_or_imports(snippet: Snippet) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select",
         "F821", "--stdin-filename", "snippet.py", "-"],
        input=snippet.code, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"{snippet.id}:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.mark.startswith("not run")],
                         ids=[s.id for s in SNIPPETS if not s.mark.startswith("not run")])
def test_a_snippet_runs_as_shown(snippet: Snippet, files: Path) -> None:
    code = (SERVER_PRELUDE if snippet.mark == "server" else "") + snippet.code
    result = subprocess.run([sys.executable, "-c", code], cwd=files, capture_output=True,
                            text=True, timeout=SNIPPET_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"{snippet.id} failed:\n{result.stderr[-3000:]}"
    if snippet.mark == "server":
        assert "ready: 200" in result.stdout
