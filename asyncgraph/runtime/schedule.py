"""Schedule: the graph of units one execution runs, for one placement of the nodes.

A unit is what the scheduler dispatches: one node, or a *fused run* of inline nodes compiled
into one straight-line function, as torch.fx's codegen writes a whole graph. With a device's
run plan (`DeviceRuns`, runtime/device.py: cuda/streams.py's StreamPlan), consecutive CUDA
nodes on one stream are fused the same way (a *CUDA run*): the GPU layer switches to the
run's stream once (`FrameStreams.run_unit`) and the compiled code calls the layer only where
the plan needs it (a wait on another stream's event, a fence, a record_stream, an event
someone waits on: the statements `DeviceRuns` gives), so enqueueing N kernels costs one dispatch and
O(cross-stream edges) GPU-layer calls instead of N stream switches. Inside a run,
values that never leave it are Python locals deleted after their last use; only values read
elsewhere (or returned) are stored in the frame. So a run of N cheap ops costs one dispatch,
one lock and one count update instead of N of each, and reads locals instead of list slots.

Runs are consecutive nodes of the graph's topological order, hence convex: no path leaves a
run and comes back, and the units form a DAG. A run ends after a node with a user that is not
inline, so a worker, task or stream node never waits for unrelated inline work, and after
`max_fused_nodes` nodes, so the loop can check its time slice between units. A node marked
`unfusable` (a CPU node reading GPU values, which the scheduler may have to start only once the
GPU has written them: docs/gpu.md) is a unit of its own, and runs end before it.

A *segment* (an atomic group, `AtomicGroups`: asyncgraph/cuda/segments.py's convex groups of
capturable nodes of a GPU program that is not wholly capturable) is one unit of fused
schedules, placed DEVICE: its nodes run in the order of `AtomicGroups.order`, a topological
order in which each group is contiguous, so units stay consecutive nodes of that order. Its
schedule call only refuses to run: the frame's device tables give it the frame's segment call
(warm-up, capture or replay: cuda/graphs.py), and `segments[u]` names the segment of unit u
(-1 for the others).

Timed executions (adaptive-placement profiling, traces) and seeded ready orders use the
unfused schedule, where unit i is node i (and no segment is formed).

Each unit has a *priority*: the cost of the longest path of units from its start to the end
of the graph (its own cost included; list scheduling's "upward rank"). Worker threads take the
unit with the highest first (workers.py). Costs are measured node times once adaptive
placement has decided the placement, and the kernels' estimates before.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from asyncgraph.graph.ir import Graph, Ref
from asyncgraph.kernels import OpKernel
from asyncgraph.runtime.device import ALIAS_KEY, DeviceRuns, RunKey
from asyncgraph.runtime.placement import Decision
from asyncgraph.runtime.plan import ExecutionPlan, Placement, emit_args


@dataclass(frozen=True, slots=True)
class StraightLine:
    """A schedule's units in order, and the values to drop after each (runtime/straight.py
    runs it)."""

    drops: tuple[tuple[int, ...], ...]  # per unit: values whose last reader it is
    seconds: float  # the measured time of all units together
    unit_seconds: tuple[float, ...]  # per unit: its measured time
    node_seconds: float  # the measured time per node: large when kernels (off the GIL) rule
    any_thread: bool  # every node may run on any thread (placement.py: AdaptivePlacement)
    stack: tuple[int, ...] = ()  # its units as the run loop's stack (units.py): last first


@dataclass(frozen=True, slots=True)
class AtomicGroups:
    """Groups of nodes that fused schedules run as one unit each (cuda/segments.py's
    segments): `order`, a topological order of all nodes in which each group is contiguous;
    `group_of`, node -> its group, for the nodes in a group."""

    order: tuple[int, ...]
    group_of: dict[int, int]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Units, their dataflow edges and what each frees, for one node placement."""

    placement: tuple[Placement, ...]  # per node: the placement this schedule was built for
    calls: tuple[Callable[[list[Any]], Any], ...]  # per unit
    stores: tuple[int, ...]  # per unit: the slot its call's result goes to; -1 when none
    nodes: tuple[tuple[int, ...], ...]  # per unit: the nodes it runs, in order
    where: tuple[Placement, ...]  # per unit
    users_reversed: tuple[tuple[int, ...], ...]  # per unit: the units reading its values
    producer_counts: tuple[int, ...]  # per unit
    roots: tuple[int, ...]
    frees: tuple[tuple[int, ...], ...]  # per unit: one value id per read of a frame slot
    priority: tuple[float, ...]  # per unit: cost of the longest path from it to the end
    seconds: tuple[float, ...] | None  # per unit: measured time, when costs were measured
    fused: bool
    segments: tuple[int, ...] = ()  # per unit: its segment (cuda/segments.py), -1 if none; or ()
    # the schedule as one loop over its units (straight.py), when every unit is inline
    straight: StraightLine | None = None

    @property
    def num_units(self) -> int:
        return len(self.calls)

    def failed_node(self, unit: int, exc: BaseException) -> int:
        """The node of `unit` whose kernel raised `exc` (from the traceback's line)."""
        nodes = self.nodes[unit]
        if len(nodes) == 1:
            return nodes[0]
        node: int | None = getattr(exc, "asyncgraph_node", None)  # set by a segment's run
        if node is not None and node in nodes:
            return node
        code = getattr(self.calls[unit], "__code__", None)
        line = None
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                line = tb.tb_lineno
            tb = tb.tb_next
        lines: dict[int, int] = getattr(self.calls[unit], "node_lines", {})
        return lines.get(line, nodes[0]) if line is not None else nodes[0]


