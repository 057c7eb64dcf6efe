"""AdaptivePlacement: decide inline versus worker from measured node times.

The plan's first placement comes from estimated cost (kernels/cost.py). Estimates miss: a
"large" matmul may take 20 us, a "small" op may be slow. As TensorFlow's executor marks kernels
expensive by measured time, and torch.jit's profiling executor specialises after profiled runs,
after one warm-up execution, the next `profile_executions` executions for each input-shape
signature time every node (thread CPU time); no more than that many run profiled at once, so
a burst's other executions run the base placement on its fused schedule meanwhile. Then a
node goes to a worker thread when a hop buys something:

- it is heavy (best time >= `heavy_node_us`) and another heavy node is independent of it
  (neither its ancestor nor its descendant), so the two can overlap on two cores; or
- it alone would take longer than the loop's time slice (`loop_slice_us`), so running it
  inline would stall every other task on the loop.

Everything else runs inline: a heavy node on the graph's serial spine gains nothing from a
worker but the hop's latency (a transformer's feed-forward matmuls, one after another). While
executions overlap on a busy loop, a second placement applies, with every node of at least
`loaded_heavy_node_us` on a worker: there the spine of one execution overlaps the others'. The
bar is higher there because a worker needs the GIL, held by the busy loop, to start and finish
each node; ~60 us matmuls lost more waiting than they gained. Light nodes always stay on the
loop: they are mostly Python dispatch, which holds the GIL wherever it runs, and moving them to
threads only adds contention. A new input-shape
signature is profiled afresh. Only CPU kernels without an explicit placement hint move; async,
prim and CUDA nodes keep their places.

A heavy node that stays inline also runs as a unit of its own rather than fused with its
neighbours (`Decision.heavy`): the loop's budget is checked between units, and a fused run of
several heavy nodes (a batch of 32 rows through an encoder) would hold the loop for
milliseconds.

The first decision comes early, from executions that may still be warming up (an AOTInductor
segment took 3.2, 1.6 then 0.6 ms over its first calls): a node near a bar can land on the wrong
side of it. So each signature is profiled again, with its decided placement, `recheck_after`
executions after the decision, then after twice and four times as many (`RECHECKS` rounds in
all), and decided again each time from the best times of every round so far. The best times
only fall, so a revision only ever moves a node inline. Spaced out, the rounds catch a slow
warm-up without a long wait for a fast one: tiny BERT's compiled segment settled after 10-30
calls; with a single recheck 100 executions late it paid a worker hop per call until then
(0.57-0.82 ms per execution instead of 0.45-0.48).

State: one entry per shape signature (at most `max_signatures`, oldest evicted), holding the
best node times of the profiled runs and, once decided, the placement tuple.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncgraph.graph.ir import Graph
from asyncgraph.kernels import KernelKind, OpKernel
from asyncgraph.runtime.plan import ExecutionPlan, Placement

ShapeKey = tuple[Any, ...]
RECHECKS = 3  # recheck rounds per signature, `recheck_after` x 1, 2, 4 executions apart
_MAX_BY_SIGNATURE = 256  # signatures remembered (scalar inputs make one per value)


@dataclass(frozen=True, slots=True)
class PlacementStatistics:
    signatures: int
    decided: int
    profiling_runs: int
    rechecked: int  # recheck rounds decided (up to RECHECKS per signature)
    revised: int  # of those, the ones that changed the placement
    moved_inline: int
    moved_to_worker: int
    # The bars in use (ExecutorConfig's heavy_node_us, loaded_heavy_node_us, loop_slice_s
    # in us, worker_execution_node_us; None: off), as the module docstring uses them.
    heavy_node_us: float = 80.0
    loaded_heavy_node_us: float = 250.0
    loop_slice_us: float = 1000.0
    worker_execution_node_us: float | None = None
    recheck_after: int = 20  # executions from a decision to its first recheck round; 0: none
    # The nodes that the decision behind the most recently chosen placement measured heavy
    # (best time >= heavy_node_us), by name: each runs as a unit of its own (Decision.heavy).
    # Empty while that placement is not a decided one (warm-up, profiling).
    heavy_nodes: tuple[str, ...] = ()


class NodeTimes:
    """The best (lowest) wall time of each node over the profiled runs, in ns.

    The minimum, not the mean: the first call of an op pays one-off dispatch costs, and a
    loaded machine adds noise that only ever makes a node look slower.
    """

    __slots__ = ("best_ns", "key", "runs")

    def __init__(self, num_nodes: int, key: ShapeKey = ()) -> None:
        self.best_ns = [1 << 62] * num_nodes
        self.runs = 0
        self.key = key  # the shape key of the entry they time (AdaptivePlacement.finished)

    def add(self, node: int, ns: int) -> None:
        if ns < self.best_ns[node]:
            self.best_ns[node] = ns

    def best_us(self) -> list[float]:
        return [t / 1000 if t != 1 << 62 else 0.0 for t in self.best_ns]


@dataclass(frozen=True, slots=True)
class Decision:
    """What a decided placement was decided from, for the schedule built for it: the heavy
    nodes run as units of their own (the loop budget can yield between them), and the
    measured times rank the units for the workers and tell whether a unit fits the slice."""

    placement: tuple[Placement, ...]
    heavy: tuple[bool, ...]  # per node: best time >= heavy_node_us
    best_us: tuple[float, ...]  # per node: the best profiled time


class _Entry:
    __slots__ = ("calls", "loaded", "placement", "profiling", "recheck_in", "rechecks", "times")

    def __init__(self, num_nodes: int, key: ShapeKey) -> None:
        self.times = NodeTimes(num_nodes, key)
        self.placement: tuple[Placement, ...] | None = None  # for a quiet loop
        self.loaded: tuple[Placement, ...] | None = None  # while executions overlap
        self.calls = 0
        self.profiling = 0  # profiled executions in flight (at most profile_executions)
        # once decided: executions left before the next recheck round; 0 while it runs; -1
        # once the last has run
        self.recheck_in = 0
        self.rechecks = 0  # recheck rounds decided


class AdaptivePlacement:
    """Chooses the placement each execution runs with (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        kernels: Sequence[OpKernel],
        *,
        profile_executions: int = 3,
        heavy_node_us: float = 80.0,
        loaded_heavy_node_us: float = 250.0,
        loop_slice_us: float = 1000.0,
        worker_execution_node_us: float | None = None,
        recheck_after: int = 20,
        max_signatures: int = 16,
        key: Callable[[Sequence[Any]], ShapeKey] | None = None,
    ) -> None:
        self.base = plan.placement
        self.users = plan.users
        self.names = tuple(n.name for n in graph.nodes)
        self.profile_executions = profile_executions
        self.heavy_node_us = heavy_node_us
        self.loaded_heavy_node_us = loaded_heavy_node_us
        self.loop_slice_us = loop_slice_us
        self.worker_execution_node_us = worker_execution_node_us
        self.recheck_after = recheck_after
        self.max_signatures = max_signatures
        self.key = key if key is not None else shape_key
        # the same key from an input Signature (validation.py), without the inputs
        self.signature_key = _SIGNATURE_KEYS.get(self.key)
        self.movable = tuple(  # a compiled segment (DELEGATE) is placed like any CPU kernel
            k.kind in (KernelKind.CPU, KernelKind.DELEGATE) and n.placement_hint is None
            for n, k in zip(graph.nodes, kernels, strict=True)
        )
        self.any_thread = tuple(  # may run on any thread: a straight line may go to a worker
            movable or (k.kind is KernelKind.PRIM and n.placement_hint is None)
            for movable, n, k in zip(self.movable, graph.nodes, kernels, strict=True)
        )
        self._entries: OrderedDict[ShapeKey, _Entry] = OrderedDict()
        # An input Signature (validation.py) -> its entry: `key` is a function of the
        # signature, so a call with a signature seen before skips computing its key.
        self._by_signature: dict[tuple[Any, ...], _Entry] = {}
        self._hot: tuple[tuple[Any, ...] | None, _Entry | None] = (None, None)  # the last one
        # id(decided placement) -> what decided it: see decision()
        self._decided: dict[int, Decision] = {}
        self._last: tuple[Placement, ...] = plan.placement
        self._profiling_runs = 0
        self._rechecked = 0
        self._revised = 0

    def choose(
        self,
        inputs: Sequence[Any] | None,
        loaded: bool = False,
        signature: tuple[Any, ...] | None = None,
    ) -> tuple[tuple[Placement, ...], NodeTimes | None]:
        """The placement for an execution on `inputs`, and where to record its node times
        (None once the placement for this shape signature is decided). `loaded`: other
        executions are in flight and the loop is busy (Scheduler.loaded). `signature`: the
        inputs' Signature (InputValidator.check), when known: the entry is then found by
        it, the same entry `key` finds, and the inputs are not needed (None)."""
        hot_signature, hot_entry = self._hot
        if signature is not None and signature is hot_signature:
            entry = hot_entry  # validation hands a repeat caller the same object: no hashing
        elif signature is None:
            assert inputs is not None, "choose needs the inputs or their signature"
            entry = self._entry(self.key(inputs))
        else:
            hit = self._by_signature.get(signature)
            if hit is None:
                if len(self._by_signature) >= _MAX_BY_SIGNATURE:
                    self._by_signature.clear()
                hit = self._by_signature[signature] = self._entry(self._key(inputs, signature))
            entry = hit
            self._hot = (signature, entry)
        assert entry is not None
        if entry.placement is not None and entry.loaded is not None:
            chosen = entry.loaded if loaded else entry.placement
            self._last = chosen
            if entry.recheck_in:  # counting down, or rechecked (-1)
                if entry.recheck_in > 0:
                    entry.recheck_in -= 1
                return chosen, None
            return chosen, self._profiled(entry)  # the recheck round, decided placement
        entry.calls += 1
        if entry.calls == 1:
            return self.base, None  # a warm-up: first calls pay one-off costs per op and thread
        return self.base, self._profiled(entry)

    def settled(
        self, signature: tuple[Any, ...]
    ) -> tuple[tuple[Placement, ...], tuple[Placement, ...]] | None:
        """The placements decided for the inputs of `signature` (InputValidator.check's),
        alone and under load; None while it is unseen or profiled. Rechecks may move nodes
        inline later, never off the loop (the module docstring)."""
        entry = self._by_signature.get(signature)
        if entry is None or entry.placement is None or entry.loaded is None:
            return None
        return entry.placement, entry.loaded

    def _profiled(self, entry: _Entry) -> NodeTimes | None:
        """The entry's times for an execution to record, or None (it runs unprofiled, on
        the fused schedule) while `profile_executions` profiled ones are in flight already.

        Why: a burst of 64 callers on a new signature made every one of them a profiled run
        (node by node, on the dataflow), though only the first few are needed: the loop's
        first round ran 64 executions' per-node Python, beside workers running theirs."""
        if entry.profiling >= self.profile_executions:
            return None
        entry.profiling += 1
        self._profiling_runs += 1
        return entry.times

    def abandoned(self, times: NodeTimes) -> None:
        """A profiled execution that failed or was cancelled: its place among the profiled
        ones in flight is free again; nothing it recorded decides anything yet."""
        entry = self._entries.get(times.key)
        if entry is not None and entry.times is times and entry.profiling:
            entry.profiling -= 1

    def _entry(self, key: ShapeKey) -> _Entry:
        """The entry of a shape key, made on first sight (the oldest evicted past
        `max_signatures`)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(len(self.base), key)
            if len(self._entries) > self.max_signatures:
                _, evicted = self._entries.popitem(last=False)
                for placement in (evicted.placement, evicted.loaded):
                    self._decided.pop(id(placement), None)
                self._by_signature.clear()  # some of its signatures led to the evicted one
                self._hot = (None, None)
        return entry

    def _key(self, inputs: Sequence[Any] | None, signature: tuple[Any, ...]) -> ShapeKey:
        if self.signature_key is not None:
            return self.signature_key(signature)
        assert inputs is not None, f"{self.key.__name__} needs the inputs"
        return self.key(inputs)

    def finished(self, times: NodeTimes) -> None:
        """Account a profiled execution (its `times`, which name their entry); decide the
        placement after enough of them, and decide it again after each recheck round."""
        times.runs += 1
        entry = self._entries.get(times.key)
        if entry is None or entry.times is not times:
            return
        if entry.profiling:
            entry.profiling -= 1
        if entry.placement is None:
            if times.runs >= self.profile_executions:
                self._decide(entry)
                entry.recheck_in = self._next_recheck(entry)
        elif entry.recheck_in == 0 and times.runs >= (entry.rechecks + 2) * self.profile_executions:
            before = (entry.placement, entry.loaded)
            self._decide(entry)
            entry.rechecks += 1
            entry.recheck_in = self._next_recheck(entry)
            self._rechecked += 1
            self._revised += (entry.placement, entry.loaded) != before

    def _next_recheck(self, entry: _Entry) -> int:
        """Executions until the entry's next recheck round; -1 when none is left."""
        if self.recheck_after <= 0 or entry.rechecks >= RECHECKS:
            return -1
        return self.recheck_after << entry.rechecks

    def _decide(self, entry: _Entry) -> None:
        """Place the entry's signature from its best times. Each decision makes new placement
        objects, so the schedules built for them use the times it was made from."""
        best = entry.times.best_us()
        heavy = tuple(us >= self.heavy_node_us for us in best)
        for previous in (entry.placement, entry.loaded):
            if previous is not None:
                self._decided.pop(id(previous), None)
        entry.placement = self.decide(best)
        if self._runs_whole_on_worker(best):  # one hop per execution, not one per node
            inline = self.decide(best, whole_line=True)
            entry.loaded = entry.placement if inline == entry.placement else inline
        else:
            entry.loaded = self.decide(best, loaded=True)
        for placement in (entry.placement, entry.loaded):
            self._decided[id(placement)] = Decision(placement, heavy, tuple(best))
        self._last = entry.placement

    def decision(self, placement: tuple[Placement, ...]) -> Decision | None:
        """What `placement` was decided from; None for a placement not decided here."""
        hit = self._decided.get(id(placement))
        return hit if hit is not None and hit.placement is placement else None

    def decide(
        self, best_us: Sequence[float], loaded: bool = False, whole_line: bool = False
    ) -> tuple[Placement, ...]:
        """Worker for movable nodes that can overlap another heavy node or would overrun the
        loop's slice; inline for the rest (see the module docstring). `loaded`: for a loop
        shared by overlapping executions, where every heavy node overlaps something.
        `whole_line`: every movable node inline (`_runs_whole_on_worker`)."""
        placement = list(self.base)
        if whole_line:
            return tuple(
                Placement.INLINE if movable else where
                for movable, where in zip(self.movable, placement, strict=True)
            )
        bar = self.loaded_heavy_node_us if loaded else self.heavy_node_us
        heavy = [us >= bar for us in best_us]
        alone = [False] * len(heavy) if loaded else self._without_heavy_peer(heavy)
        for node, us in enumerate(best_us):
            if self.movable[node]:
                worker = heavy[node] and (not alone[node] or us >= self.loop_slice_us)
                placement[node] = Placement.WORKER if worker else Placement.INLINE
        return tuple(placement)

    def _runs_whole_on_worker(self, best_us: Sequence[float]) -> bool:
        """Whether an execution overlapping others, all inline, would run its straight line on
        a worker thread (StraightRunner: its nodes over `worker_execution_node_us` on
        average, every one free to leave the loop; a line shorter than a slice leaves when
        others wait on the loop). Then the placement for a loaded loop keeps every node
        inline: the whole line leaves the loop in one hop, where sending its heavy nodes to
        workers would take a hop for each, the dataflow's bookkeeping on the loop, and no
        straight line.

        Lines shorter than a slice count too: a compiled segment of a fraction of a
        millisecond under many unbatched callers served more requests/s this way than placed
        on a worker, where the loop spent the dataflow's Python on each request
        (benchmarks/results/cpu/design_measurements.md#whole-line-on-a-worker)."""
        bar = self.worker_execution_node_us
        return bar is not None and sum(best_us) >= bar * len(best_us) and all(self.any_thread)

    def _without_heavy_peer(self, heavy: Sequence[bool]) -> list[bool]:
        """For each heavy node: whether every other heavy node is its ancestor or descendant.

        Reachability as bitsets (Python ints) over the topological order: O(nodes x edges)
        word operations, computed once per decided shape signature.
        """
        n = len(heavy)
        heavy_bits = sum(1 << i for i in range(n) if heavy[i])
        ancestors = [0] * n
        for node in range(n):  # node order is topological: producers come first
            for user in self.users[node]:
                ancestors[user] |= ancestors[node] | (1 << node)
        descendants = [0] * n
        for node in reversed(range(n)):
            for user in self.users[node]:
                descendants[node] |= descendants[user] | (1 << user)
        return [
            heavy[i]
            and not heavy_bits & ~(ancestors[i] | descendants[i] | (1 << i))
            for i in range(n)
        ]

    @property
    def current(self) -> tuple[Placement, ...]:
        """The placement chosen most recently."""
        return self._last

    def statistics(self) -> PlacementStatistics:
        decided = [e.placement for e in self._entries.values() if e.placement is not None]
        last = self._last
        decision = self.decision(last)
        heavy = decision.heavy if decision is not None else ()
        return PlacementStatistics(
            signatures=len(self._entries),
            decided=len(decided),
            profiling_runs=self._profiling_runs,
            rechecked=self._rechecked,
            revised=self._revised,
            moved_inline=sum(
                1 for b, p in zip(self.base, last, strict=True)
                if b is Placement.WORKER and p is Placement.INLINE
            ),
            moved_to_worker=sum(
                1 for b, p in zip(self.base, last, strict=True)
                if b is Placement.INLINE and p is Placement.WORKER
            ),
            heavy_node_us=self.heavy_node_us,
            loaded_heavy_node_us=self.loaded_heavy_node_us,
            loop_slice_us=self.loop_slice_us,
            worker_execution_node_us=self.worker_execution_node_us,
            recheck_after=self.recheck_after,
            heavy_nodes=tuple(name for name, h in zip(self.names, heavy, strict=False) if h),
        )


