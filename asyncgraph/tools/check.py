"""Run a program through asyncgraph and through ep.module(), and compare: `run_check`.

The program runs on the inputs given (`user_inputs`: `asyncgraph check -i` reads them from
files, validated against the signature first), else on its sample inputs (torch.export.save
stores the example inputs) or, when there are none or `use_random` is set, on random inputs
that fit its signature. It runs once through eager PyTorch (a fresh `ep.module()`), once
through a serial executor (max_parallel_ops=1) and once through a parallel one, each on its
own copy of the inputs, and every output leaf, every mutated input and every mutated buffer
is compared (see compare.py). `asyncgraph check` (asyncgraph/cli/check.py) prints the report
and exits 1 when it is not ok.
"""

from __future__ import annotations

import asyncio
import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the command, so `asyncgraph --help` stays quick
    from asyncgraph.graph.importers import Program
    from asyncgraph.graph.ir import Graph
    from asyncgraph.tools.compare import LeafComparison


@dataclass
class RunResult:
    """What one run produced: outputs, inputs after the call, mutated buffers; or an error."""

    outputs: Any = None
    inputs_after: list[Any] = field(default_factory=list)
    buffers: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class CheckReport:
    """Everything `check` found, row by row: (what, expected, {run name: comparison})."""

    program: str
    inputs_source: str
    runs: dict[str, RunResult]
    rows: list[tuple[str, str, dict[str, LeafComparison | None]]]

    @property
    def ok(self) -> bool:
        if any(r.error is not None for r in self.runs.values()):
            return False
        return all(c is not None and c.ok for _, _, cs in self.rows for c in cs.values())


def run_check(
    model: Path,
    *,
    seed: int = 0,
    use_random: bool = False,
    parallel: int = 2,
    rtol: float | None = None,
    atol: float | None = None,
    threads: int | None = None,
    trust_compiled: bool = False,
    user_inputs: Callable[[Graph], list[Any]] | None = None,
    user_inputs_source: str = "the inputs given",
) -> CheckReport:
    """Load `model`, run it eagerly and through asyncgraph, and compare (no printing).

    `trust_compiled` lets a package of `asyncgraph compile` load (it runs native code).
    `user_inputs(graph)` gives the flat user inputs, in signature order, to check on (what
    `user_inputs_source` describes); they must fit the signature."""
    from asyncgraph.loading import load_program
    from asyncgraph.runtime.validation import InputValidator
    from asyncgraph.tools.compare import random_inputs, structured_inputs

    if user_inputs is not None and use_random:
        raise ValueError("give inputs or use_random, not both")
    program = load_program(model, trust_compiled=trust_compiled)
    ep = program.exported
    assert ep is not None
    sample = getattr(ep, "example_inputs", None)
    if user_inputs is not None:
        flat = user_inputs(program.graph)
        InputValidator(program.graph).check(flat)  # a bad file: one error, before any run
        args, kwargs = structured_inputs(program.graph, flat)
        source = user_inputs_source
    elif sample is not None and not use_random:
        args, kwargs = tuple(sample[0]), dict(sample[1])
        source = "sample inputs stored in the file"
    else:
        args, kwargs = random_inputs(program.graph, seed)
        source = f"random inputs (seed {seed})"
    runs: dict[str, RunResult] = {"eager": _run_eager(program, args, kwargs)}
    for name, ops in (("serial", 1), (f"parallel({parallel})", parallel)):
        runs[name] = asyncio.run(_run_asyncgraph(program, ops, args, kwargs, threads))
    return CheckReport(program.name, source, runs, _rows(program, runs, rtol, atol))


# -- runs --------------------------------------------------------------------------------------


def _mutated_buffers(program: Program) -> list[str]:
    from asyncgraph.graph.ir import OutputKind

    sig = program.graph.signature
    return [o.target for o in sig.outputs if o.kind is OutputKind.BUFFER_MUTATION and o.target]