@dataclass(frozen=True, slots=True)
class ScheduleStatistics:
    schedules: int  # kept now (one per placement in use, fused and unfused)
    built: int  # built so far, including those evicted
    fused_units: int  # units of more than one node, over all schedules
    fused_nodes: int  # nodes in those units


# Graphs up to this many nodes build their schedules on the loop, in well under a loop slice.
# A fused build took 25-30 us per node on the 2-vCPU machine (tiny BERT's 43 nodes: 1.16 ms;
# an 8-node MLP: 0.25 ms), and 2-3 ms on the loop in a first burst, while other threads
# wanted the GIL: past this size a miss is built on a thread.
INLINE_BUILD_NODES = 24


class ScheduleCache:
    """The schedules of one Executor, built on first use per placement tuple.

    Keyed by the placement tuple's identity: placements come from the plan or from adaptive
    placement's decided entries, and hashing a tuple of thousands of entries per execution
    would cost more than the lookup saves. The entry keeps its placement alive, so the id is
    never reused while the entry exists. At most `max_schedules` are kept, least recently used
    evicted: a service seeing ever new input shapes (each decided anew) must not keep every
    schedule, with its compiled units, it ever built.

    A miss compiles code: about 12 ms for a 1,000-node chain fused into 32-node units (3 ms
    unfused), a dozen loop slices. `aget` builds on a thread of the loop's default executor,
    so the loop serves timers, I/O and other executions meanwhile; concurrent misses of one
    key share one build. compile() holds the GIL, and a thread keeps it until the loop
    has waited the interpreter's switch interval (5 ms), so the build gives the GIL away
    after each unit it compiles: the loop then waits for one unit's compile at most.
    """

    def __init__(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        kernels: Sequence[OpKernel],
        max_fused: int,
        unfusable: Sequence[bool] | None = None,
        max_schedules: int = 64,
        decided: Callable[[tuple[Placement, ...]], Decision | None] | None = None,
        stream_plan: DeviceRuns | None = None,
        segments: AtomicGroups | None = None,
        any_thread: Sequence[bool] | None = None,
    ) -> None:
        self.graph = graph
        self.any_thread = any_thread  # per node: may leave the loop thread (placement.py)
        self.stream_plan = stream_plan  # CUDA nodes on one stream fuse into CUDA runs
        self.segments = segments if segments is not None and segments.group_of else None
        self.max_schedules = max_schedules
        self.plan = plan
        self.kernels = kernels
        self.max_fused = max_fused
        self.unfusable = unfusable
        self.decided = decided  # what a placement was decided from (AdaptivePlacement)
        self.estimated_costs = tuple(max(float(k.cost), 1.0) for k in kernels)
        self._cache: OrderedDict[tuple[int, bool], tuple[tuple[Placement, ...], Schedule]] = (
            OrderedDict()
        )
        self._built = 0
        self._building: dict[tuple[int, bool], anyio.Event] = {}
        # The most recently used entry (the last of `_cache`): placement, fused, schedule.
        self._hot: tuple[tuple[Placement, ...], bool, Schedule] | None = None

    def get(self, placement: tuple[Placement, ...], fused: bool) -> Schedule:
        """The schedule for `placement`, built here on a miss (`aget` builds off the loop)."""
        fused = fused and self.max_fused > 1
        hit = self._lookup(placement, fused)
        if hit is not None:
            return hit
        schedule = self._builder(placement, fused)()
        self._add(placement, fused, schedule)
        return schedule

    def cached(self, placement: tuple[Placement, ...], fused: bool) -> Schedule | None:
        """The schedule for `placement` if it is built, else None (then `aget` builds it).

        Executions of one signature ask for one entry again and again: the most recently
        used one is found by two identity tests (it is the last in LRU order already)."""
        fused = fused and self.max_fused > 1
        hot = self._hot
        if hot is not None and hot[0] is placement and hot[1] is fused:
            return hot[2]
        return self._lookup(placement, fused)

    def builds_inline(self) -> bool:
        """Whether a miss is built on the loop: a graph of at most INLINE_BUILD_NODES nodes
        compiles in well under a loop slice, less than the hop to a thread and back costs,
        and deterministically within the call that needs it."""
        return len(self.graph.nodes) <= INLINE_BUILD_NODES

    async def aget(self, placement: tuple[Placement, ...], fused: bool) -> Schedule:
        """`get` for the event loop: a miss of a large graph is built on a thread (the class
        docstring); a small graph's in place (`builds_inline`)."""
        if self.builds_inline():
            return self.get(placement, fused)
        fused = fused and self.max_fused > 1
        hit = self._lookup(placement, fused)
        if hit is not None:
            return hit
        key = (id(placement), fused)
        building = self._building.get(key)
        if building is not None:  # another caller builds it: wait, then look again
            await building.wait()
            return await self.aget(placement, fused)
        building = self._building[key] = anyio.Event()
        try:
            # anyio's thread call on every backend (asyncio, uvloop, trio); a cancelled
            # caller waits for the build (milliseconds) and the next miss builds again
            schedule = await anyio.to_thread.run_sync(self._builder(placement, fused, True))
            self._add(placement, fused, schedule)
            return schedule
        finally:
            del self._building[key]
            building.set()

    def _lookup(self, placement: tuple[Placement, ...], fused: bool) -> Schedule | None:
        key = (id(placement), fused)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is placement:
            self._cache.move_to_end(key)
            self._hot = (placement, fused, hit[1])
            return hit[1]
        return None

    def _builder(
        self, placement: tuple[Placement, ...], fused: bool, on_thread: bool = False
    ) -> Callable[[], Schedule]:
        """The build of a missing schedule, its inputs taken now (on the caller's thread): if
        `decided(placement)` knows the placement, its heavy nodes become units of their own
        and its measured times give the units' priorities and expected times (else the
        kernels' estimates rank them). What it reads later (graph, plan, kernels) is
        immutable, so it may run on another thread."""
        unfusable = self.unfusable
        decision = self.decided(placement) if self.decided is not None else None
        if decision is not None:
            solo = decision.heavy
            unfusable = [a or b for a, b in zip(solo, unfusable or solo, strict=True)]
        return functools.partial(
            build_schedule,
            self.graph, self.plan, self.kernels, placement, self.max_fused if fused else 1,
            unfusable, decision.best_us if decision is not None else self.estimated_costs,
            measured=decision is not None, yield_gil=on_thread, stream_plan=self.stream_plan,
            segments=self.segments if fused else None, any_thread=self.any_thread,
        )

    def _add(self, placement: tuple[Placement, ...], fused: bool, schedule: Schedule) -> None:
        key = (id(placement), fused)
        self._cache[key] = (placement, schedule)
        self._cache.move_to_end(key)
        self._hot = (placement, fused, schedule)
        self._built += 1
        if len(self._cache) > self.max_schedules:
            _, (_, evicted) = self._cache.popitem(last=False)
            if evicted is schedule:  # a cache of no entries: nothing is hot either
                self._hot = None

    def statistics(self) -> ScheduleStatistics:
        schedules = [s for _, s in self._cache.values()]
        return ScheduleStatistics(
            schedules=len(schedules),
            built=self._built,
            fused_units=sum(sum(1 for n in s.nodes if len(n) > 1) for s in schedules),
            fused_nodes=sum(sum(len(n) for n in s.nodes if len(n) > 1) for s in schedules),
        )


