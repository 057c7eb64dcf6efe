"""The package's layers, as ARCHITECTURE.md states them, checked over its import graph.

grimp builds the graph of every `asyncgraph` module, counting imports inside functions and
under TYPE_CHECKING too (kernels/ is read as asyncgraph.kernels, through its link). Three
rules:

- no import cycle between modules;
- every import between subpackages goes down the layer order (or stays within a layer):
  errors < graph < passes < kernels < runtime < cuda < tools < compiled, serve, testing
  < loading, plugins < bench < cli, ray (runtime reaches a device only through the registry of
  runtime/device.py, which cuda/ fills; no exception for the pair);
- the core of the run loop (runtime/frame.py, schedule.py, scheduler.py) imports nothing from
  cuda/, compiled/ or tools/.

And the device seam (runtime/device.py): cuda/ imports no private name; an Executor of a
CPU-only program imports nothing of cuda/; the registry names an unknown device type.

The imports that still break them are KNOWN, each with its item of issue 35 (or why it
stays); the test fails when one of them is gone, so the list only shrinks. The root module
`asyncgraph` (the public API's re-exports) is left out: every submodule runs it first anyway,
and what submodules read from it is `__version__`.
"""

from __future__ import annotations

from collections.abc import Iterator

import grimp
import pytest

ROOT = "asyncgraph"

# Lowest first; an import may go to its own layer or to one below.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer)
    for layer in (
        {"errors"},
        {"graph"},
        {"passes"},
        {"kernels"},
        {"runtime"},
        {"cuda"},
        {"tools"},
        {"compiled", "serve", "testing"},
        {"loading", "plugins"},
        {"bench"},  # the suite `asyncgraph bench` runs
        {"cli", "ray"},
    )
)

# The modules of the run loop's core and what they must not import.
CORE = ("asyncgraph.runtime.frame", "asyncgraph.runtime.schedule", "asyncgraph.runtime.scheduler")
CORE_FORBIDDEN = ("asyncgraph.cuda", "asyncgraph.compiled", "asyncgraph.tools")

# The one circle that stays: the registry's weak set of live Executors is typed with the
# class it holds, imported for the type checker only.
ALLOWED: dict[tuple[str, str], str] = {
    ("asyncgraph.runtime.registry", "asyncgraph.runtime.executor"):
        "type-only import: the registry's WeakSet[Executor]",
}

# Known violations (importer, imported), each with its item of issue 35.
KNOWN: dict[tuple[str, str], str] = {
    # Not named by issue 35's circles, found by this test:
    ("asyncgraph.tools.check", "asyncgraph.loading"):
        "tools/check.py's run_check loads a model file, compiled packages included",
    ("asyncgraph.passes.folding", "asyncgraph.kernels"):
        "folding runs after the kernels are made and reads OpKernel/KernelKind",
}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(ROOT)


def _edges(graph: grimp.ImportGraph) -> Iterator[tuple[str, str]]:
    for importer in graph.modules:
        if importer == ROOT:
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            if imported != ROOT and imported.startswith(ROOT + "."):
                yield importer, imported


def _part(module: str) -> str:
    return module.split(".")[1]


def _layer(module: str) -> int:
    part = _part(module)
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{module}: its subpackage {part!r} has no layer in LAYERS")


def _violations(graph: grimp.ImportGraph) -> dict[tuple[str, str], str]:
    """Every import that breaks the layer order or the core's rule, with what it breaks."""
    found: dict[tuple[str, str], str] = {}
    for importer, imported in _edges(graph):
        if _layer(imported) > _layer(importer):
            found[importer, imported] = "imports a higher layer"
        if importer in CORE and imported.startswith(CORE_FORBIDDEN):
            found[importer, imported] = "the run loop's core imports cuda/, compiled/ or tools/"
    return found


def _cycles(graph: grimp.ImportGraph, cut: set[tuple[str, str]]) -> list[list[str]]:
    """The import cycles (strongly connected components) of the graph less the `cut` edges."""
    succ: dict[str, list[str]] = {m: [] for m in graph.modules if m != ROOT}
    for importer, imported in _edges(graph):
        if (importer, imported) not in cut:
            succ[importer].append(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(succ):  # Tarjan's algorithm, iterative
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    cycles = _cycles(graph, set(KNOWN) | set(ALLOWED))
    assert not cycles, f"import cycles not in KNOWN: {cycles}"


def test_layers_and_core(graph: grimp.ImportGraph) -> None:
    new = {edge: why for edge, why in _violations(graph).items() if edge not in KNOWN}
    assert not new, "imports against the layers of ARCHITECTURE.md:\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items())
    )


def test_known_violations_still_exist(graph: grimp.ImportGraph) -> None:
    """A fixed violation leaves KNOWN, so the list only shrinks."""
    edges = set(_edges(graph))
    gone = [edge for edge in KNOWN if edge not in edges]
    assert not gone, f"fixed: remove from KNOWN: {gone}"
    needed = set(_violations(graph))
    for edge in KNOWN:  # each is needed: it breaks a rule or a cycle
        if edge in needed:
            continue
        rest = (set(KNOWN) | set(ALLOWED)) - {edge}
        assert _cycles(graph, rest), f"{edge} breaks no rule and closes no cycle: remove it"
    assert set(ALLOWED) <= edges


def _private_imports(package: str) -> list[str]:
    """`from asyncgraph.x import _name` in `package`'s modules, as `file: module.name`."""
    import ast
    import importlib
    from pathlib import Path

    root = Path(importlib.import_module(package).__file__ or "").parent
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT + "."):
                found += [f"{path.name}: {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
    return found


def test_cuda_imports_no_private_name() -> None:
    """cuda/ plugs into the runtime's seam (runtime/device.py) through public names only, and
    its modules read no private name of each other's either."""
    private = _private_imports(ROOT + ".cuda")
    assert not private, f"cuda/ imports private names: {private}"


def test_a_cpu_program_imports_nothing_of_cuda() -> None:
    """The runtime reaches cuda/ only through the device registry, for CUDA nodes: an Executor
    of a CPU-only program runs without importing asyncgraph.cuda."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import asyncio, sys
        import torch
        from asyncgraph import Executor

        class M(torch.nn.Module):
            def forward(self, x):
                return x + 1

        async def main():
            program = torch.export.export(M(), (torch.ones(2),))
            async with Executor(program) as ex:
                assert (await ex.execute(torch.ones(2))).tolist() == [2.0, 2.0]
        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("asyncgraph.cuda")))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_an_unregistered_device_type_is_named() -> None:
    from asyncgraph.runtime.device import device_backend, registered_devices

    assert "cuda" in registered_devices()  # asyncgraph/plugins.py, run by `import asyncgraph`
    with pytest.raises(LookupError, match=r"'mps'; registered: 'cuda'"):
        device_backend("mps")
