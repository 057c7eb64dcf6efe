"""Triton's statistics extension, system shared memory and the stream's final-response flag,
over HTTP and gRPC, with the stock tritonclient (issue 51, items 2, 4 and 5).

Each test runs the HTTP app with its gRPC endpoint inside its own event loop (as
test_serve_grpc.py does) and talks to it with tritonclient.http.aio and tritonclient.grpc.aio;
the shared memory regions are made with tritonclient.utils.shared_memory, as a client does.
"""

from __future__ import annotations

import asyncio
import queue
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http.aio as tha
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

import asyncgraph
from asyncgraph.serve import InferenceServer, create_app, running_server
from asyncgraph.serve.grpc_server import add_grpc
from tests.support.models import Affine, export_model
from tests.support.serving import Gate, gated_graph, metric

pytestmark = pytest.mark.usefixtures("leak_check")

WAIT_S = 20.0


@pytest.fixture(scope="module")
def linear() -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = Affine()
    return model, export_model(model, torch.randn(2, 4), dynamic=True)


class Clients:
    def __init__(self, server: InferenceServer, http: tha.InferenceServerClient,
                 grpc: tga.InferenceServerClient, url: str, target: str) -> None:
        self.server, self.http, self.grpc, self.url, self.target = (
            server, http, grpc, url, target
        )


@asynccontextmanager
async def serving(models: dict[str, asyncgraph.Executor], **options: Any) -> AsyncIterator[Clients]:
    options.setdefault("calibrate", False)
    app = create_app(models, **options)
    endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5)
    async with running_server(app) as url:
        http = tha.InferenceServerClient(url.removeprefix("http://"), conn_timeout=WAIT_S)
        grpc = tga.InferenceServerClient(endpoint.address)
        try:
            yield Clients(app.state.asyncgraph, http, grpc, url, endpoint.address)
        finally:
            await http.close()
            await grpc.close()


def http_input(x: np.ndarray) -> tha.InferInput:
    tensor = tha.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return tensor