def build_schedule(
    graph: Graph,
    plan: ExecutionPlan,
    kernels: Sequence[OpKernel],
    placement: tuple[Placement, ...],
    max_fused: int,
    unfusable: Sequence[bool] | None = None,
    costs: Sequence[float] | None = None,
    measured: bool = False,
    yield_gil: bool = False,
    stream_plan: DeviceRuns | None = None,
    segments: AtomicGroups | None = None,
    any_thread: Sequence[bool] | None = None,
) -> Schedule:
    """Group nodes into units (see the module docstring) and derive the unit graph.

    `unfusable[i]`: node i must be a unit of its own even when it is inline; `costs[i]`: node
    i's cost, for the units' priorities (default 1 each); `measured`: the costs are measured
    times in microseconds, which also give each unit's expected time (`Schedule.seconds`);
    `yield_gil`: built on a thread beside the event loop, which gets the GIL after each
    compiled unit; `stream_plan`: fuse consecutive CUDA nodes on one stream (CUDA runs,
    compiled as `unit(v, g, s)` for `FrameStreams.run_unit`); `segments`: each segment one
    unit (the module docstring; fused schedules only); `any_thread[i]`: node i may leave the
    loop thread (adaptive placement), for the straight-line form (`straight_line`).
    """
    keys = _stream_keys(plan, placement, stream_plan, unfusable)
    segment_of = segments.group_of if segments is not None and max_fused > 1 else {}
    order = segments.order if segment_of and segments is not None else range(plan.num_nodes)
    runs = _runs(plan, placement, max_fused, unfusable, keys, order, segment_of)
    unit_of = [0] * plan.num_nodes
    for u, run in enumerate(runs):
        for node in run:
            unit_of[node] = u

    calls: list[Callable[[list[Any]], Any]] = []
    stores: list[int] = []
    frees: list[tuple[int, ...]] = []
    users: list[list[int]] = []
    producers: list[set[int]] = []
    for u, run in enumerate(runs):
        if run[0] in segment_of:
            calls.append(_segment_placeholder(segment_of[run[0]]))
            stores.append(-1)
            members = set(run)
            local = {
                plan.outputs[n] for n in run
                if not plan.retained[n] and all(user in members for user in plan.users[n])
            }
            frees.append(tuple(v for n in run for v in plan.frees[n] if v not in local))
        elif len(run) == 1:
            node = run[0]
            calls.append(plan.calls[node])
            stores.append(plan.outputs[node] if plan.keep_output[node] else -1)
            frees.append(plan.frees[node])
        else:
            members = set(run)
            # Values the frame must hold: outputs, or read by another unit.
            escaping = {
                plan.outputs[n] for n in run
                if plan.keep_output[n]
                and (plan.retained[n] or any(user not in members for user in plan.users[n]))
            }
            reads = Counter(v for n in run for v in plan.frees[n])
            # Values from outside that only this run reads: cleared at their last read.
            owned = {
                v for v, k in reads.items()
                if k == plan.read_counts[v] and graph.values[v].producer not in members
            }
            # a CUDA run: only they start with a DEVICE node and have more than one
            cuda = stream_plan if placement[run[0]] is Placement.DEVICE else None
            calls.append(_compile_run(graph, plan, kernels, run, escaping, owned, u, cuda))
            if yield_gil:
                time.sleep(0)  # releases the GIL: a waiting thread takes it now
            stores.append(-1)
            local = {plan.outputs[n] for n in run} - escaping
            frees.append(tuple(
                v for n in run for v in plan.frees[n] if v not in local and v not in owned
            ))
        unit_users: list[int] = []
        for n in run:
            for user in plan.users[n]:
                uu = unit_of[user]
                if uu != u and uu not in unit_users:
                    unit_users.append(uu)
        users.append(unit_users)
        producers.append({
            unit_of[producer]
            for n in run for v in graph.nodes[n].inputs()
            if (producer := graph.values[v].producer) is not None
        } - {u})

    counts = tuple(len(p) for p in producers)
    # Units are in topological order (runs are consecutive nodes): users come later.
    own = [sum(costs[n] for n in run) if costs is not None else float(len(run)) for run in runs]
    priority = [0.0] * len(runs)
    for u in reversed(range(len(runs))):
        priority[u] = own[u] + max((priority[user] for user in users[u]), default=0.0)
    schedule = Schedule(
        placement=placement,
        calls=tuple(calls),
        stores=tuple(stores),
        nodes=tuple(tuple(r) for r in runs),
        where=tuple(
            Placement.DEVICE if r[0] in segment_of else placement[r[0]] for r in runs
        ),
        users_reversed=tuple(tuple(reversed(us)) for us in users),
        producer_counts=counts,
        roots=tuple(u for u, c in enumerate(counts) if c == 0),
        frees=tuple(frees),
        priority=tuple(priority),
        seconds=tuple(c / 1e6 for c in own) if measured and costs is not None else None,
        fused=max_fused > 1,
        segments=tuple(segment_of.get(r[0], -1) for r in runs) if segment_of else (),
    )
    return dataclasses.replace(schedule, straight=straight_line(schedule, any_thread))


