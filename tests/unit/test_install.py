"""What the core install (`pip install asyncgraph`, no extras) may import, and what the
console script says when the cli extra is missing.

The server and CLI stack (starlette, uvicorn, prometheus-client, typer, rich, safetensors) are
the `serve` and `cli` extras; an application that only awaits `Executor.execute` must not load
them. Each check runs in a fresh interpreter: this process has them all imported already.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA_MODULES = ("typer", "rich", "click", "starlette", "uvicorn", "prometheus_client",
                 "safetensors", "uvloop")
CORE_MODULES = ("asyncgraph", "asyncgraph.testing", "asyncgraph.tools.compare",
                "asyncgraph.tools.trace")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_modules_load_no_extra(module: str) -> None:
    result = _python(f"""
        import importlib, json, sys
        importlib.import_module({module!r})
        print(json.dumps(sorted({{name.partition(".")[0] for name in sys.modules}})))
    """)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert loaded & set(EXTRA_MODULES) == set(), f"`import {module}` loads an extra's module"


@pytest.mark.timeout(180)
def test_core_runs_a_graph_with_the_extras_hidden() -> None:
    """The Executor end to end with every extra's module made unimportable."""
    result = _python(f"""
        import asyncio, sys
        for name in {EXTRA_MODULES!r}:
            sys.modules[name] = None  # `import name` now raises ModuleNotFoundError
        import asyncgraph

        async def main() -> int:
            b = asyncgraph.GraphBuilder()
            x = b.input("x")
            b.output(b.call(lambda v: v * 3, x, name="triple"))
            async with asyncgraph.Executor(b.build()) as ex:
                return await ex.execute(14)

        print(asyncio.run(main()))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "42"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("missing", ["typer", "rich"])
def test_console_script_names_the_cli_extra_when_it_is_missing(missing: str) -> None:
    result = _python(f"""
        import sys
        sys.modules[{missing!r}] = None
        from asyncgraph.cli.main import main
        main()
    """)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        f"asyncgraph's command line needs the cli extra ({missing} is not installed): "
        "pip install 'asyncgraph[cli]'"
    )


# the libraries asyncgraph itself imports, by the module it imports and the distribution
DISTRIBUTIONS = {
    "torch": "torch", "numpy": "numpy", "anyio": "anyio", "starlette": "starlette",
    "uvicorn": "uvicorn", "uvloop": "uvloop", "prometheus_client": "prometheus-client",
    "google.protobuf": "protobuf", "grpc": "grpcio", "typer": "typer", "rich": "rich",
    "safetensors": "safetensors",
}


@pytest.mark.timeout(180)
def test_the_http_server_imports_only_what_core_and_the_serve_extra_declare() -> None:
    """`asyncgraph[serve]` (and `[cli]`, which has it) serves HTTP, Triton's model
    configuration and config.pbtxt included: every library of asyncgraph's the HTTP server
    imports is a core dependency or the serve extra's (protobuf was the grpc extra's only,
    so a `[cli]` install could not start `asyncgraph serve`)."""
    result = _python(f"""
        import json, sys
        sys.modules["grpc"] = None  # the grpc extra's own module: HTTP must not need it
        from asyncgraph.serve import create_app
        import asyncgraph.serve.pbtxt
        create_app({{}})
        loaded = {{n for n, m in sys.modules.items() if m is not None}}
        print(json.dumps(sorted(set({list(DISTRIBUTIONS)!r}) & loaded)))
    """)
    assert result.returncode == 0, result.stderr
    imported = {DISTRIBUTIONS[module] for module in json.loads(result.stdout)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]
                for r in [*project["dependencies"], *project["optional-dependencies"]["serve"]]}
    assert "protobuf" in imported, "the check would pass on nothing"
    assert imported <= declared, f"imported but not declared: {sorted(imported - declared)}"
