"""Fault injection: kernels that raise, sleep or block, on chosen nodes or at random.

A FaultInjector wraps the kernels of an Executor when it is built, so the scheduler runs the
faulty kernels exactly where it would run the real ones (inline, on a worker, as a task):

    faults = FaultInjector(seed=7)
    faults.raise_on("linear", calls={2})          # the third call of %linear raises
    gate = faults.block("matmul")                  # %matmul waits until gate.open()
    faults.random(raise_rate=0.01, delay_rate=0.2, max_delay_s=0.002)
    ex = Executor(program, config, kernel_factory=faults.kernel_factory())

Decisions are seeded: each node has its own random stream, drawn once per call, so the k-th
call of a node gets the same decision in every run with the same seed. Which execution makes
the k-th call depends on the interleaving. A driver that runs one execution at a time can set
`epoch` (say, to the execution's number) before each one: every node's stream then restarts
from (seed, node, epoch), so decisions no longer depend on which branches earlier, failed
executions skipped, and the run replays exactly.

Sync kernels sleep and block their thread; async kernels await. A blocking fault on a kernel
that runs inline on the event loop thread would deadlock the loop, so it raises
FaultInjectionError instead (give that node placement="worker"). Random delays never block the
loop: inline kernels are not delayed by `random()`.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel

if TYPE_CHECKING:
    from asyncgraph.graph.ir import Graph, Node

Action = Literal["raise", "delay", "block"]
ExceptionFactory = Callable[[str, int], BaseException]


class InjectedFault(RuntimeError):
    """The exception a raising fault throws by default.

    Attributes:
        node: the name of the node whose kernel raised.
        call: which call of that node's kernel raised (0 is the first).
    """

    def __init__(self, node: str, call: int) -> None:
        super().__init__(f"injected fault in node {node!r} (call {call})")
        self.node = node
        self.call = call


class FaultInjectionError(RuntimeError):
    """A fault cannot be injected as asked (a blocking fault on the event loop thread)."""


class Gate:
    """A latch that blocking faults wait behind until `open()`.

    Sync kernels wait on a threading.Event; async kernels await a future of their loop, so a
    blocked async kernel can still be cancelled. `waiting` counts the kernels blocked now,
    `entered` all that ever blocked; `wait_entered(n)` lets a test wait until n are blocked.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.entered = 0
        self.waiting = 0

    @property
    def is_open(self) -> bool:
        return self._event.is_set()

    def open(self) -> None:
        """Release every kernel blocked now, and let later ones pass."""
        with self._lock:
            self._event.set()
            futures, self._futures = self._futures, []
        for loop, future in futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def close(self) -> None:
        """Block kernels again from now on."""
        self._event.clear()

    def wait_sync(self, timeout: float | None = None) -> bool:
        """Block this thread until the gate opens; False when `timeout` passed first."""
        with self._lock:
            self.entered += 1
            self.waiting += 1
        try:
            return self._event.wait(timeout)
        finally:
            with self._lock:
                self.waiting -= 1

    async def wait_async(self) -> None:
        """Await the gate opening without blocking the loop (cancellable)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self.entered += 1
            if self._event.is_set():
                return
            future: asyncio.Future[None] = loop.create_future()
            self._futures.append((loop, future))
            self.waiting += 1
        try:
            await future
        finally:
            with self._lock:
                self.waiting -= 1
                if (loop, future) in self._futures:
                    self._futures.remove((loop, future))

    async def wait_entered(self, count: int = 1, within_s: float = 10.0) -> None:
        """Wait until `count` kernels are blocked at this gate (a test helper)."""
        deadline = time.monotonic() + within_s
        while self.waiting < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {self.waiting} of {count} kernel(s) blocked at the gate "
                    f"after {within_s} s"
                )
            await asyncio.sleep(0.001)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class FaultRule:
    """One kind of fault, on some nodes (None: all), some calls (None: all), with a probability.

    `off_loop_only` skips sync kernels that run on the event loop thread (random delays use it).
    """

    action: Action
    nodes: frozenset[str] | None = None
    calls: frozenset[int] | None = None
    probability: float = 1.0
    delay_s: tuple[float, float] = (0.0, 0.0)
    exception: ExceptionFactory | None = None
    gate: Gate | None = None
    off_loop_only: bool = False

    def applies_to(self, node: str, call: int) -> bool:
        return (self.nodes is None or node in self.nodes) and (
            self.calls is None or call in self.calls
        )


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """A fault that was injected: which node, which call of it, what happened."""

    node: str
    call: int
    action: Action
    delay_s: float = 0.0


@dataclass
class _NodeState:
    rng: random.Random
    calls: int = 0
    epoch: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultInjector:
    """Decides, per kernel call, whether to raise, sleep or block (see the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rules: list[FaultRule] = []
        self.events: list[FaultEvent] = []
        self.enabled = True
        self.epoch = 0
        self._nodes: dict[str, _NodeState] = {}
        self._lock = threading.Lock()

    # -- rules -------------------------------------------------------------------------------

    def raise_on(
        self,
        *nodes: str,
        exception: ExceptionFactory | BaseException | type[BaseException] | None = None,
        calls: Iterable[int] | None = None,
        probability: float = 1.0,
    ) -> FaultInjector:
        """Make the kernels of `nodes` (all when none given) raise.

        `exception` is an exception type, an instance (raised as is: use a fresh injector per
        run), or `factory(node, call)`; the default raises InjectedFault(node, call).
        """
        self.rules.append(
            FaultRule("raise", _names(nodes), _calls(calls), _probability(probability),
                      exception=_exception_factory(exception))
        )
        return self

    def delay(
        self,
        *nodes: str,
        seconds: float | tuple[float, float],
        calls: Iterable[int] | None = None,
        probability: float = 1.0,
    ) -> FaultInjector:
        """Delay the kernels of `nodes` by `seconds` (or uniformly within a (lo, hi) range)."""
        lo, hi = (seconds, seconds) if isinstance(seconds, (int, float)) else seconds
        if not 0 <= lo <= hi:
            raise ValueError(f"delay seconds must satisfy 0 <= lo <= hi, got {seconds!r}")
        self.rules.append(
            FaultRule("delay", _names(nodes), _calls(calls), _probability(probability),
                      delay_s=(float(lo), float(hi)))
        )
        return self

    def block(
        self,
        *nodes: str,
        calls: Iterable[int] | None = None,
        probability: float = 1.0,
        gate: Gate | None = None,
    ) -> Gate:
        """Make the kernels of `nodes` wait until the returned gate is opened."""
        gate = gate if gate is not None else Gate()
        self.rules.append(
            FaultRule("block", _names(nodes), _calls(calls), _probability(probability),
                      gate=gate)
        )
        return gate

    def random(
        self,
        *,
        raise_rate: float = 0.0,
        delay_rate: float = 0.0,
        max_delay_s: float = 0.002,
        nodes: Iterable[str] | None = None,
    ) -> FaultInjector:
        """Random faults on every kernel call: raise with `raise_rate`, sleep with `delay_rate`.

        Delays are uniform in [0, max_delay_s] and skip inline kernels on the event loop.
        """
        names = frozenset(nodes) if nodes is not None else None
        if delay_rate > 0:
            self.rules.append(
                FaultRule("delay", names, None, _probability(delay_rate),
                          delay_s=(0.0, float(max_delay_s)), off_loop_only=True)
            )
        if raise_rate > 0:
            self.rules.append(
                FaultRule("raise", names, None, _probability(raise_rate),
                          exception=_exception_factory(None))
            )
        return self

    def open_gates(self) -> None:
        """Open every gate of a blocking rule, releasing all blocked kernels."""
        for rule in self.rules:
            if rule.gate is not None:
                rule.gate.open()

    # -- wiring ------------------------------------------------------------------------------

    def kernel_factory(self, base: KernelFactory | None = None) -> KernelFactory:
        """A KernelFactory whose kernels are `base`'s (the default one's) with faults added."""
        return FaultInjectingKernelFactory(self, base)

    def calls(self, node: str) -> int:
        """How many times the kernel of `node` has been called."""
        state = self._nodes.get(node)
        return state.calls if state is not None else 0

    def wrap(self, kernel: OpKernel, node: Node) -> OpKernel:
        """The kernel of `node` with this injector's faults; same kind, name and cost."""
        state = self._state(node.name)
        fn = kernel.fn
        name = node.name
        if kernel.kind is KernelKind.ASYNC:

            async def async_kernel(*args: Any, **kwargs: Any) -> Any:
                for rule, event in self._decide(name, state, on_loop=False):
                    if rule.action == "delay":
                        await asyncio.sleep(event.delay_s)
                    elif rule.action == "block":
                        assert rule.gate is not None
                        await rule.gate.wait_async()
                    else:
                        raise self._exception(rule, event)
                return await fn(*args, **kwargs)

            wrapped: Callable[..., Any] = async_kernel
        else:

            def sync_kernel(*args: Any, **kwargs: Any) -> Any:
                for rule, event in self._decide(name, state, on_loop=_on_loop_thread()):
                    if rule.action == "delay":
                        time.sleep(event.delay_s)
                    elif rule.action == "block":
                        assert rule.gate is not None
                        if _on_loop_thread():
                            raise FaultInjectionError(
                                f"cannot block node {name!r}: its kernel runs inline on the "
                                "event loop thread, which would deadlock; give the node "
                                "placement='worker' or block an async node"
                            )
                        rule.gate.wait_sync()
                    else:
                        raise self._exception(rule, event)
                return fn(*args, **kwargs)

            wrapped = sync_kernel
        wrapped.__name__ = f"faulty[{kernel.name}]"
        return kernel.with_fn(wrapped)

    def check_nodes(self, graph: Graph) -> None:
        """Raise KeyError naming any node of a rule that the graph does not have."""
        known = {n.name for n in graph.nodes}
        unknown = sorted(
            {name for rule in self.rules for name in (rule.nodes or ()) if name not in known}
        )
        if unknown:
            raise KeyError(
                f"fault rule(s) name node(s) the graph does not have: {', '.join(unknown)}; "
                f"its nodes are: {', '.join(sorted(known))}"
            )

    # -- internals ---------------------------------------------------------------------------

    def _state(self, node: str) -> _NodeState:
        with self._lock:
            state = self._nodes.get(node)
            if state is None:
                state = self._nodes[node] = _NodeState(random.Random(f"{self.seed}:{node}"))
            return state

    def _decide(
        self, node: str, state: _NodeState, on_loop: bool
    ) -> list[tuple[FaultRule, FaultEvent]]:
        """The faults of this call of `node`; one draw per rule and call, in rule order."""
        with state.lock:
            call = state.calls
            state.calls += 1
            if state.epoch != self.epoch:
                state.epoch = self.epoch
                state.rng = random.Random(f"{self.seed}:{node}:{self.epoch}")
            draws = [(state.rng.random(), state.rng.random()) for _ in self.rules]
        if not self.enabled:
            return []
        chosen: list[tuple[FaultRule, FaultEvent]] = []
        for rule, (draw, extra) in zip(self.rules, draws, strict=True):
            if not rule.applies_to(node, call) or draw >= rule.probability:
                continue
            if rule.off_loop_only and on_loop:
                continue
            lo, hi = rule.delay_s
            event = FaultEvent(node, call, rule.action, lo + (hi - lo) * extra)
            chosen.append((rule, event))
            self.events.append(event)
        return chosen

    @staticmethod
    def _exception(rule: FaultRule, event: FaultEvent) -> BaseException:
        factory = rule.exception or InjectedFault
        return factory(event.node, event.call)


class FaultInjectingKernelFactory(KernelFactory):
    """The kernels of `base` (or the default factory) wrapped by a FaultInjector."""

    def __init__(self, injector: FaultInjector, base: KernelFactory | None = None) -> None:
        self.injector = injector
        self.base = base

    def create(self, graph: Graph) -> list[OpKernel]:
        self.injector.check_nodes(graph)
        kernels = self.base.create(graph) if self.base is not None else super().create(graph)
        return [self.injector.wrap(k, n) for k, n in zip(kernels, graph.nodes, strict=True)]


def _on_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _names(nodes: tuple[str, ...]) -> frozenset[str] | None:
    return frozenset(nodes) if nodes else None


def _calls(calls: Iterable[int] | None) -> frozenset[int] | None:
    return frozenset(calls) if calls is not None else None


def _probability(p: float) -> float:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a fault probability must be in [0, 1], got {p}")
    return float(p)


def _exception_factory(
    exception: ExceptionFactory | BaseException | type[BaseException] | None,
) -> ExceptionFactory:
    if exception is None:
        return InjectedFault
    if isinstance(exception, BaseException):
        instance = exception
        return lambda node, call: instance
    if isinstance(exception, type):
        cls: type[BaseException] = exception
        return lambda node, call: cls(f"injected {cls.__name__} in node {node!r} (call {call})")
    factory: ExceptionFactory = exception
    return factory