def straight_line(
    schedule: Schedule, any_thread: Sequence[bool] | None = None
) -> StraightLine | None:
    """The straight-line form of `schedule`, or None when it has a unit that does not run
    inline, no measured times, or units out of topological order. `any_thread`: per node
    of the graph, whether it may leave the loop thread (None: none may)."""
    if schedule.seconds is None or any(w is not Placement.INLINE for w in schedule.where):
        return None
    for unit, users in enumerate(schedule.users_reversed):
        if any(user <= unit for user in users):
            return None  # unit order is not a topological order: keep the dataflow
    last_reader: dict[int, int] = {}
    for unit, frees in enumerate(schedule.frees):
        for value in frees:
            last_reader[value] = unit
    drops: list[list[int]] = [[] for _ in schedule.calls]
    for value, unit in last_reader.items():
        drops[unit].append(value)
    seconds = sum(schedule.seconds)
    nodes = [node for unit_nodes in schedule.nodes for node in unit_nodes]
    return StraightLine(
        tuple(tuple(d) for d in drops), seconds, schedule.seconds,
        seconds / max(len(nodes), 1),
        any_thread is not None and all(any_thread[node] for node in nodes),
        tuple(range(len(schedule.calls) - 1, -1, -1)),
    )


def _segment_placeholder(segment: int) -> Callable[[list[Any]], Any]:
    """A segment unit's schedule call: the frame's GPU tables replace it (frame.py)."""

    def segment_unit(values: list[Any]) -> Any:
        raise RuntimeError(
            f"segment {segment} runs through the frame's GPU tables (cuda/graphs.py), "
            "but the frame has no GPU state"
        )

    return segment_unit


