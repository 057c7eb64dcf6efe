"""A FastAPI service that owns an asyncgraph Executor through its lifespan.

    uvicorn examples.fastapi_service:app --loop uvloop            # a small bundled MLP
    ASYNCGRAPH_MODEL=model.pt2 uvicorn examples.fastapi_service:app --loop uvloop
    python examples/fastapi_service.py                            # the same, on 127.0.0.1:8000

One Executor, two faces (requests arriving together are stacked into one execution: dynamic
batching, on for the bundled model; ASYNCGRAPH_MAX_BATCH=N turns it on for a .pt2 whose batch
dimension is dynamic):

- POST /predict - the service's own JSON API: `{"x": [[...], ...]}` in, `{"y": ...}` out, by
  `await executor.execute(x)`; bad input is a 422 from FastAPI or a 400 naming the input.
- /kserve/... - the Open Inference Protocol, mounted from `asyncgraph.serve.create_app`, so
  tritonclient and KServe tooling talk to the same model; Prometheus metrics at /kserve/metrics.

The Executor is created when the app starts and closed when it stops: in-flight executions
finish, worker threads are joined. A mounted app's lifespan is not run by its parent, so the
KServe app reads the `models` dict that this lifespan fills and empties, and this lifespan
calibrates its admission (what the KServe app's own start-up would do).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import asyncgraph
from asyncgraph.serve import create_app

MODEL_NAME = "mlp"


class MLP(torch.nn.Module):
    """The bundled model, used when ASYNCGRAPH_MODEL names no .pt2 file."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_executor() -> asyncgraph.Executor:
    """Concurrent requests are batched (dynamic batching) for the bundled model, whose batch
    dimension is dynamic, and for a .pt2 when ASYNCGRAPH_MAX_BATCH is set."""
    path = os.environ.get("ASYNCGRAPH_MODEL")
    max_batch = int(os.environ.get("ASYNCGRAPH_MAX_BATCH", "0" if path else "64"))
    batching = asyncgraph.BatchingConfig(max_batch_size=max_batch) if max_batch else None
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=8, batching=batching)
    if path:
        return asyncgraph.load(path, config)
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=256)
    ep = torch.export.export(MLP().eval(), (torch.randn(2, 8),), dynamic_shapes=({0: batch},))
    return asyncgraph.Executor(ep, config)


models: dict[str, asyncgraph.Executor] = {}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with load_executor() as executor:  # closed, after in-flight work, on shutdown
        models[MODEL_NAME] = executor
        await kserve.state.asyncgraph.calibrate()  # a mounted app's own lifespan would do it
        try:
            yield
        finally:
            models.pop(MODEL_NAME, None)


kserve = create_app(models, max_queue=128, timeout_ms=5000)
app = FastAPI(title="asyncgraph example service", lifespan=lifespan)
app.mount("/kserve", kserve)


class PredictRequest(BaseModel):
    x: list[list[float]]


class PredictResponse(BaseModel):
    y: list[list[float]]


@app.post("/predict")
async def predict(request: PredictRequest) -> PredictResponse:
    executor = models[MODEL_NAME]
    try:
        y = await executor.execute(torch.tensor(request.x, dtype=torch.float32))
    except asyncgraph.InputValidationError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None
    return PredictResponse(y=y.tolist())


@app.get("/healthz")
async def healthz() -> dict[str, object]:
    stats = models[MODEL_NAME].statistics() if MODEL_NAME in models else None
    return {"ok": stats is not None, "in_flight": stats.in_flight if stats else 0}


if __name__ == "__main__":
    from asyncgraph.serve import run

    run(app, "127.0.0.1", 8000)
