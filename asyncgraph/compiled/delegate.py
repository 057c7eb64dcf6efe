"""AOTIDelegate: one compiled segment, called by the scheduler like any kernel.

The delegate node's target. KernelFactory gives it an OpKernel of kind DELEGATE (it sees
`kernel_kind`). Its arguments are all the segment's inputs, read from the execution's frame,
weights included; it returns the segment's outputs as a list that operator.getitem nodes take
apart.

Weights are constants of the compiled model (AOTInductor folds and pre-packs them), yet each
execution runs on the weights version it started with. The delegate still receives the
execution's weight tensors as arguments, and runs the segment on a container whose constant
buffer holds exactly those tensors (checked by identity: a swap makes new Weights whose swapped
entries are other tensor objects). When none does, it loads them into an idle container with
AOTInductor's constant-buffer update (`load_constants`, copied into the container's own
buffer; the container refolds its derived constants on its next run), never a recompile.

A second container is made on the first call with other weights than the first holds: during
a swap, executions on the old version keep running on one container while the new version
runs on the other, so neither waits for the other (no barrier) and the buffer of a container
is never changed under a running call. With both busy on two other versions (a third version
arriving while two are still running) a call waits until one is free. Loading costs one copy
of the segment's weights, once per swap per container, paid by the first call on the new
version (on its worker thread).

A container is a native one (native_call.NativeContainer: the model's C entry point, GIL
released) or torch's AOTIModelPackageLoader; both have run, load_constants and
get_constant_fqns, and package.py picks which.

It is a runtime/delegates.py `Delegate` like the scripted and ONNX ones, so the Executor
prepares and closes it as it does them; unlike theirs, its segments are not planned from the
config (no SegmentBackend): they are compiled ahead of time and come with the package, whose
loader splices them into the graph (package.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgraph.compiled.delegate_support import same_tensors as _same
from asyncgraph.compiled.packing import PackedConstant
from asyncgraph.errors import WeightsError
from asyncgraph.kernels.base import KernelKind

MAX_CONTAINERS = 2  # a version running and the next one: enough for swaps without waiting


@dataclass(eq=False)
class _Container:
    """One AOTI model container and the weight tensors its constant buffer holds."""

    loader: Any
    weights: tuple[Any, ...]  # the tensors loaded, held so their identities stay theirs
    ready: bool = True  # False while a call loads `weights` into it
    running: int = 0  # calls running on it now
    last_used: int = 0
    loads: int = 0


class AOTIDelegate:
    """Calls one AOTInductor model (an AOTIModelPackageLoader) on a segment's inputs.

    `contiguous[i]` says whether input i was contiguous when the segment was compiled: the
    compiled code assumes the strides it saw, so an input that is not (a sliced user input)
    is made contiguous first rather than read wrongly. `constants[i]` is input i's constant
    name in the AOTI model ("" for an input passed at run time); `baked[i]` the tensor the
    model was compiled with for that constant; `new_loader` makes another container.
    """

    kernel_kind = KernelKind.DELEGATE
    # compiled code: no autograd recorded, outputs that do not require grad, in any mode; the
    # guard only costs (runtime/direct.py)
    needs_inference_mode = False

    def __init__(
        self, name: str, loader: Any, contiguous: Sequence[bool], node_names: Sequence[str],
        cost: int = 0, *, constants: Sequence[str] | None = None,
        baked: Sequence[Any] | None = None, new_loader: Callable[[], Any] | None = None,
        weight_names: Sequence[str] | None = None, packed: Sequence[PackedConstant] = (),
        frozen: str = "", call: str = "binding", transposed: Collection[str] = (),
    ) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self.contiguous = tuple(contiguous)
        self.node_names = tuple(node_names)
        self.cost = cost
        names = tuple(constants) if constants is not None else ("",) * len(self.contiguous)
        self._runtime = tuple(i for i, c in enumerate(names) if not c)
        self._constant = tuple(i for i, c in enumerate(names) if c)
        # the runtime arguments (positions among them) compiled contiguous
        self._contiguous_args = tuple(k for k, i in enumerate(self._runtime) if contiguous[i])
        self._fqns = tuple(names[i] for i in self._constant)
        # the constant inputs as one slice of the call's arguments where they are contiguous
        # (a segment's weights follow its runtime inputs): one C slice per call, not a lookup
        # per weight (16 weights: 0.15 us against 1.3 us, timeit)
        lo, hi = (self._constant[0], self._constant[-1] + 1) if self._constant else (0, 0)
        self._constants_at: slice | tuple[int, ...] = (
            slice(lo, hi) if self._constant == tuple(range(lo, hi)) else self._constant
        )
        self._new_loader = new_loader
        self.packed = tuple(packed)  # constants each load derives from its weight (packing.py)
        self.transposed = frozenset(transposed)  # constants held as their weight's transpose
        self.frozen = frozen  # why no buffer update can swap its weights ("" when one can)
        self._call = call  # how the containers are called, as loading decided (statistics)
        # the weight name of each constant input: prepare_weights finds its tensor by it
        self._weight_names = (tuple(weight_names[i] for i in self._constant)
                              if weight_names is not None else None)
        held = tuple(baked[i] for i in self._constant) if baked is not None else ()
        first = _Container(loader, held if len(held) == len(self._constant) else ())
        self._containers = [first]
        self._latest = first
        # the Condition's own lock, held with `with self._mutex` (C calls) rather than `with
        # self._changed` (two Python-level calls): twice per call, 0.6 us of 4.8; waits and
        # notifies still go through the Condition, which owns the same lock
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._waiting = 0  # calls waiting for a container: notified only when there are some
        self._clock = 0
        self.calls = 0
        self.loads = 0

    @property
    def loader(self) -> Any:
        """The first container's loader (the one made at load time)."""
        return self._containers[0].loader

    def __call__(self, *inputs: Any) -> list[torch.Tensor]:
        if len(inputs) != len(self.contiguous):
            raise TypeError(
                f"{self.__name__}: expected {len(self.contiguous)} inputs, got {len(inputs)}"
            )
        args = self._contiguous([inputs[i] for i in self._runtime])
        self.calls += 1
        if not self._constant:
            outputs: list[torch.Tensor] = self._latest.loader.run(args)
            return outputs
        at = self._constants_at
        weights = inputs[at] if type(at) is slice else tuple(map(inputs.__getitem__, at))
        return self._run_on(self._acquire(weights), args)

    def _contiguous(self, args: list[Any]) -> list[Any]:
        """`args` (the runtime inputs) contiguous where the compiled code assumes the strides
        it saw."""
        for k in self._contiguous_args:
            if isinstance(args[k], torch.Tensor) and not args[k].is_contiguous():
                args[k] = args[k].contiguous()
        return args

    def _run_on(self, container: _Container, args: list[Any]) -> list[torch.Tensor]:
        """Run on `container`, which the caller marked running, and release it."""
        try:
            outputs: list[torch.Tensor] = container.loader.run(args)
        finally:
            with self._mutex:
                container.running -= 1
                if self._waiting:
                    self._changed.notify_all()
        return outputs

    def bind(self, fixed: Mapping[int, Any]) -> Callable[..., list[torch.Tensor]] | None:
        """This segment's call with its constant inputs fixed: `fixed` maps each constant
        input's position to its tensor (one weights version); the function returned takes the
        runtime inputs in order. None when `fixed` is not exactly the constant inputs.

        Why: runtime/direct.py calls a one-segment program once per execution with the same
        weights, and `__call__` spent 2.5 us of the MLP's 5.7 around the model's 3.2 taking
        the weights apart and comparing 16 of them by identity. Bound, a call compares one
        tuple: the one the container holding these weights keeps (a load gives a container
        a new tuple), found again through `__call__` (which loads them where none holds
        them) when it is no longer there."""
        if not self._constant or set(fixed) != set(self._constant):
            return None
        weights = tuple(fixed[i] for i in self._constant)
        runtime, constant, mutex = self._runtime, self._constant, self._mutex
        held: list[Any] = [None, None]  # the container holding `weights`, and its tuple

        def slow(args: tuple[Any, ...]) -> list[torch.Tensor]:
            inputs: list[Any] = [None] * (len(runtime) + len(constant))
            for i, value in zip(runtime, args, strict=True):
                inputs[i] = value
            for i, value in zip(constant, weights, strict=True):
                inputs[i] = value
            outputs = self(*inputs)
            with mutex:
                for container in self._containers:
                    if container.ready and _same(container.weights, weights):
                        held[:] = [container, container.weights]
            return outputs

        def call(*args: Any) -> list[torch.Tensor]:
            listed = self._contiguous(list(args))  # before the container is taken
            container, tensors = held
            with mutex:
                fast = container is not None and container.weights is tensors and (
                    container.ready)
                if fast:
                    self._take(container)
            if not fast:
                return slow(args)
            self.calls += 1
            return self._run_on(container, listed)

        return call

    def _acquire(self, weights: tuple[Any, ...]) -> _Container:
        """A container holding `weights`, marked running; loads them into one when none does."""
        latest = self._latest
        with self._mutex:
            while True:
                if latest.ready and _same(latest.weights, weights):  # the usual case
                    return self._take(latest)
                for container in self._containers:
                    if _same(container.weights, weights):
                        if container.ready:
                            return self._take(container)
                        break  # another call is loading these: wait for it
                else:
                    if self.frozen:
                        return self._take(self._frozen_container(weights))
                    target = self._idle_container()
                    if target is not None:
                        break
                self._waiting += 1
                try:
                    self._changed.wait()
                finally:
                    self._waiting -= 1
                latest = self._latest
            target.weights, target.ready, target.running = weights, False, 1
        self._fill(target, weights)
        return target

    def _fill(self, target: _Container, weights: tuple[Any, ...]) -> None:
        """Load `weights` into `target` (claimed: not ready, running 1); on return it is ready
        and still claimed, on failure released and empty."""
        try:
            self._load(target.loader, weights)
        except BaseException:
            with self._mutex:
                target.weights, target.ready, target.running = (), True, 0
                self._changed.notify_all()
            raise
        with self._mutex:
            target.ready = True
            target.loads += 1
            self.loads += 1
            self._touch(target)
            self._changed.notify_all()

    def prepare_weights(self, tensors: Mapping[str, Any]) -> None:
        """Load a new weights version (name -> tensor, as the executor's next Weights will hold
        them) into a spare container before executions use it, so that the first of them does
        not pay the copy. Never evicts the container the latest calls ran on, never waits: with
        no spare container free, the first call on the new version loads it instead."""
        if not self._constant or self._weight_names is None:
            return
        weights = tuple(tensors[name] for name in self._weight_names)
        with self._mutex:
            if any(_same(c.weights, weights) for c in self._containers):
                return
            if self.frozen:
                self._frozen_container(weights)
                return
            target = self._idle_container(keep=self._latest)
            if target is None:
                return
            target.weights, target.ready, target.running = weights, False, 1
        self._fill(target, weights)
        with self._mutex:
            target.running = 0
            if self._waiting:
                self._changed.notify_all()

    def _take(self, container: _Container) -> _Container:
        container.running += 1
        if container is not self._latest:  # the latest is the most recent already
            self._touch(container)
        return container

    def _touch(self, container: _Container) -> None:
        self._clock += 1
        container.last_used = self._clock
        self._latest = container

    def _idle_container(self, keep: _Container | None = None) -> _Container | None:
        """A new container while fewer than MAX_CONTAINERS exist (the old version may still
        be wanted: executions that started on it and have not reached this segment yet),
        else the least recently used one no call runs on, or None: wait."""
        if len(self._containers) < MAX_CONTAINERS and self._new_loader is not None:
            container = _Container(self._new_loader(), ())
            self._containers.append(container)
            return container
        idle = [c for c in self._containers if c.running == 0 and c.ready and c is not keep]
        return min(idle, key=lambda c: c.last_used) if idle else None

    def _load(self, loader: Any, weights: tuple[Any, ...]) -> None:
        """Copy `weights` into the loader's active constant buffer (no call runs on it)."""
        loader.load_constants(self.constant_tensors(weights), False, False)

    def constant_tensors(self, weights: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The AOTI constants (name -> tensor) of these weights of the constant inputs: each
        contiguous and owning its bytes, a transposed one as its weight's transpose, and the
        packed ones derived from theirs."""
        tensors = {}
        for fqn, value in zip(self._fqns, weights, strict=True):
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                raise TypeError(f"{self.__name__}: constant {fqn} must be a CPU tensor, got "
                                f"{type(value).__name__}")
            tensors[fqn] = value.detach().t().contiguous() if fqn in self.transposed else (
                _compact(value))
        for packed in self.packed:
            tensors[packed.name] = packed.pack(tensors[packed.source])
        return tensors

    def _frozen_container(self, weights: tuple[Any, ...]) -> _Container:
        """The one container of a frozen segment, for `weights` equal in value to those it was
        compiled with (other tensor objects: adopted); other values cannot be loaded."""
        container = self._containers[0]
        held = container.weights
        if len(held) == len(weights) and all(
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(held, weights, strict=True)
        ):
            container.weights = weights
            return container
        raise WeightsError(self._frozen_message())

    def _frozen_message(self) -> str:
        names = ", ".join(sorted(set(self._weight_names or ())))
        return (
            f"{self.__name__} cannot swap its weights ({names}): {self.frozen}; swapping them "
            "needs a recompile (compile without autotune to keep every weight swappable)"
        )

    async def aclose(self) -> None:
        """Nothing to wait for: the containers start no thread (calls run on the caller's)."""

    def statistics(self) -> dict[str, Any]:
        """Calls so far, the nodes this segment replaces, its containers and buffer loads."""
        return {"name": self.__name__, "calls": self.calls, "nodes": len(self.node_names),
                "constants": len(self._constant), "containers": len(self._containers),
                "loads": self.loads, "packed": len(self.packed), "frozen": self.frozen,
                "call": self.call}

    @property
    def call(self) -> str:
        """How the segment is called: "native" (its C entry point, GIL released), "native
        (unchecked)" before the first call has been compared with the binding, or "binding
        (why)" (torch's AOTIModelPackageLoader, which holds the GIL)."""
        return str(getattr(self._containers[0].loader, "kind", self._call))

    def __repr__(self) -> str:
        return f"<AOTIDelegate {self.__name__}: {len(self.node_names)} nodes>"


def _compact(value: torch.Tensor) -> torch.Tensor:
    """`value` as a tensor that owns exactly its bytes, contiguous: the buffer update copies
    the whole storage from the data pointer and keeps the compiled strides."""
    value = value.detach()
    whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
    if value.is_contiguous() and value.storage_offset() == 0 and whole:
        return value
    return value.clone(memory_format=torch.contiguous_format)
