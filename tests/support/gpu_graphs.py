"""Builder graphs for the simulated GPU (support/fake_gpu.py's `Sim`): `gpu*` nodes are CUDA
kernels (with `CudaNodes`), the others CPU nodes that read GPU values; `reference` computes a
graph's outputs from the node functions alone.

Used by tests/integration/test_gpu_executor.py and test_trio_gpu.py.
"""

from __future__ import annotations

from typing import Any

from asyncgraph import GraphBuilder
from asyncgraph.graph.ir import Graph, Ref
from tests.support.fake_gpu import Sim


def reference(graph: Graph, *inputs: Any) -> list[Any]:
    """The graph's flat outputs computed directly from the node functions' host halves."""
    env: dict[int, Any] = {}
    for spec, value in zip(graph.signature.inputs, inputs, strict=True):
        env[spec.value] = value
    for node in graph.nodes:
        args = [env[a.id] if isinstance(a, Ref) else a for a in node.args]
        env[node.output] = node.target.raw(*args)
    return [env[o.arg.id] for o in graph.signature.outputs]


def index(graph: Graph, name: str) -> int:
    return graph.node(name).index


def add(*xs: int) -> int:
    return sum(xs)


def double(x: int) -> int:
    return 2 * x


def add_one(x: int) -> int:
    return x + 1


def times_ten(x: int) -> int:
    return 10 * x


def diamond(sim: Sim) -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    src = b.call(sim.kernel(add_one), x, name="gpu_src")
    left = b.call(sim.kernel(double), src, name="gpu_left")
    right = b.call(sim.kernel(add_one), src, name="gpu_right")
    b.output(b.call(sim.kernel(add), left, right, name="gpu_join"))
    return b.build()


def wide(sim: Sim, width: int = 6, depth: int = 3) -> Graph:
    """`width` chains of CUDA nodes joined by one; a CPU node reads a chain's GPU value (a
    host wait) and a worker node turns its result back into a GPU tensor that a CUDA node
    reads (a fence on the host's streams)."""
    b = GraphBuilder()
    x = b.input("x")
    tails = []
    for k in range(width):
        v = x
        for d in range(depth):
            v = b.call(sim.kernel(add), v, k + d, name=f"gpu_b{k}_{d}")
        tails.append(v)
    read = b.call(sim.host(times_ten), tails[0], name="host_read", placement="inline")
    made = b.call(sim.host(add_one, True), read, name="host_make", placement="worker")
    mixed = b.call(sim.kernel(add), made, tails[1], name="gpu_mix")
    b.output((b.call(sim.kernel(add), *tails, mixed, name="gpu_total"), read))
    return b.build()


def chain(sim: Sim, length: int = 4) -> Graph:
    b = GraphBuilder()
    v = b.input("x")
    for i in range(length):
        v = b.call(sim.kernel(add_one), v, name=f"gpu_{i}")
    b.output(v)
    return b.build()


def host_reader_graph(sim: Sim, placement: str) -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    g = b.call(sim.kernel(double), x, name="gpu_double")
    if placement == "task":
        h = b.call(sim.host_async(add_one), g, name="host_add")
    else:
        h = b.call(sim.host(add_one), g, name="host_add", placement=placement)
    b.output(h)
    return b.build()
