"""The stream plan (asyncgraph/cuda/streams.py), pure: no GPU, no runtime.

`plan_streams` on hand-written graphs: chains, forks, diamonds, wide graphs, mixed CPU/GPU,
aliases and metadata, outputs, several devices, and the transitive reduction of waits;
`stream_plan_for` from a Graph and its ExecutionPlan; `node_role` of aten's prim ops.

The cuda layer that runs a plan, on a simulated GPU and on real GPUs:
tests/integration/test_streams.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from asyncgraph.cuda.streams import Role, node_role, plan_streams, stream_plan_for
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import ScalarSpec
from asyncgraph.kernels import KernelFactory
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.plan import ExecutionPlan, Placement, build_plan

C, A, M, S, H = Role.CUDA, Role.ALIAS, Role.META, Role.SCALAR, Role.HOST


def chain_producers(n: int) -> list[list[int]]:
    return [[]] + [[i - 1] for i in range(1, n)]


# =============================================================================================
# 1. The pure plan
# =============================================================================================


def test_chain_stays_on_one_stream_without_events() -> None:
    plan = plan_streams(chain_producers(6), [C] * 6, 4, outputs=[5])
    assert plan.stream == (0,) * 6
    assert plan.waits == ((),) * 6
    assert plan.record_stream == ((),) * 6
    assert plan.output_waits == (5,)
    assert plan.records_event == (False,) * 5 + (True,)
    assert plan.streams_used == ((0, 0),)


def test_fork_puts_the_second_branch_on_a_new_stream() -> None:
    # 0 -> 1, 0 -> 2
    plan = plan_streams([[], [0], [0]], [C, C, C], 2)
    assert plan.stream == (0, 0, 1)
    assert plan.waits == ((), (), (0,))
    assert plan.record_stream == ((), (), (0,))
    assert plan.records_event == (True, False, False)


def test_diamond_joins_with_one_cross_stream_wait() -> None:
    # 0 -> 1 -> 3, 0 -> 2 -> 3
    plan = plan_streams([[], [0], [0], [1, 2]], [C] * 4, 2, outputs=[3])
    assert plan.stream == (0, 0, 1, 1)  # the join continues the latest producer's stream
    assert plan.waits == ((), (), (0,), (1,))
    assert plan.record_stream == ((), (), (0,), (1,))
    assert plan.records_event == (True, True, False, True)
    assert plan.output_waits == (3,)


def test_diamond_on_one_stream_needs_no_event_between_nodes() -> None:
    plan = plan_streams([[], [0], [0], [1, 2]], [C] * 4, 1, outputs=[3])
    assert plan.stream == (0, 0, 0, 0)
    assert plan.waits == ((),) * 4
    assert plan.record_stream == ((),) * 4
    assert plan.records_event == (False, False, False, True)


def test_wide_graph_listed_branch_by_branch_spreads_branches() -> None:
    # 8 independent chains of 3 reading a graph input, then a join of the 8 tails.
    producers: list[list[int]] = []
    for _ in range(8):
        start = len(producers)
        producers += [[], [start], [start + 1]]
    tails = [3 * b + 2 for b in range(8)]
    producers.append(tails)
    plan = plan_streams(producers, [C] * 25, 4, outputs=[24])
    for b in range(8):
        assert {plan.stream[3 * b + k] for k in range(3)} == {b % 4}
    assert all(plan.waits[i] == () for i in range(24))
    assert plan.stream[24] == 3  # continues branch 7
    # tails on other streams are waited on; branch 3's tail shares the join's stream
    assert plan.waits[24] == tuple(t for b, t in enumerate(tails) if b % 4 != 3)
    assert len(plan.streams_used) == 4


def test_wide_graph_listed_layer_by_layer_spreads_branches() -> None:
    width, depth = 6, 3
    producers: list[list[int]] = [[] for _ in range(width)]
    for layer in range(1, depth):
        producers += [[(layer - 1) * width + b] for b in range(width)]
    plan = plan_streams(producers, [C] * (width * depth), 3)
    for b in range(width):
        assert {plan.stream[layer * width + b] for layer in range(depth)} == {b % 3}
    assert plan.waits == ((),) * (width * depth)


def test_costs_balance_branches() -> None:
    # four independent roots; the first is as heavy as all the others together
    plan = plan_streams([[], [], [], []], [C] * 4, 2, costs=[100, 1, 1, 1])
    assert plan.stream == (0, 1, 1, 1)


def test_waits_implied_by_another_wait_are_dropped() -> None:
    # 0(s0) -> 1(s0); 0 -> 2(s1); 3 = f(1, 2) on s1 waits on 1; 4 = g(0, 3) continues 3's
    # stream: 0 is ordered before 3, so 4 needs no wait on 0 (but still record_stream).
    plan = plan_streams([[], [0], [0], [1, 2], [0, 3]], [C] * 5, 2)
    assert plan.stream == (0, 0, 1, 1, 1)
    assert plan.waits[3] == (1,)
    assert plan.waits[4] == ()
    assert plan.record_stream[4] == (0,)


def test_host_waits_only_for_the_latest_of_ordered_producers() -> None:
    # a host node reading 0 and 3, where 0 is ordered before 3, awaits 3 alone
    plan = plan_streams([[], [0], [0], [1, 2], [0, 3]], [C, C, C, C, H], 2)
    assert plan.host_waits[4] == (3,)
    assert plan.records_event[3]


def test_mixed_cpu_gpu_host_node_waits_and_fences_its_gpu_readers() -> None:
    # 0 cuda -> 1 host -> 2 cuda
    plan = plan_streams([[], [0], [1]], [C, H, C], 2, outputs=[2])
    assert plan.host_waits == ((), (0,), ())
    assert plan.records_event[0]
    assert plan.fence == (False, False, True)
    assert plan.waits[2] == ()  # a host value carries no GPU event; the fence orders it


def test_host_node_without_gpu_inputs_waits_for_nothing() -> None:
    plan = plan_streams([[], [0], [1]], [H, H, C], 2)
    assert plan.host_waits == ((), (), ())
    assert plan.fence == (False, False, True)
    assert plan.records_event == (False, False, False)


def test_host_wait_upstream_makes_a_gpu_wait_unnecessary() -> None:
    # 0 c; 1 c(0) continues s0; 2 scalar(0) waits 0 on the host; 3 c(0, 2) on s1: no wait
    plan = plan_streams([[], [0], [0], [0, 2]], [C, C, S, C], 2)
    assert plan.stream == (0, 0, None, 1)
    assert plan.host_waits[2] == (0,)
    assert plan.waits[3] == ()
    assert plan.record_stream[3] == (0,)  # memory safety does not depend on the host wait
    assert plan.fence[3] is False  # a SCALAR result is a host value, never a GPU tensor


def test_metadata_reads_never_wait() -> None:
    # 0 c -> 1 sym_size (meta) -> 2 mul (scalar) -> 3 view(0, 2) (cuda)
    plan = plan_streams([[], [0], [1], [0, 2]], [C, M, S, C], 2, outputs=[3])
    assert plan.host_waits == ((),) * 4
    assert plan.waits == ((),) * 4
    assert plan.stream[3] == plan.stream[0]
    assert plan.records_event == (False, False, False, True)


def test_aliases_pass_gpu_values_through() -> None:
    # 0 c (tuple) -> 1 getitem, 2 getitem; 3 c(1), 4 c(2), 5 host(1), output 2
    plan = plan_streams([[], [0], [0], [1], [2], [1]], [C, A, A, C, C, H], 2, outputs=[2])
    assert plan.stream[3] == 0 and plan.stream[4] == 1
    assert plan.waits[4] == (0,)
    assert plan.record_stream[4] == (2,)  # the getitem's value: a view of 0's memory
    assert plan.host_waits[5] == (0,)
    assert plan.output_waits == (0,)


def test_alias_of_a_host_value_fences() -> None:
    plan = plan_streams([[], [0], [1]], [H, A, C], 2)
    assert plan.fence[2] is True


def test_outputs_are_reduced_to_the_latest_ordered_nodes() -> None:
    plan = plan_streams([[], [0], [0], [1, 2]], [C] * 4, 2, outputs=[0, 1, 3])
    assert plan.output_waits == (3,)
    plan = plan_streams([[], [0], [0]], [C] * 3, 2, outputs=[1, 2])
    assert plan.output_waits == (1, 2)
    plan = plan_streams([[], [0]], [C, H], 2, outputs=[1])
    assert plan.output_waits == ()  # a host value needs no GPU wait


def test_several_devices_get_their_own_streams_and_cross_device_waits() -> None:
    # 0 on cuda:0 -> 1 copy on cuda:1 -> 2 on cuda:1; 3 on cuda:0 reads 0
    plan = plan_streams(
        [[], [0], [1], [0]], [C] * 4, 2, devices={0: 0, 1: 1, 2: 1, 3: 0}
    )
    assert plan.device == (0, 1, 1, 0)
    assert plan.stream == (0, 0, 0, 0)
    assert plan.waits == ((), (0,), (), ())
    assert plan.record_stream[1] == (0,)
    assert plan.streams_used == ((0, 0), (1, 0))
    assert plan.devices == (0, 1)


def test_one_stream_random_graphs_never_wait_between_cuda_nodes() -> None:
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 20)
        producers = [rng.sample(range(i), k=min(i, rng.randint(0, 3))) for i in range(n)]
        roles = [rng.choice([C, C, C, A, H]) for _ in range(n)]
        plan = plan_streams(producers, roles, 1)
        assert all(not w for w in plan.waits)
        assert all(not r for r in plan.record_stream)
        assert all(s in (None, 0) for s in plan.stream)


def test_plans_are_deterministic_and_frozen() -> None:
    args = ([[], [0], [0], [1, 2]], [C] * 4, 3)
    first = plan_streams(*args, outputs=[3])
    assert first == plan_streams(*args, outputs=[3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.stream = ()  # type: ignore[misc]


def test_describe_names_streams_waits_and_host_waits() -> None:
    plan = plan_streams([[], [0], [0], [1, 2], [3]], [C, C, C, C, H], 2, outputs=[4])
    text = plan.describe()
    assert "2: cuda:0 stream 1 waits=[0]" in text
    assert "4: host host waits [3]" in text


@pytest.mark.parametrize(
    ("producers", "roles", "streams", "message"),
    [
        ([[], [1]], [C, C], 2, "topological"),
        ([[], [5]], [C, C], 2, "topological"),
        ([[]], [C, C], 2, "producer lists"),
        ([[]], [C], 0, "streams_per_device"),
    ],
)
def test_invalid_input_is_rejected(
    producers: list[list[int]], roles: list[Role], streams: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_streams(producers, roles, streams)


def test_invalid_device_costs_and_outputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="device index"):
        plan_streams([[]], [C], 1, devices={0: -1})
    with pytest.raises(ValueError, match="costs"):
        plan_streams([[]], [C], 1, costs=[1.0, 2.0])
    with pytest.raises(ValueError, match="output node"):
        plan_streams([[]], [C], 1, outputs=[3])


# -- from a Graph and its ExecutionPlan ---------------------------------------------------------


def _double(x: Any) -> Any:
    return x * 2


def _pair(x: Any) -> Any:
    return (x + 1, x - 1)


def _combine(a: Any, b: Any) -> Any:
    return a + b


def _graph_with_stream_nodes(streams: Sequence[str]) -> tuple[Any, ExecutionPlan]:
    """A builder graph whose `streams` nodes are marked STREAM, as CUDA nodes would be."""
    import operator

    b = GraphBuilder()
    x = b.input("x")
    p = b.call(_pair, x, name="pair")
    first = b.call(operator.getitem, p, 0, name="first")
    second = b.call(operator.getitem, p, 1, name="second")
    left = b.call(_double, first, name="left")
    right = b.call(_double, second, name="right")
    host = b.call(_double, right, name="host")
    out = b.call(_combine, left, host, name="out")
    b.output(out)
    graph = b.build()
    plan = build_plan(graph, KernelFactory().create(graph), ExecutorConfig())
    placement = tuple(
        Placement.DEVICE if n.name in streams else plan.placement[n.index] for n in graph.nodes
    )
    return graph, dataclasses.replace(plan, placement=placement)


def test_stream_plan_for_takes_roles_from_placement_and_targets() -> None:
    graph, plan = _graph_with_stream_nodes(["pair", "left", "right", "out"])
    sp = stream_plan_for(graph, plan, 2, default_device=1)
    idx = {n.name: n.index for n in graph.nodes}
    assert [sp.roles[idx[k]] for k in ("pair", "first", "left", "host", "out")] == [
        C, A, C, H, C,
    ]
    assert {sp.device[idx[k]] for k in ("pair", "left", "right", "out")} == {1}
    assert sp.stream[idx["left"]] == sp.stream[idx["pair"]]
    assert sp.stream[idx["right"]] != sp.stream[idx["pair"]]
    assert sp.host_waits[idx["host"]] == (idx["right"],)
    assert sp.fence[idx["out"]]
    assert sp.output_waits == (idx["out"],)


def test_stream_plan_for_without_stream_nodes_is_empty() -> None:
    graph, plan = _graph_with_stream_nodes([])
    sp = stream_plan_for(graph, plan, 4)
    assert not sp.has_cuda
    assert sp.streams_used == ()
    assert all(not w for w in sp.host_waits)


def test_node_role_of_aten_prim_ops() -> None:
    b = GraphBuilder()
    x = b.input("x")
    size = b.call(torch.ops.aten.sym_size.int, x, 0, name="size")
    item = b.call(torch.ops.aten._local_scalar_dense.default, x, name="item")
    scal = b.call(torch.ops.aten.scalar_tensor.default, 1.0, name="scal")
    n = b.call(len, x, name="n")
    b.output((size, item, scal, n))
    graph = b.build()
    graph.values[graph.node("item").output].spec = ScalarSpec(float, None, fixed=False)
    plan = build_plan(graph, KernelFactory().create(graph), ExecutorConfig())
    roles = {node.name: node_role(graph, plan, node.index) for node in graph.nodes}
    assert roles == {"size": M, "item": S, "scal": H, "n": M}
