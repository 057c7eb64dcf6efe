"""Serve Executors over HTTP with the Open Inference Protocol (KServe v2 REST).

    from asyncgraph.serve import create_app, run
    run(create_app({"mlp": asyncgraph.load("mlp.pt2")}, close_executors=True), port=8000)

`create_app` returns a Starlette app to run on uvicorn or to mount into a FastAPI or Starlette
app; `running_server` runs one inside the current event loop (tests, notebooks). The app is
the HTTP transport (app.py) over `InferenceServer` (core.py), which gRPC (grpc_server.py)
serves too. The stock
`tritonclient.http` client works with its defaults, binary tensor data included.
"""

from asyncgraph.serve.admission import Admission
from asyncgraph.serve.app import create_app
from asyncgraph.serve.codec import InferRequest, decode_request, encode_response
from asyncgraph.serve.core import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES, InferenceServer
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface, TensorInfo
from asyncgraph.serve.metrics import ServerMetrics
from asyncgraph.serve.runner import run, running_server

__all__ = [
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_REQUEST_BYTES",
    "Admission",
    "InferRequest",
    "InferenceServer",
    "ModelInterface",
    "ProtocolError",
    "ServerMetrics",
    "TensorInfo",
    "create_app",
    "decode_request",
    "encode_response",
    "run",
    "running_server",
]