def _run_eager(program: Program, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RunResult:
    ep = program.exported
    assert ep is not None
    module = copy.deepcopy(ep.module())  # ep.module() shares its buffers with ep.state_dict
    a, k = copy.deepcopy((args, kwargs))
    try:
        outputs = module(*a, **k)
    except Exception:
        return RunResult(error=traceback.format_exc(limit=4))
    buffers = dict(module.named_buffers())
    return RunResult(
        outputs,
        _flat_inputs(a, k),
        {n: buffers[n] for n in _mutated_buffers(program) if n in buffers},
    )


async def _run_asyncgraph(
    program: Program,
    max_parallel_ops: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    threads: int | None = None,
) -> RunResult:
    from asyncgraph.kernels import KernelFactory
    from asyncgraph.runtime.config import ExecutorConfig
    from asyncgraph.runtime.executor import Executor

    config = ExecutorConfig(  # a caller that chose `threads` set the loop's count itself
        intra_op_threads=threads, max_parallel_ops=max_parallel_ops,
        loop_intra_op_threads=None if threads is not None else 1,
    )
    a, k = copy.deepcopy((args, kwargs))
    try:
        async with Executor(program, config, kernel_factory=KernelFactory(config)) as ex:
            try:
                outputs = await ex.execute(*a, **k)
            finally:
                await _close_subgraph_executors(ex)
            weights = ex.weights.tensors
    except Exception:
        return RunResult(error=traceback.format_exc(limit=6))
    return RunResult(
        outputs,
        _flat_inputs(a, k),
        {n: weights[n] for n in _mutated_buffers(program) if n in weights},
    )


async def _close_subgraph_executors(ex: Any) -> None:
    """Close the inner executors of control-flow kernels (the Executor does not, yet)."""
    for kernel in ex.kernels:
        close = getattr(kernel.fn, "aclose", None)
        if close is not None:
            await close()


def _flat_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    from torch.utils import _pytree as pytree

    return list(pytree.tree_leaves((args, kwargs)))


def _rows(
    program: Program,
    runs: dict[str, RunResult],
    rtol: float | None,
    atol: float | None,
) -> list[tuple[str, str, dict[str, LeafComparison | None]]]:
    from asyncgraph.graph.ir import InputKind, OutputKind
    from asyncgraph.tools.compare import compare, describe

    eager = runs["eager"]
    if eager.error is not None:
        return []
    others = {n: r for n, r in runs.items() if n != "eager"}
    rows: list[tuple[str, str, dict[str, LeafComparison | None]]] = []

    def add(what: str, expected: Any, pick: Any) -> None:
        comparisons: dict[str, LeafComparison | None] = {}
        for name, run in others.items():
            if run.error is not None:
                comparisons[name] = None
                continue
            found = pick(run)
            results = compare(found, expected, rtol=rtol, atol=atol)
            comparisons[name] = _merge(what, results)
        rows.append((what, describe(expected), comparisons))

    structure = {n: compare(r.outputs, eager.outputs) for n, r in others.items() if not r.error}
    if any(c and c[0].path == "<structure>" for c in structure.values()):
        add("output structure", eager.outputs, lambda run: run.outputs)
    for path, value in _leaves_with_paths(eager.outputs):
        add(f"out{path}", value, lambda run, p=path: _leaf_at(run.outputs, p))
    mutated = {o.target for o in program.graph.signature.outputs
               if o.kind is OutputKind.USER_INPUT_MUTATION}
    user_paths = [s.target for s in program.graph.signature.inputs
                  if s.kind is InputKind.USER_INPUT]
    for index, input_path in enumerate(user_paths):
        if input_path in mutated and index < len(eager.inputs_after):
            add(f"input {input_path}", eager.inputs_after[index],
                lambda run, i=index: run.inputs_after[i])
    for name, value in eager.buffers.items():
        add(f"buffer {name}", value,
            lambda run, n=name: run.buffers.get(n))
    return rows


def _merge(what: str, results: list[LeafComparison]) -> LeafComparison:
    """One comparison per row: the first problem, or the largest difference."""
    from asyncgraph.tools.compare import LeafComparison

    bad = [r for r in results if not r.ok]
    if bad:
        return bad[0]
    if len(results) == 1:
        return results[0]
    diffs = [r.max_abs_diff for r in results if r.max_abs_diff is not None]
    first = results[0]
    return LeafComparison(what, first.expected, first.actual, "", max(diffs) if diffs else None)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """Leaves with their pytree paths; a tree whose leaf is itself gives path ''."""
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(p), v) for p, v in leaves]


def _leaf_at(tree: Any, path: str) -> Any:
    for p, value in _leaves_with_paths(tree):
        if p == path:
            return value
    return _Missing(path)


class _Missing:
    """Stands for a leaf the run did not produce; compares unequal to everything."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"<no leaf at {self.path or 'the root'}>"
