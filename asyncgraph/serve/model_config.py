"""Triton's model configuration extension: `GET /v2/models/{m}[/versions/{v}]/config` and the
gRPC `ModelConfig` method, in Triton's field names and JSON form.

perf_analyzer reads a model's configuration before it sends any load, and decides from
`max_batch_size` whether `-b N` may be used, so the answer tells the truth about the served
program rather than echoing a file:

- `name`, `platform` ("pytorch_export", a torch.export program) and `backend` ("asyncgraph");
- `input` / `output`: the served names (a config.pbtxt may rename them, pbtxt.py), Triton's
  `TYPE_*` datatypes and dims, -1 where a dimension varies;
- `max_batch_size`: the Executor's dynamic batching (`BatchingConfig.max_batch_size`) when it
  batches, and then `dynamic_batching` with its queue delay, and dims without the batch
  dimension (dim 0), as Triton's; 0 when it does not batch, with every dimension listed;
- `version_policy`: the repository model's (repository.py), else the one version served;
- `instance_group`: one group of `max_concurrent_executions` instances (the executions that
  run at once), on the CPU or the GPU the program's inputs are on.

The messages come from proto/model_config.proto (Triton's subset), compiled into
proto/model_config_descriptor.py and loaded in a descriptor pool of this module's own, as
grpc_protocol.py does for the inference service.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncgraph.serve.core import InferenceServer, Served
from asyncgraph.serve.interface import TensorInfo
from asyncgraph.serve.proto import ProtoFile
from asyncgraph.serve.proto.model_config_descriptor import SERIALIZED

#: What the answer names as the model's platform and backend.
PLATFORM = "pytorch_export"
BACKEND = "asyncgraph"

_PROTO = ProtoFile(SERIALIZED)
FILE = _PROTO.file
ModelConfig = _PROTO.message("ModelConfig")
ModelConfigRequest = _PROTO.message("ModelConfigRequest")
ModelConfigResponse = _PROTO.message("ModelConfigResponse")


def triton_type(datatype: str) -> str:
    """The protocol's datatype (`FP32`, `BYTES`) as model_config.proto's (`TYPE_FP32`,
    `TYPE_STRING`)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(server: InferenceServer, name: str, version: str | None = None) -> dict[str, Any]:
    """Model `name`'s configuration (at `version`; None: its default), in Triton's JSON form;
    refused (400, 404) and counted as any lookup is."""
    served = server.lookup("config", name, version)
    batching = served.executor.batching
    max_batch_size = batching.max_batch_size if batching is not None else 0
    config: dict[str, Any] = {
        "name": name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": _version_policy(server, name, served),
        "max_batch_size": max_batch_size,
        "input": [_tensor(i, max_batch_size) for i in served.interface.inputs],
        "output": [_tensor(o, max_batch_size) for o in served.interface.outputs],
        "instance_group": [{
            "name": name,
            "kind": "KIND_GPU" if _on_gpu(served) else "KIND_CPU",
            "count": served.executor.config.max_concurrent_executions,
        }],
    }
    if batching is not None:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": round(batching.max_delay_s * 1e6),
        }
    return config


def config_message(config: dict[str, Any]) -> Any:
    """`config` (model_config's answer) as a ModelConfig message."""
    return json_format.ParseDict(config, ModelConfig())


def _tensor(info: TensorInfo, max_batch_size: int) -> dict[str, Any]:
    dims = info.shape
    if max_batch_size > 0:  # Triton lists the dims of one batch item
        dims = dims[1:]
    return {"name": info.name, "data_type": triton_type(info.datatype), "dims": dims}


def _version_policy(server: InferenceServer, name: str, served: Served) -> dict[str, Any]:
    """The repository's policy for the model (model control), else the one version served."""
    if server.control is not None:
        return server.control.version_policy(name)
    version = served.version or server.version
    if version.isdigit():
        return {"specific": {"versions": [int(version)]}}
    return {"latest": {"num_versions": 1}}


def _on_gpu(served: Served) -> bool:
    return any(i.device.type == "cuda" for i in served.interface.inputs)


def config_routes(server: InferenceServer) -> list[Route]:
    """The HTTP routes of the model configuration extension."""

    async def config(request: Request) -> Response:
        params = request.path_params
        return JSONResponse(model_config(server, params["name"], params.get("version")))

    return [
        Route("/v2/models/{name}/config", config, methods=["GET"]),
        Route("/v2/models/{name}/versions/{version}/config", config, methods=["GET"]),
    ]