def _stream_keys(
    plan: ExecutionPlan,
    placement: tuple[Placement, ...],
    stream_plan: DeviceRuns | None,
    unfusable: Sequence[bool] | None,
) -> list[RunKey | None]:
    """Per node: its (device, stream) when it may join a CUDA run, else None; `ALIAS_KEY`
    for an inline alias (getitem, tuple packing), which joins the CUDA run it follows: it
    runs on the host in nanoseconds and would otherwise split runs after every tuple op."""
    keys: list[RunKey | None] = [None] * plan.num_nodes
    if stream_plan is None:
        return keys
    for i, p in enumerate(placement):
        if unfusable is not None and unfusable[i]:
            continue
        keys[i] = stream_plan.run_key(i, p)  # (device, stream) of a CUDA node on a stream
    return keys


def _runs(
    plan: ExecutionPlan,
    placement: tuple[Placement, ...],
    max_fused: int,
    unfusable: Sequence[bool] | None,
    keys: Sequence[RunKey | None],
    order: Sequence[int] | None = None,
    segment_of: dict[int, int] | None = None,
) -> list[list[int]]:
    """Consecutive inline nodes, or consecutive CUDA nodes on one stream (`keys`), up to
    `max_fused` each; every other node alone. An inline run ends after a node feeding a node
    outside inline runs; a CUDA run ends where the next node is not on its stream. The nodes
    of a segment (`segment_of`, contiguous in `order`) form one run, of any length."""
    segment_of = segment_of or {}
    alone = [
        p is not Placement.INLINE or (unfusable is not None and unfusable[i]) or i in segment_of
        for i, p in enumerate(placement)
    ]
    runs: list[list[int]] = []
    current: list[int] = []
    current_key: RunKey | None = None  # the stream of `current`, None for an inline run

    def flush() -> None:
        nonlocal current, current_key
        if current:
            runs.append(current)
            current = []
        current_key = None

    members: dict[int, list[int]] = {}  # per segment: its nodes, in order
    for node, s in segment_of.items():
        members.setdefault(s, []).append(node)
    for node in order if order is not None else range(plan.num_nodes):
        s = segment_of.get(node, -1)
        if s >= 0:
            if node == members[s][0]:  # contiguous in `order`: the whole segment here
                flush()
                runs.append(members[s])
            continue
        key = keys[node]
        if key == ALIAS_KEY:
            if current_key is not None and len(current) < max_fused:
                current.append(node)  # continues the CUDA run on its stream
                continue
            key = None  # an inline node like any other
        if key is not None and max_fused > 1:
            if not current or current_key != key or len(current) >= max_fused:
                flush()
            current_key = key
            current.append(node)
            continue
        if alone[node]:
            flush()
            runs.append([node])
            continue
        if current_key is not None:
            flush()
        current.append(node)
        feeds_elsewhere = any(alone[u] for u in plan.users[node])
        if feeds_elsewhere or len(current) >= max_fused:
            flush()
    flush()
    return runs


