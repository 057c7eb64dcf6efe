"""Delegates and the segment backends that plan them: the runtime's side of the seam.

A delegate is the target of one node that runs a whole run of the graph's nodes elsewhere:
TorchScript's interpreter (compiled/scripted.py), an ONNX Runtime session
(compiled/onnx_delegate.py), an AOTInductor model (compiled/delegate.py). The runtime never
imports them (they need torch.jit, onnxruntime or native code, and live a layer above): it
knows a delegate by the `Delegate` protocol, and the backends that plan them by name.

A `SegmentBackend` is a name (`ExecutorConfig(segments=("onnx",))`) and a loader of its
planning pass, `(graph, config) -> (graph, delegate node names)`, which replaces runs of nodes
by delegate nodes. The layers above register theirs (asyncgraph/plugins.py, run by `import
asyncgraph`: "script" and "onnx"); the builder (runtime/build.py) runs the passes of the
backends a config names, in its order, and checks that every node a pass names is a
Delegate. The loader is called when an Executor first asks, so `import asyncgraph` imports
no torch, and a backend's optional dependencies only when it is used.

Adding a delegate (OpenVINO, say) is its module and one `register_backend` call: nothing here,
in the config or in the Executor changes (tests/integration/test_segment_backends.py
registers one from a test module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:  # `import asyncgraph` registers backends here without importing torch
    from asyncgraph.graph.ir import Graph
    from asyncgraph.runtime.config import ExecutorConfig


@runtime_checkable
class Delegate(Protocol):
    """What the Executor asks of a delegate node's target (KernelKind.DELEGATE).

    - `__call__(*inputs)`: the run's inputs (weights included) in, its outputs out as a list
      (getitem nodes take it apart); called from any thread.
    - `prepare_weights(tensors)`: a swap's new weights (name -> tensor), before any execution
      runs on them, on a worker thread: load or build what the new version needs, or nothing.
    - `aclose()`: the Executor closes; return once no thread of the delegate's is left.
    - `statistics()`: what the delegate did, as a dict of its own.
    - `needs_inference_mode` (optional; True when absent): False where the call records no
      autograd and returns tensors that do not require grad whatever the mode (compiled
      code): a one-call program's Mode.DIRECT then calls it without the guard
      (runtime/direct.py).
    """

    def __call__(self, *inputs: Any) -> list[Any]: ...

    def prepare_weights(self, tensors: Mapping[str, Any]) -> None: ...

    async def aclose(self) -> None: ...

    def statistics(self) -> dict[str, Any]: ...


# A backend's planning pass, given the executor's configuration (what it reads of it is its
# own business): the graph with runs replaced by delegate nodes, and those nodes' names.
SegmentPlanner: TypeAlias = "Callable[[Graph, ExecutorConfig], tuple[Graph, list[str]]]"


@dataclass(frozen=True, slots=True)
class SegmentBackend:
    """A delegate backend by name: `load()` imports its modules and returns its planner.

    `fast_form`: the backend may build an Executor's fast form unasked
    (`ExecutorConfig.fast_paths`, runtime/forms.py), where `missing()` returns None: what it
    needs imports here (a cheap check, no import); otherwise `missing()` says what is not.

    `form_program`: a backend whose fast form is a program of its own rather than the
    Executor's graph with delegate nodes planned in (an AOTInductor package compiled from the
    exported program, compiled/aoti_form.py): `form_program(program, threads, runners)`
    returns the form's Program from the Executor's (on its current weights). Such a form is
    built after the planned ones, as one more candidate, at `form_threads` intra-op threads
    (None: each count forms.py tries)."""

    name: str
    load: Callable[[], SegmentPlanner]
    fast_form: bool = False
    missing: Callable[[], str | None] = lambda: None
    form_program: Callable[[Any, int, int], Any] | None = None
    form_threads: tuple[int, ...] | None = None

    def plan(self, graph: Graph, config: ExecutorConfig) -> tuple[Graph, list[str]]:
        """The graph with this backend's delegate nodes, and their names."""
        return self.load()(graph, config)


_BACKENDS: dict[str, SegmentBackend] = {}


def register_backend(backend: SegmentBackend) -> None:
    """Make `backend` plannable as `ExecutorConfig(segments=(backend.name,))`; a backend of
    the same name is replaced."""
    _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Forget the backend `name` (a plugin unloaded, a test's backend); no error if unknown."""
    _BACKENDS.pop(name, None)


def registered_backends() -> tuple[str, ...]:
    """The names of the registered backends, sorted."""
    return tuple(sorted(_BACKENDS))


def fast_form_backends() -> tuple[str, ...]:
    """The registered fast-form backends that can run here, in registration order."""
    return tuple(b.name for b in _BACKENDS.values() if b.fast_form and b.missing() is None)


def segment_backend(name: str) -> SegmentBackend:
    """The backend registered as `name`; ValueError naming the registered ones otherwise."""
    backend = _BACKENDS.get(name)
    if backend is None:
        known = ", ".join(repr(n) for n in registered_backends()) or "none (import asyncgraph)"
        raise ValueError(
            f"ExecutorConfig(segments=...): no segment backend named {name!r}; registered: "
            f"{known} (a backend registers itself with "
            f"asyncgraph.runtime.delegates.register_backend)"
        )
    return backend
