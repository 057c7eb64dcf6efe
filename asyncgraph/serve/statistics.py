"""Triton's statistics extension: per model version, what its requests cost, as Triton counts it.

    GET /v2/models/stats, /v2/models/{m}/stats, /v2/models/{m}/versions/{v}/stats
    gRPC ModelStatistics (grpc_extensions.py)

The figures are the ones /metrics shows: both read the server's per-version counters
(metrics.ModelCounters in `ServerMetrics.by_version`), counted once per request by
`ServerMetrics.observe` and once per successful execution by `ServerMetrics.executed`
(core.InferenceServer.execute), so the two never disagree. Triton's fields:

- `success` / `fail`: requests answered, and their time from arrival to the answer made
  (nv_inference_request_success and _duration_us; nv_inference_request_failure);
- `queue`: time requests waited for an execution slot (admission.py); `compute_input`: their
  decode (body to tensors, shared memory regions read included); `compute_infer`: the
  execution; `compute_output`: the encode (or the write into shared memory regions). Each
  phase's count is the successful requests', as Triton's is; the time is what /metrics shows
  (the nv_inference_*_duration_us series, which include the part of a failed request that
  got that far);
- `inference_count`: inferences: a request's rows (its inputs' dim 0) when its Executor
  batches, else 1 per execution (core.batch_rows); `execution_count`: executions of the model:
  the batcher's batches when it batches, else the successful requests (nv_inference_count and
  nv_inference_exec_count);
- `batch_stats`: executions and their compute_infer time by batch size: with batching, the
  batcher's own count of the batches it ran by their rows (`BatcherStatistics.by_size`,
  padding included: the size the model ran); without, each request's execution under its
  rows. Decode and encode are per request, not per batch: their batch_stats entries stay zero;
- `last_inference`: milliseconds since the epoch of the last successful execution;
- `cache_hit` / `cache_miss`, `memory_usage`, `response_stats`: no response cache, no
  per-allocation report, no decoupled models: always zero or empty.
"""

from __future__ import annotations

from typing import Any

from asyncgraph.serve.core import InferenceServer
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.metrics import ModelCounters

#: The phases of Triton's InferStatistics, in its order.
PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
          "cache_hit", "cache_miss")


def _duration(count: float, us: float) -> dict[str, int]:
    """Triton's StatisticDuration: a count and nanoseconds."""
    return {"count": int(count), "ns": max(0, round(us * 1000))}


def _phases(c: ModelCounters) -> dict[str, dict[str, int]]:
    done = c.success
    return {
        "success": _duration(done, c.request_us),
        "fail": _duration(sum(c.failure.values()), c.fail_us),
        "queue": _duration(done, c.queue_us),
        "compute_input": _duration(done, c.compute_input_us),
        "compute_infer": _duration(done, c.compute_us),
        "compute_output": _duration(done, c.compute_output_us),
        "cache_hit": _duration(0, 0),
        "cache_miss": _duration(0, 0),
    }


# -- the extension's answer ------------------------------------------------------------------


def model_statistics(
    server: InferenceServer, name: str | None = None, version: str | None = None
) -> dict[str, Any]:
    """Triton's ModelStatisticsResponse as JSON (`{"model_stats": [...]}`): every model
    version served (name None), every version of model `name`, or one version; a 400 for a
    malformed name or version and a 404 for one not served (counted as route "stats")."""
    if name is None:
        targets = _all_versions(server)
    else:
        server.lookup("stats", name, version)  # 400 / 404, counted
        versions = [version] if version is not None else server.versions(name)
        targets = [(name, v) for v in versions]
    return {"model_stats": [_entry(server, n, v) for n, v in targets]}


def _all_versions(server: InferenceServer) -> list[tuple[str, str]]:
    if server.control is None:
        return [(n, server.version) for n in list(server.models)]
    return [(e["name"], e["version"]) for e in server.repository_index(ready=True)]


def _by_size(c: ModelCounters, batches: Any) -> dict[int, tuple[int, float]]:
    """Executions and their compute time (us) by batch size: the batcher's, when it batches."""
    if batches is None:
        return {size: (int(n), us) for size, (n, us) in c.batches.items()}
    return {size: (n, seconds * 1e6) for size, (n, seconds) in batches.by_size.items()}


def _entry(server: InferenceServer, name: str, version: str) -> dict[str, Any]:
    c = server.metrics.by_version.get((name, version)) or ModelCounters()
    try:
        executor = server.served(name, version).executor
    except ProtocolError:  # unloaded since it was listed: what it did until then
        batches = None
    else:
        batches = executor.batching_statistics()
    return {
        "name": name,
        "version": version,
        "last_inference": c.last_inference_ms,
        "inference_count": c.inferences,
        "execution_count": c.success if batches is None else batches.batches,
        "inference_stats": _phases(c),
        "batch_stats": [
            {"batch_size": size, "compute_input": _duration(0, 0),
             "compute_infer": _duration(n, us), "compute_output": _duration(0, 0)}
            for size, (n, us) in sorted(_by_size(c, batches).items())
        ],
        "memory_usage": [],
        "response_stats": {},
    }