def grpc_input(x: np.ndarray) -> tga.InferInput:
    tensor = tga.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def eager(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


# -- statistics -----------------------------------------------------------------------------


def _by_name(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in stats["model_stats"]}


async def test_statistics_count_the_requests_sent_over_both_transports(linear: Any) -> None:
    _, ep = linear
    x = np.ones((2, 4), np.float32)
    async with (
        asyncgraph.Executor(ep) as ex, asyncgraph.Executor(ep) as other,
        serving({"lin": ex, "idle": other}) as s,
    ):
        for _ in range(3):
            await s.http.infer("lin", [http_input(x)])
        for _ in range(2):
            await s.grpc.infer("lin", [grpc_input(x)])
        with pytest.raises(InferenceServerException):  # a bad shape: one failure
            await s.http.infer("lin", [http_input(np.ones((2, 9), np.float32))])

        everything = await s.http.get_inference_statistics()
        one = await s.http.get_inference_statistics("lin")
        versioned = await s.http.get_inference_statistics("lin", "1")
        over_grpc = await s.grpc.get_inference_statistics(as_json=True)
        one_grpc = await s.grpc.get_inference_statistics("lin", "1", as_json=True)
        metrics = (await s.http._get("metrics", None, None))
        text = (await metrics.read()).decode()

        by_name = _by_name(everything)
        assert set(by_name) == {"lin", "idle"}  # every model served, the idle one too
        assert by_name["idle"]["inference_count"] == 0
        lin = by_name["lin"]
        assert lin["version"] == "1"
        assert lin["inference_count"] == 5 and lin["execution_count"] == 5
        assert lin["last_inference"] > 0
        figures = lin["inference_stats"]
        # (request times count on the loop's clock, in milliseconds under uvloop: no > 0)
        assert figures["success"]["count"] == 5 and figures["fail"]["count"] == 1
        for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert figures[phase]["count"] == 5, phase
        assert figures["compute_infer"]["ns"] > 0
        [batch] = lin["batch_stats"]  # an executor without batching: batch size 1
        assert batch["batch_size"] == 1 and batch["compute_infer"]["count"] == 5
        assert one["model_stats"] == [lin] and versioned["model_stats"] == [lin]
        # gRPC's answer (protobuf JSON: uint64 as strings) has the same figures
        grpc_lin = _by_name(over_grpc)["lin"]
        assert int(grpc_lin["inference_count"]) == 5
        assert int(grpc_lin["inference_stats"]["success"]["count"]) == 5
        assert int(grpc_lin["inference_stats"]["fail"]["count"]) == 1
        assert [m["name"] for m in one_grpc["model_stats"]] == ["lin"]
        # /metrics shows the same figures: one source
        assert metric(text, "nv_inference_request_success", model="lin") == 5
        assert metric(text, "nv_inference_count", model="lin") == lin["inference_count"]
        assert metric(text, "nv_inference_exec_count", model="lin") == lin["execution_count"]
        assert metric(text, "nv_inference_queue_duration_us", model="lin") == pytest.approx(
            figures["queue"]["ns"] / 1000, abs=1e-3)
        assert metric(text, "nv_inference_compute_infer_duration_us", model="lin") == (
            pytest.approx(figures["compute_infer"]["ns"] / 1000, abs=1e-3))

        # a model or version not served is refused, naming it
        with pytest.raises(InferenceServerException, match="nope"):
            await s.http.get_inference_statistics("nope")
        with pytest.raises(InferenceServerException, match="'7'"):
            await s.grpc.get_inference_statistics("lin", "7")


async def test_statistics_with_batching_count_rows_and_batches(linear: Any) -> None:
    _, ep = linear
    config = asyncgraph.ExecutorConfig(
        max_concurrent_executions=2,
        batching=asyncgraph.BatchingConfig(max_batch_size=32, max_concurrent_batches=1),
    )
    xs = [np.ones((1 + i % 3, 4), np.float32) for i in range(24)]
    async with asyncgraph.Executor(ep, config) as ex, serving({"lin": ex}) as s:
        await asyncio.gather(*(s.grpc.infer("lin", [grpc_input(x)]) for x in xs))
        stats = (await s.http.get_inference_statistics("lin"))["model_stats"][0]
        batches = ex.batching_statistics()
    assert batches is not None
    assert stats["inference_count"] == sum(len(x) for x in xs)  # rows, as Triton counts
    assert stats["execution_count"] == batches.batches
    assert stats["inference_stats"]["success"]["count"] == len(xs)
    # by the batches that ran: their sizes in rows, as the batcher counted them
    sizes = {int(b["batch_size"]): b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert batches.retried_alone == 0 and sum(sizes.values()) == batches.batches
    assert sum(size * n for size, n in sizes.items()) == batches.rows + batches.padded_rows
    assert sizes == {size: n for size, (n, _) in batches.by_size.items()}


# -- system shared memory -------------------------------------------------------------------


@contextmanager
def regions(*sizes: int) -> Iterator[list[Any]]:
    """Client-side POSIX shared memory regions (tritonclient.utils.shared_memory), destroyed
    after the block."""
    handles = []
    try:
        for size in sizes:
            name = f"ag{uuid.uuid4().hex[:10]}"
            handles.append(shm.create_shared_memory_region(name, "/" + name, size))
        yield handles
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def key_of(handle: Any) -> str:
    return handle._shm_key  # type: ignore[no-any-return]


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_system_shared_memory_register_infer_status_unregister(
    linear: Any, transport: str
) -> None:
    model, ep = linear
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        client, lib = (s.http, tha) if transport == "http" else (s.grpc, tga)
        with regions(x.nbytes, 64) as (into, out):
            shm.set_shared_memory_region(into, [x])
            await client.register_system_shared_memory("in", key_of(into), x.nbytes)
            # the region starts 16 bytes into its object; the output 8 bytes into the region
            await client.register_system_shared_memory("out", key_of(out), 40, offset=16)
            status = await client.get_system_shared_memory_status(**(
                {"as_json": True} if transport == "grpc" else {}))
            listed = status if transport == "http" else list(status["regions"].values())
            assert sorted(r["name"] for r in listed) == ["in", "out"]
            tensor = lib.InferInput("x", [2, 4], "FP32")
            tensor.set_shared_memory("in", x.nbytes)
            wanted = lib.InferRequestedOutput("output_0")
            wanted.set_shared_memory("out", 24, offset=8)
            result = await client.infer("lin", [tensor], outputs=[wanted])
            out_entry = result.get_output("output_0")
            shape = out_entry["shape"] if transport == "http" else list(out_entry.shape)
            assert [int(d) for d in shape] == [2, 3]
            got = shm.get_contents_as_numpy(out, np.float32, [2, 3], offset=24)
            np.testing.assert_allclose(got, eager(model, x), rtol=1e-5, atol=1e-6)
            await client.unregister_system_shared_memory("in")
            status = await client.get_system_shared_memory_status(**(
                {"as_json": True} if transport == "grpc" else {}))
            listed = status if transport == "http" else list(status["regions"].values())
            assert [r["name"] for r in listed] == ["out"]
            await client.unregister_system_shared_memory()
        assert s.server.shared_memory.mapped == 0  # every mapping closed


async def test_shared_memory_offsets_and_sizes_are_checked_naming_the_region(
    linear: Any
) -> None:
    _, ep = linear
    x = np.ones((2, 4), np.float32)
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        with regions(32, 16) as (into, small):
            with pytest.raises(InferenceServerException, match=r"'big'.*bytes"):
                await s.http.register_system_shared_memory("big", key_of(into), 64)
            with pytest.raises(InferenceServerException, match="'far'"):
                await s.grpc.register_system_shared_memory("far", key_of(into), 8, offset=30)
            with pytest.raises(InferenceServerException, match="'ghost'"):
                await s.http.register_system_shared_memory("ghost", "/no-such-key-ag", 8)
            await s.http.register_system_shared_memory("in", key_of(into), 32)
            await s.grpc.register_system_shared_memory("small", key_of(small), 16)
            with pytest.raises(InferenceServerException, match=r"'in'.*already"):
                await s.grpc.register_system_shared_memory("in", key_of(into), 32)

            wrong = tga.InferInput("x", [2, 4], "FP32")
            wrong.set_shared_memory("in", 16)  # 32 bytes needed
            with pytest.raises(InferenceServerException, match="'in'"):
                await s.grpc.infer("lin", [wrong])
            past = tha.InferInput("x", [2, 4], "FP32")
            past.set_shared_memory("in", 32, offset=8)  # past the region's end
            with pytest.raises(InferenceServerException, match="'in'"):
                await s.http.infer("lin", [past])
            unknown = tha.InferInput("x", [2, 4], "FP32")
            unknown.set_shared_memory("nothing", 32)
            with pytest.raises(InferenceServerException, match="'nothing'"):
                await s.http.infer("lin", [unknown])
            tight = tga.InferRequestedOutput("output_0")
            tight.set_shared_memory("small", 16)  # the output takes 24 bytes
            with pytest.raises(InferenceServerException, match="'small'"):
                await s.grpc.infer("lin", [grpc_input(x)], outputs=[tight])
            await s.http.unregister_system_shared_memory()
        assert s.server.shared_memory.mapped == 0


async def test_unregistering_a_region_in_use_is_safe() -> None:
    gate = Gate()
    x = np.array([1.5, -2.0], np.float32)
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving({"g": ex}) as s:
        with regions(8, 8, 8) as (into, out, newer):
            shm.set_shared_memory_region(into, [x])
            await s.grpc.register_system_shared_memory("in", key_of(into), 8)
            await s.grpc.register_system_shared_memory("out", key_of(out), 8)
            tensor = tga.InferInput("x", [2], "FP32")
            tensor.set_shared_memory("in", 8)
            wanted = tga.InferRequestedOutput("output_0")
            wanted.set_shared_memory("out", 8)
            call = asyncio.ensure_future(s.grpc.infer("g", [tensor], outputs=[wanted]))
            await asyncio.wait_for(gate.started.wait(), WAIT_S)
            # unregistered while the request runs: the name is free at once, and a region
            # registered under it now is not the one the request writes
            await s.http.unregister_system_shared_memory()
            await s.http.register_system_shared_memory("out", key_of(newer), 8)
            gate.release.set()
            await call
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.float32, [2]),
                                          x * 2)
            np.testing.assert_array_equal(shm.get_contents_as_numpy(newer, np.float32, [2]),
                                          [0, 0])
            assert s.server.shared_memory.mapped == 1  # the old ones closed once unused
            await s.http.unregister_system_shared_memory()
        assert s.server.shared_memory.mapped == 0


