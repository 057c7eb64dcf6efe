"""The conformance harness: run a program through asyncgraph and through ep.module(), compare.

`assert_conforms` is the one check every corpus test makes. For each executor configuration
(serial; parallel with every aten op on a worker thread and a shuffled ready order) it takes a
fresh `ep.module()` as the reference and a fresh Executor, then makes the same sequence of calls
on both, each side on its own deep copy of the inputs, and compares leaf by leaf:

- the outputs of `execute(*args, **kwargs)` against the reference's outputs;
- the flat outputs of `execute_flat` against the reference's output leaves (on odd calls, so
  both entry points see a program whose buffers have already changed);
- the inputs after the call (user-input mutations);
- after the sequence, every buffer the program mutates.

Errors must match too: when eager raises, asyncgraph must raise (any exception, since eager's
guards and asyncgraph's input validation word it differently), and vice versa.

Every program runs at least MIN_CALLS times in a row (the calls repeat from the first): issue
39's reordering appeared only once adaptive placement had changed the schedule, after the
third call. Script objects (torchbind) compare by their flattened state.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.graph.importers import Program, to_program
from asyncgraph.graph.ir import OutputKind
from asyncgraph.kernels import KernelFactory
from asyncgraph.tools.compare import assert_same

SERIAL = ExecutorConfig(max_parallel_ops=1)
PARALLEL = ExecutorConfig(max_parallel_ops=2, heavy_op_flops=0, ready_order_seed=7)
CONFIGS = {"serial": SERIAL, "parallel": PARALLEL}
MIN_CALLS = 5  # past adaptive placement's profiling (3 executions) and its first decision

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Outcome:
    """What a conformance run did: calls made, calls where both sides raised."""

    calls: int
    both_raised: int


def make_executor(ep: ExportedProgram | Any, config: ExecutorConfig) -> Executor:
    """An Executor whose control-flow subgraphs run with the same configuration."""
    return Executor(ep, config, kernel_factory=KernelFactory(config))


async def close_all(ex: Executor) -> None:
    """Close the executor and the inner executors of its control-flow kernels."""
    for kernel in ex.kernels:
        close = getattr(kernel.fn, "aclose", None)
        if close is not None:
            await close()
    await ex.aclose()


def flat_user_inputs(ep: ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list:
    """The flat user inputs in signature order (what execute_flat takes)."""
    spec = ep.call_spec.in_spec
    if spec is None:
        return list(args)
    names = list(spec.children()[1].context or [])
    ordered = {k: kwargs[k] for k in names}
    flat, got = pytree.tree_flatten((tuple(args), ordered), is_leaf=lambda x: x is None)
    if got != spec:
        flat, _ = pytree.tree_flatten((tuple(args), ordered))
    return flat


def mutated_buffers(ex: Executor) -> list[str]:
    sig = ex.graph.signature
    return [o.target for o in sig.outputs if o.kind is OutputKind.BUFFER_MUTATION and o.target]


async def assert_conforms(
    ep: ExportedProgram,
    calls: Sequence[Inputs],
    *,
    configs: dict[str, ExecutorConfig] | None = None,
    check: Callable[[Executor], None] | None = None,
) -> Outcome:
    """Run `calls` through eager and asyncgraph in every configuration; compare everything."""
    both_raised = 0
    program = imported(ep)
    calls = at_least(calls, MIN_CALLS)
    for name, config in (configs or CONFIGS).items():
        # ep.module() shares its buffers with ep.state_dict, so eager calls would mutate the
        # (cached) program itself; the reference works on a copy.
        reference = copy.deepcopy(ep.module())
        ex = make_executor(program, config)
        try:
            for i, (args, kwargs) in enumerate(calls):
                where = f"[{name}, call {i}]"
                e_args, e_kwargs = copy.deepcopy((args, kwargs))
                a_args, a_kwargs = copy.deepcopy((args, kwargs))
                try:
                    expected = reference(*e_args, **e_kwargs)
                except Exception as eager_error:
                    try:
                        await ex.execute(*a_args, **a_kwargs)
                    except Exception:
                        both_raised += 1
                        continue
                    raise AssertionError(
                        f"{where} eager raised {eager_error!r} but asyncgraph returned"
                    ) from eager_error
                if i % 2 == 0:
                    got = await ex.execute(*a_args, **a_kwargs)
                    assert_same(got, expected, what=f"outputs {where}")
                else:
                    flat = await ex.execute_flat(flat_user_inputs(ep, a_args, a_kwargs))
                    assert_same(flat, pytree.tree_leaves(expected), what=f"flat outputs {where}")
                assert_same(object_states((a_args, a_kwargs)), object_states((e_args, e_kwargs)),
                            what=f"inputs after {where}")
            buffers = dict(reference.named_buffers())
            for buffer in mutated_buffers(ex):
                assert_same(
                    ex.weights.tensors[buffer], buffers[buffer], what=f"buffer {buffer} [{name}]"
                )
            if check is not None:
                check(ex)
        finally:
            await close_all(ex)
    return Outcome(len(calls), both_raised)


def at_least(calls: Sequence[Inputs], count: int) -> list[Inputs]:
    """`calls`, repeated from the first until there are `count` (each call is deep-copied
    before use, so a repeat gets fresh inputs)."""
    calls = list(calls)
    return [calls[i % len(calls)] for i in range(max(count, len(calls)))] if calls else []


def object_states(tree: Any) -> Any:
    """`tree` with each script object replaced by its flattened state (`__obj_flatten__`), so
    two queues holding equal tensors compare equal."""

    def state(leaf: Any) -> Any:
        if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "__obj_flatten__"):
            return leaf.__obj_flatten__()
        return leaf

    return pytree.tree_map(state, tree)


_EXPORTS: dict[Any, ExportedProgram] = {}
_PROGRAMS: dict[int, tuple[ExportedProgram, Program]] = {}


def imported(ep: ExportedProgram) -> Program:
    """The Program of `ep`, imported once per session: functionalizing is the slow part.

    Sharing it is safe because asyncgraph never writes to a program's weights (a buffer
    mutation makes a new Weights version inside the Executor).
    """
    entry = _PROGRAMS.get(id(ep))
    if entry is None or entry[0] is not ep:
        entry = _PROGRAMS[id(ep)] = (ep, to_program(ep))
    return entry[1]


TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@dataclass(frozen=True)
class TorchExportLimit:
    """A program that torch.export itself cannot export before torch `fixed_in`.

    These are torch's limits, not asyncgraph's: on an older torch the test asserts that export
    fails with `error` (so the entry cannot outlive the limit unnoticed), and runs the program
    from `fixed_in` on.
    """

    fixed_in: tuple[int, int]
    reason: str
    error: str

    def applies(self) -> bool:
        return self.fixed_in > TORCH_VERSION

    def assert_export_fails(self, name: str, build: Callable[[], ExportedProgram]) -> None:
        with pytest.raises(Exception) as info:
            build()
        assert re.search(self.error, str(info.value)), (
            f"{name}: torch {torch.__version__} is listed as unable to export it ({self.reason}), "
            f"but export failed differently: {info.value!r}"
        )


def cached_export(key: Any, build: Callable[[], ExportedProgram]) -> ExportedProgram:
    """Export once per key for the whole session (both event loops share the program)."""
    if key not in _EXPORTS:
        _EXPORTS[key] = build()
    return _EXPORTS[key]


def decompose(ep: ExportedProgram) -> ExportedProgram:
    """The program after run_decompositions() with the default (core ATen) table."""
    return ep.run_decompositions()


def hop_names(ep: ExportedProgram) -> set[str]:
    """Names of the higher-order ops anywhere in the program (subgraphs included)."""
    found: set[str] = set()
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for node in gm.graph.nodes:
                if isinstance(node.target, torch._ops.HigherOrderOperator):
                    found.add(node.target.__name__)
    return found
