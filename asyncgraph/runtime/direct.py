"""DirectCall: an execution of a one-call program made as one Python call, on the loop or a worker.

Why: the AOTInductor form of a small model is one compiled call (compiled/aoti_form.py). The
MLP's kernels ran in 3 us through torch's binding, and an execution of that form through the
Executor's general path took 12 us around them: the placement and mode choices, the frame's
values, the run loop, the inference-mode guard, the delegate's weights check. The default path
then ran at 1.2x ONNX Runtime's latency at batch 1 with kernels taking a quarter of it
(benchmarks/results/cpu/design_measurements.md#direct-calls).

What: for an Executor whose graph is one delegate node and the getitems taking its outputs
apart, reading only user inputs and weights, whose frame would hold nothing more than the
values (`Executor._may_run_alone`: no mutation, effect, device or trace), an execution of an
input signature whose node adaptive placement has settled inline (alone and under load) runs as
Mode.DIRECT: the delegate called on the user inputs by a function generated once per weights
version with the weights bound in it (no value list copied and read back: 16 of the MLP's
form's 17 arguments are weights; a delegate with `bind`, AOTInductor's, fixes them itself and
compares one tuple per call rather than each weight), the outputs picked from its result.
Everything else the general path decides still holds: the pool must have a frame free (it
bounds executions), the call is placed as the general path places a straight line of its
measured time (ModeChooser.place): at once where the loop's budget has room, else, for a call
worth a worker while the loop is busy (callers queued, or work waiting past a spent slice),
as Mode.DIRECT_WORKER: the call as one work item of a worker thread, holding a frame of the
pool, its end waking the loop through the Executor's LoopWake (`run_on_worker`; the general
path's LINE_WORKER would load a frame, choose a placement and schedule and run units around
the same call: on the encoder's ONNX form under 64 callers that cost the loop's thread 15 us
more per request, design_measurements.md#direct-calls-on-workers); where this iteration's
slice is spent, as Mode.DIRECT_NEXT: the call as an entry of the loop budget's queue, run in
the first later iteration whose slice has room, holding a frame meanwhile (`run_next`; the
general path's LINE_NEXT waits the same iteration around a frame load and units: a lone
caller on uvloop, whose slice always ends, meets it about one execution in four,
design_measurements.md#direct-calls-in-a-later-slice). Any
other answer (a call longer than a slice on a loop with nothing to overlap it) hands the
execution to the general path. The loop's time is accounted, the
weights version noted for the task, a kernel's error names its node; cancelled, a call on a
worker is waited for before its frame goes back. A signature not settled yet (warming,
profiled) takes the general path, which settles it.

The delegate runs outside the inference-mode guard when it says it does not need it
(`needs_inference_mode = False`: compiled code that records no autograd and returns tensors
that do not require grad): on the MLP the guard's entry and exit and the inference tensors
cost 2.4 us of the 8.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, OutputKind, Ref
from asyncgraph.runtime.delegates import Delegate
from asyncgraph.runtime.failures import add_node_note
from asyncgraph.runtime.loop_budget import LoopBudget
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.modes import Mode, ModeChooser
from asyncgraph.runtime.placement import AdaptivePlacement
from asyncgraph.runtime.plan import ExecutionPlan, Placement, emit_args
from asyncgraph.runtime.schedule import ScheduleCache
from asyncgraph.runtime.scheduler import wait_finished
from asyncgraph.runtime.weights import Weights, ran_on
from asyncgraph.runtime.workers import WorkerPool

_inference_mode = torch._C._InferenceMode  # the C++ guard (scheduler.py)
_INLINE = Placement.INLINE
_FRAMELESS, _LINE_NEXT, _LINE_WORKER = Mode.FRAMELESS, Mode.LINE_NEXT, Mode.LINE_WORKER
MAX_SETTLED = 64  # signatures remembered as settled; more, and the table starts again


ON_WORKER = -1.0  # `start`'s answer for Mode.DIRECT_WORKER (a perf_counter time is >= 0)
ON_NEXT = -2.0  # `start`'s answer for Mode.DIRECT_NEXT
_FIRST_ITEM = ((0.0, 0),)  # WorkerPool.submit's (key, unit) of a single item


class _WorkerCall:
    """One Mode.DIRECT_WORKER call, between the loop and the worker thread running it."""

    __slots__ = ("call", "error", "finished", "inputs", "result", "waiter", "wake")

    def __init__(self, call: Callable[..., Any], inputs: list[Any],
                 wake: Callable[..., Any], waiter: Any) -> None:
        self.call, self.inputs, self.wake, self.waiter = call, inputs, wake, waiter
        self.result: Any = None
        self.error: Exception | None = None
        self.finished = False  # set on the loop, once the thread is done with the call

    def finish(self) -> None:
        """On the loop: the thread is done; wake the execution."""
        self.finished = True
        if not self.waiter.done():
            self.waiter.set_result(None)


class _NextCall:
    """One Mode.DIRECT_NEXT call waiting in the loop budget's queue: its inputs (None once
    it ran, or once its execution was cancelled), its time, its waiter, and the weights
    version it ran on."""

    __slots__ = ("inputs", "seconds", "version", "waiter")

    def __init__(self, inputs: list[Any], seconds: float, waiter: Any) -> None:
        self.inputs: list[Any] | None = inputs
        self.seconds, self.waiter = seconds, waiter
        self.version = -1


def _call_on_worker(call: _WorkerCall, unit: int) -> None:
    """WorkerPool's item: the call, then the loop woken to finish it. A kernel's error goes
    to the execution; anything else (an interrupt, SystemExit) to the worker's unraisable
    hook as any item's does, the execution woken all the same (it gets no result)."""
    try:
        call.result = call.call(*call.inputs)
    except Exception as exc:
        call.error = exc
    finally:
        call.inputs = []  # the thread holds no request tensor once done
        call.wake(call.finish)


