"""examples/fastapi_service.py on a real uvicorn server: its own API and the mounted KServe one."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import torch

from asyncgraph.serve import running_server

pytest.importorskip("fastapi")

pytestmark = pytest.mark.usefixtures("leak_check")

EXAMPLE = Path(__file__).parents[2] / "examples" / "fastapi_service.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_service_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


async def test_fastapi_example_owns_its_executor() -> None:
    example = load_example()
    x = torch.randn(3, 8)
    async with running_server(example.app) as url, httpx.AsyncClient(
        base_url=url, timeout=30
    ) as client:
        executor = example.models["mlp"]
        calibration_runs = executor.statistics().completed  # the KServe gate's, at start-up
        predicted = await client.post("/predict", json={"x": x.tolist()})
        assert predicted.status_code == 200, predicted.text
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 8],
                            "data": x.reshape(-1).tolist()}]}
        served = await client.post("/kserve/v2/models/mlp/infer", json=body)
        assert served.status_code == 200, served.text
        bad = await client.post("/predict", json={"x": [[1.0, 2.0]]})
        assert bad.status_code == 400 and "x.shape[1]: expected 8, got 2" in bad.text
        metrics = (await client.get("/kserve/metrics")).text
        assert 'nv_inference_request_success{model="mlp",version="1"} 1.0' in metrics
        assert 'asyncgraph_calibrated{model="mlp"} 1.0' in metrics
    assert example.models == {} and executor.statistics().closed
    y = torch.tensor(predicted.json()["y"])
    kserve = torch.tensor(served.json()["outputs"][0]["data"]).reshape(3, 4)
    torch.testing.assert_close(y, kserve)
    assert calibration_runs > 0 and executor.statistics().completed == calibration_runs + 2


async def test_fastapi_example_batches_concurrent_predictions() -> None:
    example = load_example()
    xs = [torch.randn(1 + i % 3, 8) for i in range(24)]
    async with running_server(example.app) as url, httpx.AsyncClient(
        base_url=url, timeout=30
    ) as client:
        executor = example.models["mlp"]
        calibration_runs = executor.statistics().completed
        before = executor.batching_statistics()
        assert before is not None
        responses = await asyncio.gather(
            *(client.post("/predict", json={"x": x.tolist()}) for x in xs)
        )
    torch.manual_seed(0)
    reference = example.MLP().eval()  # the bundled model, as the example builds it
    for x, r in zip(xs, responses, strict=True):
        assert r.status_code == 200, r.text
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(r.json()["y"]), reference(x))
    stats = executor.batching_statistics()
    assert stats is not None and stats.requests - before.requests == 24
    assert stats.rows - before.rows == sum(len(x) for x in xs)
    assert executor.statistics().completed == calibration_runs + stats.batches - before.batches
