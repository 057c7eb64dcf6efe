"""ReferenceRunner: run a program node by node, in graph order, on the calling thread.

The reference that parallel and concurrent runs are checked against. It shares nothing with
the scheduler: no plan, no frame, no worker threads, no freeing of values, no ready order. It
uses the default KernelFactory's kernels (never a fault-injecting one) and awaits async kernels
in place, one node at a time.

    ref = ReferenceRunner(program)
    expected = await ref.run(x)                       # same calling convention as execute()
    expected = await ref.with_weights(new_state).run_flat([x])

`random_inputs(program, rng)` makes flat inputs from the signature (shapes from the example the
program was exported with); `perturbed_weights(weights, rng)` makes a swappable state dict.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from asyncgraph.graph.importers import Program, ProgramLike, to_program
from asyncgraph.graph.initial import initial_values
from asyncgraph.graph.ir import OutputKind, Ref
from asyncgraph.kernels import KernelFactory, OpKernel
from asyncgraph.runtime.validation import InputValidator
from asyncgraph.tools.compare import random_flat_inputs


class ReferenceRunner:
    """The serial reference interpreter of a program (see the module docstring)."""

    def __init__(
        self,
        program: ProgramLike,
        *,
        weights: Mapping[str, Any] | None = None,
        inference_mode: bool = True,
    ) -> None:
        self.program: Program = to_program(program)
        self.graph = self.program.graph
        self.kernels: list[OpKernel] = KernelFactory().create(self.graph)
        self.weights: dict[str, Any] = dict(self.program.weights)
        if weights is not None:
            self.weights.update(weights)
        self.inference_mode = inference_mode
        self._validator = InputValidator(self.graph)

    def with_weights(self, weights: Mapping[str, Any]) -> ReferenceRunner:
        """A runner of the same program whose named weights are replaced by `weights`."""
        runner = object.__new__(ReferenceRunner)
        runner.program = self.program
        runner.graph = self.graph
        runner.kernels = self.kernels
        runner.weights = {**self.weights, **weights}
        runner.inference_mode = self.inference_mode
        runner._validator = self._validator
        return runner

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run on `(args, kwargs)` and return what Executor.execute returns."""
        flat = self._validator.flatten(args, kwargs)
        outputs = await self.run_flat(flat)
        out_spec = self.graph.signature.out_spec
        return pytree.tree_unflatten(outputs, out_spec) if out_spec is not None else outputs

    async def run_flat(self, inputs: Sequence[Any]) -> list[Any]:
        """Run on flat user inputs and return the flat user outputs (awaits async kernels)."""
        values = self._load(inputs)
        for node, kernel in zip(self.graph.nodes, self.kernels, strict=True):
            with torch.inference_mode(self.inference_mode):
                result = kernel.fn(*_bind(node.args, values), **_bind(node.kwargs, values))
            if inspect.isawaitable(result):
                result = await result
            values[node.output] = result
        return self._finish(values, inputs)

    def run_flat_sync(self, inputs: Sequence[Any]) -> list[Any]:
        """run_flat for programs without async kernels, from sync code."""
        values = self._load(inputs)
        with torch.inference_mode(self.inference_mode):
            for node, kernel in zip(self.graph.nodes, self.kernels, strict=True):
                result = kernel.fn(*_bind(node.args, values), **_bind(node.kwargs, values))
                if inspect.isawaitable(result):
                    if inspect.iscoroutine(result):
                        result.close()
                    raise TypeError(
                        f"node %{node.name} has an async kernel; use `await run_flat(...)`"
                    )
                values[node.output] = result
        return self._finish(values, inputs)

    def _load(self, inputs: Sequence[Any]) -> list[Any]:
        graph = self.graph
        users = graph.signature.user_inputs
        if len(inputs) != len(users):
            raise ValueError(f"expected {len(users)} input(s), got {len(inputs)}")
        return initial_values(graph, self.weights, inputs)

    def _finish(self, values: list[Any], inputs: Sequence[Any]) -> list[Any]:
        sig = self.graph.signature
        outputs: list[Any] = []
        paths = [s.target for s in sig.user_inputs]
        for out in sig.outputs:
            value = _bind(out.arg, values)
            if out.kind is OutputKind.USER_OUTPUT:
                outputs.append(value)
            elif out.kind is OutputKind.BUFFER_MUTATION and out.target is not None:
                self.weights[out.target] = value
            elif out.kind is OutputKind.USER_INPUT_MUTATION and out.target in paths:
                with torch.no_grad():
                    inputs[paths.index(out.target)].copy_(value)
        return outputs


def _bind(arg: Any, values: list[Any]) -> Any:
    """An argument structure with every Ref replaced by its value; containers are copied."""
    if isinstance(arg, Ref):
        return values[arg.id]
    if type(arg) is tuple:
        return tuple(_bind(a, values) for a in arg)
    if type(arg) is list:
        return [_bind(a, values) for a in arg]
    if type(arg) is dict:
        return {k: _bind(v, values) for k, v in arg.items()}
    return arg


# -- inputs and weights ------------------------------------------------------------------------


def random_inputs(program: ProgramLike, rng: random.Random | int = 0) -> list[Any]:
    """Flat user inputs for `program`, from its signature's specs and example shapes
    (asyncgraph.tools.compare.random_flat_inputs). Raises ValueError when an input has no spec
    (graphs made with GraphBuilder): pass your own inputs then."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    return random_flat_inputs(to_program(program).graph, rng.getrandbits(63))


def perturbed_weights(weights: Mapping[str, Any], rng: random.Random | int = 0) -> dict[str, Any]:
    """New values for the floating-point tensors of `weights`, with the same shapes and dtypes."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    new: dict[str, Any] = {}
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            with torch.no_grad():
                noise = torch.randn(value.shape, generator=gen, dtype=torch.float64)
                fresh = (value.detach().to(torch.float64).cpu() + 0.1 * noise).to(value.dtype)
            new[name] = fresh.to(value.device)
    return new