def _unset(*inputs: Any) -> Any:
    raise AssertionError("DirectCall ran before its call was laid out")  # never: see `run`


class DirectCall:
    """Mode.DIRECT for one Executor (loop thread only): `start` says whether an execution of
    a signature runs so, `run` runs it."""

    def __init__(
        self, graph: Graph, plan: ExecutionPlan, fn: Callable[..., Any], node: int,
        items: tuple[int, ...], guarded: bool, weights: Callable[[], Weights],
        adaptive: AdaptivePlacement | None, schedules: ScheduleCache, modes: ModeChooser,
        state: LoopState, has_free: Callable[[], bool], workers: WorkerPool,
    ) -> None:
        self._graph, self._plan = graph, plan
        self._fn = fn  # the delegate
        self._node = node
        self._items = items  # per user output: its index in the call's result
        self._guarded = guarded  # under torch.inference_mode
        self._weights = weights
        self._adaptive = adaptive
        self._schedules = schedules
        self._modes = modes
        self._state = state
        self._has_free = has_free
        self._workers = workers  # Mode.DIRECT_WORKER's threads
        self._call: Callable[..., Any] = _unset  # the delegate on the user inputs (`_lay_out`)
        self._version = -1
        self._settled: dict[Any, tuple[float, bool]] = {}  # signature -> (seconds, worth)
        self._hot: Any = None  # the signature of the last execution, and its entry
        self._hot_entry = (0.0, False)
        self.calls = 0
        self.worker_calls = 0

    @classmethod
    def of(cls, graph: Graph, plan: ExecutionPlan, fns: list[Any], config_guard: bool,
           **parts: Any) -> DirectCall | None:
        """The DirectCall of a graph that is one delegate node (`fns`: the kernels'
        callables) and the getitems taking its outputs apart, reading only user inputs,
        weights and constants; else None."""
        calls = [n for n in graph.nodes if isinstance(fns[n.index], Delegate)]
        if len(calls) != 1:
            return None
        node = calls[0]
        sig = graph.signature
        readable = {*plan.user_input_slots, *(slot for slot, _ in plan.weight_slots)}
        if node.kwargs or not set(node.inputs()) <= readable:
            return None
        taken = {n.output: n.args[1] for n in graph.nodes if n is not node
                 and n.target is operator.getitem and n.args[0] == Ref(node.output)
                 and type(n.args[1]) is int}
        if len(taken) != len(graph.nodes) - 1:
            return None
        outputs = [o.arg for o in sig.outputs if o.kind is OutputKind.USER_OUTPUT]
        if len(outputs) != len(sig.outputs) or not all(
                isinstance(o, Ref) and o.id in taken for o in outputs):
            return None
        guarded = config_guard and getattr(fns[node.index], "needs_inference_mode", True)
        return cls(graph, plan, fns[node.index], node.index,
                   tuple(taken[o.id] for o in outputs), guarded, **parts)

    def start(self, signature: Any) -> float | None:
        """The perf_counter time an execution of `signature` starts at as Mode.DIRECT, the
        loop's budget taken; ON_WORKER: it runs as Mode.DIRECT_WORKER (`run_on_worker`:
        the call is worth a worker and the loop is busy, as ModeChooser.place decides for a
        line); ON_NEXT: as Mode.DIRECT_NEXT (`run_next`: the slice is spent, a fresh one
        holds the call); None: the general path runs it (no signature computed, not settled,
        no frame free, or a call longer than a slice that stays on the loop)."""
        if signature is None:
            return None
        if signature is self._hot:
            seconds, worth = self._hot_entry
        else:
            entry = self._settled.get(signature) or self._settle(signature)
            if entry is None:
                return None
            self._hot, self._hot_entry = signature, entry
            seconds, worth = entry
        if not self._has_free() or self._state.budget is None:
            return None
        mode, start = self._modes.place(seconds, worth, True)
        if mode is _FRAMELESS:
            return start
        if mode is _LINE_NEXT:
            return ON_NEXT
        return ON_WORKER if mode is _LINE_WORKER else None

    def run(self, flat: list[Any], start: float) -> list[Any]:
        """The execution, started at `start` (from `start`): its outputs, or its kernel's
        error with the node named."""
        weights = self._weights()
        if weights.version != self._version:
            self._lay_out(weights)
        ran_on(self._version)
        guard = _inference_mode(True) if self._guarded else None
        try:
            result = self._call(*flat)
        except Exception as exc:  # named as units.py names a kernel's error
            add_node_note(exc, self._graph, self._node)
            raise
        finally:
            del guard
            self._state.account(start, time.perf_counter())
        self.calls += 1
        return [result[i] for i in self._items]

    async def run_on_worker(self, flat: list[Any]) -> list[Any]:
        """Mode.DIRECT_WORKER: the execution as one work item of a worker thread (`start`
        said ON_WORKER); its outputs, or its kernel's error with the node named. Cancelled,
        it waits until the call has ended (as the scheduler's lines do: the Executor's
        frame held for it is not free before), then re-raises."""
        weights = self._weights()
        if weights.version != self._version:
            self._lay_out(weights)
        version = self._version
        state = self._state
        loop = state.loop
        assert loop is not None  # bound: `start` found the budget
        call = _WorkerCall(self._call, flat, loop.call_soon_threadsafe, loop.create_future())
        state.running += 1  # in flight, as the general path's lines on workers are
        state.lines_on_workers += 1
        cancelled: BaseException | None = None
        try:
            self._workers.submit(_call_on_worker, call, _FIRST_ITEM)
            try:
                await call.waiter
            except loop.cancelled_exc as exc:
                cancelled = exc
                with loop.shielded():  # trio cancels every checkpoint of a cancelled scope
                    await wait_finished(call, loop)
        finally:
            state.running -= 1
            state.lines_on_workers -= 1
        if cancelled is not None:
            raise cancelled
        ran_on(version)
        if call.error is not None:  # named as units.py names a kernel's error
            add_node_note(call.error, self._graph, self._node)
            raise call.error
        if call.result is None:
            raise RuntimeError(f"{self._graph.nodes[self._node].name}: the call on a worker "
                               "thread ended without a result (see the worker's unraisable hook)")
        self.worker_calls += 1
        result = call.result
        return [result[i] for i in self._items]

    async def run_next(self, flat: list[Any], signature: Any) -> list[Any]:
        """Mode.DIRECT_NEXT: the execution as an entry of the loop budget's queue (`start`
        said ON_NEXT), run at once in the first later iteration whose slice has room; its
        outputs, or its kernel's error with the node named. Cancelled before its turn, the
        call never runs; once run, it has ended (it runs on the loop's thread)."""
        state = self._state
        budget, loop = state.budget, state.loop
        assert budget is not None and loop is not None  # bound: `start` found the budget
        entry = self._settled.get(signature)
        call = _NextCall(flat, entry[0] if entry is not None else budget.slice_s,
                         loop.create_future())
        state.lines_next += 1  # waiting for a later iteration, as LINE_NEXT's lines do
        try:
            budget.defer(self._next_turn, budget, call)
            await call.waiter
        finally:
            if call.inputs is not None:  # cancelled before its turn: it never runs
                state.lines_next -= 1
                call.inputs = None
        ran_on(call.version)  # in the caller's task: the call ran in the budget's callback
        return call.waiter.result()  # type: ignore[no-any-return]

    def _next_turn(self, budget: LoopBudget, call: _NextCall) -> None:
        """The budget's queue reached `call`: run it if this slice holds it, else wait for
        the next iteration's (behind the entries queued since)."""
        flat = call.inputs
        if flat is None or call.waiter.done():  # its execution was cancelled meanwhile
            return
        start = budget.start(call.seconds)
        if start is None:
            budget.defer(self._next_turn, budget, call)
            return
        call.inputs = None
        self._state.lines_next -= 1
        try:
            outputs = self.run(flat, start)
        except Exception as exc:  # the kernel's, named: the execution raises it
            call.waiter.set_exception(exc)
            return
        call.version = self._version
        call.waiter.set_result(outputs)

    def _lay_out(self, weights: Weights) -> None:
        template = weights.template(self._plan.weight_slots, self._plan.num_values)
        inputs = {slot: k for k, slot in enumerate(self._plan.user_input_slots)}
        namespace: dict[str, Any] = {"f": self._fn}

        def name(ref: Ref) -> str:  # a user input is a parameter, a weight a bound name
            k = inputs.get(ref.id)
            if k is not None:
                return f"a{k}"
            namespace[f"w{ref.id}"] = template[ref.id]
            return f"w{ref.id}"

        node = self._graph.nodes[self._node]
        params = ", ".join(f"a{k}" for k in range(len(inputs)))
        bound = self._bound(node.args, inputs, template)
        if bound is not None:  # the delegate with this version's weights fixed
            namespace["f"] = bound
            args = ", ".join(f"a{inputs[a.id]}" for a in node.args
                             if isinstance(a, Ref) and a.id in inputs)
        else:
            args = emit_args(node, namespace, name)
        code = f"def call({params}):\n    return f({args})\n"
        exec(compile(code, "<asyncgraph direct call>", "exec"), namespace)
        self._call = namespace["call"]
        self._version = weights.version

    def _bound(self, args: Any, inputs: dict[int, int],
               template: list[Any]) -> Callable[..., Any] | None:
        """The delegate's call with every argument but the user inputs fixed (AOTIDelegate's
        `bind`: no weights compared per call), or None."""
        bind = getattr(self._fn, "bind", None)
        if bind is None or not all(isinstance(a, Ref) for a in args):
            return None
        fixed = {i: template[a.id] for i, a in enumerate(args) if a.id not in inputs}
        bound: Callable[..., Any] | None = bind(fixed)
        return bound

    def _settle(self, signature: Any) -> tuple[float, bool] | None:
        """The line's measured time and whether it is worth a worker, once adaptive
        placement has settled `signature`'s node inline alone and under load (None until
        then: the general path profiles it)."""
        if self._adaptive is not None:
            settled = self._adaptive.settled(signature)
            if settled is None or any(p[self._node] is not _INLINE for p in settled):
                return None
            placement = settled[0]
        else:
            placement = self._plan.placement
            if placement[self._node] is not _INLINE:
                return None
        schedule = self._schedules.cached(placement, True)
        line = schedule.straight if schedule is not None else None
        if line is None:
            return None
        if len(self._settled) >= MAX_SETTLED:
            self._settled.clear()
        entry = self._settled[signature] = (line.seconds, self._modes.worth_a_worker(line))
        return entry