def _compile_run(
    graph: Graph,
    plan: ExecutionPlan,
    kernels: Sequence[OpKernel],
    run: list[int],
    escaping: set[int],
    owned: set[int],
    unit: int,
    cuda: DeviceRuns | None = None,
) -> Callable[[list[Any]], Any]:
    """One function running `run` in order: locals for its own values, `del` after last use.

    Values in `escaping` are also stored in the frame (`v[id] = t<id> = ...`); frame slots in
    `owned` are read by this run only and cleared after its last read. Each node's call is on
    its own line, so a failing kernel is found from the traceback's line number.

    With `cuda` (a CUDA run), the function is `unit(v, g, s)`: `g` the frame's Device, `s`
    the run's stream, current while it runs (cuda/device.py's `FrameStreams.run_unit`).
    Around a node's kernel it runs the statements the device gives (`DeviceRuns.before_node`,
    `after_node`: cuda/streams.py's waits, fences, recorded values and events).
    """
    namespace: dict[str, Any] = {}
    produced = {plan.outputs[n] for n in run}
    last_read: dict[int, int] = {}
    for position, node in enumerate(run):
        for v in graph.nodes[node].inputs():
            if v in produced or v in owned:
                last_read[v] = position

    def name(ref: Ref) -> str:
        return f"t{ref.id}" if ref.id in produced else f"v[{ref.id}]"

    body: list[str] = []
    node_lines: dict[int, int] = {}
    for position, node in enumerate(run):
        n = graph.nodes[node]
        fn = f"f{node}"
        namespace[fn] = kernels[node].fn
        out = plan.outputs[node]
        target = f"v[{out}] = " if out in escaping else ""
        if out in last_read:
            target += f"t{out} = "  # unbound when no later node of the run reads it
        if cuda is not None:
            body.extend(f"    {line}" for line in cuda.before_node(node))
        node_lines[len(body) + 2] = node  # line 1 is the def
        body.append(f"    {target}{fn}({emit_args(n, namespace, name)})")
        if cuda is not None:
            after = cuda.after_node(node, lambda producer: name(Ref(plan.outputs[producer])))
            body.extend(f"    {line}" for line in after)
        dead = sorted(v for v, p in last_read.items() if p == position)
        if locals_ := [f"t{v}" for v in dead if v in produced]:
            body.append(f"    del {', '.join(locals_)}")
        for v in dead:
            if v in owned:
                body.append(f"    v[{v}] = None")
    params = "v, g, s" if cuda is not None else "v"
    source = f"def unit{unit}({params}):\n" + "\n".join(body) + "\n"
    code = compile(source, f"<asyncgraph unit {unit}: nodes {run[0]}..{run[-1]}>", "exec")
    exec(code, namespace)
    fn_obj: types.FunctionType = namespace[f"unit{unit}"]
    fn_obj.node_lines = node_lines  # type: ignore[attr-defined]
    return fn_obj