def shape_key(inputs: Sequence[Any]) -> ShapeKey:
    """The shapes (and dtypes) of tensor inputs; other inputs only by type."""
    return tuple(
        (x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in inputs
    )


def _bucket(rows: int) -> int:
    return 1 << (max(rows, 1) - 1).bit_length()


def batch_bucket_key(inputs: Sequence[Any]) -> ShapeKey:
    """shape_key with dim 0 rounded up to a power of two, for batched executions: a batch
    of 23 rows runs with the placement profiled for 32, so batch sizes that vary with load
    share a few profiled signatures instead of re-profiling (and evicting) one per size."""
    return tuple(
        ((_bucket(x.shape[0]), *x.shape[1:]), x.dtype)
        if isinstance(x, torch.Tensor) and x.dim() > 0
        else type(x)
        for x in inputs
    )


# A Signature's part per input (validation.py): (type, shape, dtype, device) of a tensor,
# (type, value) of a plain scalar; the keys below are those of the inputs it describes.


def _is_tensor(part: tuple[Any, ...]) -> bool:
    return len(part) == 4 and issubclass(part[0], torch.Tensor)


def signature_shape_key(signature: tuple[Any, ...]) -> ShapeKey:
    """shape_key of the inputs `signature` describes."""
    return tuple((p[1], p[2]) if _is_tensor(p) else p[0] for p in signature)


def signature_bucket_key(signature: tuple[Any, ...]) -> ShapeKey:
    """batch_bucket_key of the inputs `signature` describes."""
    return tuple(
        ((_bucket(p[1][0]), *p[1][1:]), p[2]) if _is_tensor(p) and len(p[1]) > 0 else p[0]
        for p in signature
    )


_SIGNATURE_KEYS: dict[Callable[..., ShapeKey], Callable[..., ShapeKey]] = {
    shape_key: signature_shape_key, batch_bucket_key: signature_bucket_key,
}