async def test_cuda_shared_memory_is_refused_clearly(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        with pytest.raises(InferenceServerException, match=r"CUDA shared memory.*system"):
            await s.http.register_cuda_shared_memory("c", b"\0" * 64, 0, 8)
        with pytest.raises(InferenceServerException, match=r"CUDA shared memory.*system"):
            await s.grpc.register_cuda_shared_memory("c", b"\0" * 64, 0, 8)
        assert await s.http.get_cuda_shared_memory_status() == []
        cuda = tha.InferInput("x", [2, 4], "FP32")
        cuda.set_shared_memory("c", 32)
        with pytest.raises(InferenceServerException, match="'c'"):
            await s.http.infer("lin", [cuda])


# -- streams --------------------------------------------------------------------------------


def _stream(target: str, xs: list[np.ndarray]) -> list[tuple[Any, Any]]:
    """The blocking client's stream, as a Triton user runs it: each request asks for the
    empty final response; returns (result, error) pairs until every request has a final one."""
    answers: list[tuple[Any, Any]] = []
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tg.InferenceServerClient(target)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        for i, x in enumerate(xs):
            tensor = tg.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.async_stream_infer("lin", [tensor], request_id=f"r{i}",
                                      enable_empty_final_response=True)
        finals = 0
        while finals < len(xs):
            result, error = got.get(timeout=WAIT_S)
            answers.append((result, error))
            response = result.get_response() if result is not None else None
            if response is not None and response.parameters[
                    "triton_final_response"].bool_param:
                finals += 1
            elif error is not None:
                finals += 1  # an error answer without the flag ends its request too
        client.stop_stream()
    finally:
        client.close()
    return answers


async def test_stream_answers_carry_triton_final_response(linear: Any) -> None:
    model, ep = linear
    xs = [np.ones((1, 4), np.float32), np.ones((1, 9), np.float32), np.ones((3, 4), np.float32)]
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        answers = await asyncio.wait_for(asyncio.to_thread(_stream, s.target, xs), WAIT_S)
    assert len(answers) == 3  # one answer per request: the flag rides on it, as Triton's
    # non-decoupled models do
    ok = [r for r, e in answers if e is None]
    assert [r.get_response().id for r in ok] == ["r0", "r2"]
    for result in ok:
        assert result.get_response().parameters["triton_final_response"].bool_param
    np.testing.assert_allclose(ok[1].as_numpy("output_0"), eager(model, xs[2]), rtol=1e-5,
                               atol=1e-6)
    [error] = [e for _, e in answers if e is not None]
    assert "shape[1]" in error.message()


async def test_grpc_stats_and_shm_methods_are_served(linear: Any) -> None:
    """The methods tritonclient calls exist on the gRPC service (not UNIMPLEMENTED)."""
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        assert (await s.grpc.get_system_shared_memory_status(as_json=True)) == {}
        assert (await s.grpc.get_cuda_shared_memory_status(as_json=True)) == {}
        await s.grpc.unregister_system_shared_memory()


async def test_a_link_in_shared_memory_is_not_followed(linear: Any, tmp_path: Path) -> None:
    """A key naming a symbolic link in /dev/shm (planted by anyone on the machine) is refused:
    followed, the outputs written into the region would land in whatever file it points at."""
    _, ep = linear
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 64)
    link = Path("/dev/shm") / f"ag{uuid.uuid4().hex[:10]}"
    link.symlink_to(victim)
    try:
        async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
            for client in (s.http, s.grpc):
                with pytest.raises(InferenceServerException, match="'linked'"):
                    await client.register_system_shared_memory("linked", "/" + link.name, 32)
    finally:
        link.unlink()
    assert victim.read_bytes() == b"\0" * 64
