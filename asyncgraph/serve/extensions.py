"""The Triton extensions a server serves: what server metadata lists, over HTTP and gRPC alike.

A client (tritonclient, perf_analyzer) reads `extensions` to decide what it may call, so the
list names exactly the extensions whose endpoints answer on both transports, and nothing that
is refused (docs/serving.md has the table of Triton's endpoints: served, or refused and why).
A module that adds an extension's routes and gRPC methods adds its name to `SERVED`.
"""

from __future__ import annotations

#: Extension name -> what serves it. Every server serves all of them: the model repository's
#: index answers without a repository too, and its load and unload answer Triton's
#: UNAVAILABLE when model control is off, as Triton's do.
SERVED: dict[str, str] = {
    "binary_tensor_data": "app.py (HTTP); gRPC carries raw tensor contents always",
    "model_configuration": "model_config.py",
    "model_repository": "repository_http.py, grpc_server.py (model_control.py)",
    "statistics": "statistics.py (triton_http.py, grpc_extensions.py)",
    "system_shared_memory": "shared_memory.py (triton_http.py, grpc_extensions.py)",
}


def served_extensions() -> list[str]:
    """The extension names server metadata lists, sorted."""
    return sorted(SERVED)
