"""Prometheus metrics of a server: Triton's names where Triton has one, asyncgraph_* otherwise.

Dashboards built for Triton query `nv_inference_request_success`, `nv_inference_queue_duration_us`
and friends by those exact names, with labels `model` and `version`: one series per version
served (a request counts under the version that answered it). prometheus-client renames
every counter to `*_total` in the text format, so the Triton-named counters are collected
untyped under their exact names and typed `counter` when rendered (`render`), as Triton's own
exposition has them. Every series has a type. Triton's compute phases: compute_input is a
request's decode (body to tensors), compute_infer its execution, compute_output its encode.
The same text is served on the HTTP port and, with `--metrics-port` (Triton's 8002), on a
port of its own (metrics_port.py).

Everything else uses ordinary prometheus-client metrics in a registry of the app's own, so two
apps in one process (tests, a parent app mounting two) never collide in the global registry:

- asyncgraph_requests_total{model,code}: every inference request by HTTP status;
- asyncgraph_unserved_requests_total{route,code}: requests refused before they reached a
  model: a malformed model name or version (400) or one not served (404), by route (infer,
  ready, metadata, load, unload), never by the name asked for, so a client cannot add series
  by inventing names;
- asyncgraph_request_duration_seconds / asyncgraph_queue_duration_seconds: histograms;
- asyncgraph_frames_in_use, asyncgraph_frames, asyncgraph_frame_waiters,
  asyncgraph_queued_requests, asyncgraph_running_requests: read from the executors at scrape
  time, so they are never stale;
- the admission policy's view (admission.py): asyncgraph_expected_wait_seconds,
  asyncgraph_service_rate, asyncgraph_decode_seconds, asyncgraph_decode_bytes_per_second,
  asyncgraph_loop_seconds, asyncgraph_calibrated, asyncgraph_queued_bytes and
  asyncgraph_admission_refusals_total{model,reason}, read from the gates at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncgraph.runtime.executor import Executor
from asyncgraph.serve.admission import REASONS, Admission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Triton's failure reasons (nv_inference_request_failure{reason=...}).
REJECTED = "REJECTED"
CANCELED = "CANCELED"
BACKEND = "BACKEND"
OTHER = "OTHER"

#: Triton's cumulative counters, by their exact names (typed `counter` by `render`).
TRITON_COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests.",
    "nv_inference_request_failure": "Number of failed inference requests, by reason.",
    "nv_inference_count": "Number of inferences performed.",
    "nv_inference_exec_count": "Number of model executions performed.",
    "nv_inference_request_duration_us": "Cumulative inference request duration (us).",
    "nv_inference_queue_duration_us": "Cumulative time requests spent queued (us).",
    "nv_inference_compute_input_duration_us": "Cumulative time requests' inputs took to "
                                              "decode (us).",
    "nv_inference_compute_infer_duration_us": "Cumulative model execution time (us).",
    "nv_inference_compute_output_duration_us": "Cumulative time responses took to encode "
                                               "(us).",
}

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)


@dataclass(slots=True)
class ModelCounters:
    """Triton's cumulative per-model counters."""

    success: int = 0
    failure: dict[str, int] = field(default_factory=dict)
    request_us: float = 0.0
    queue_us: float = 0.0
    compute_us: float = 0.0
    compute_input_us: float = 0.0
    compute_output_us: float = 0.0
    #: the failed requests' time from arrival to their answer (Triton's `fail` duration)
    fail_us: float = 0.0
    #: Triton's inference count: the rows executed (statistics.batch_rows), counted with
    #: `batches` and `last_inference_ms` when an execution succeeds (`ServerMetrics.executed`)
    inferences: int = 0
    last_inference_ms: int = 0
    #: batch size -> [executions, their compute_infer us] (Triton's batch_stats)
    batches: dict[int, list[float]] = field(default_factory=dict)


class ServerMetrics:
    """The metrics of one app; `observe` is called once per inference request."""

    def __init__(
        self,
        models: Mapping[str, Executor],
        admission: Callable[[str], Admission | None],
        version: str = "1",
    ) -> None:
        self.version = version
        self.counters: dict[str, ModelCounters] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "asyncgraph_requests", "Inference requests by model and HTTP status.",
            ["model", "code"], registry=self.registry,
        )
        self.latency = Histogram(
            "asyncgraph_request_duration_seconds",
            "Inference request latency, from the body read to the response ready.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue = Histogram(
            "asyncgraph_queue_duration_seconds",
            "Time an inference request waited for a free execution slot.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.unserved_requests = Counter(
            "asyncgraph_unserved_requests", "Requests refused before they reached a model, by "
            "route (infer, ready, metadata, load, unload) and HTTP status: a malformed model "
            "name or version (400) or one not served (404).", ["route", "code"],
            registry=self.registry,
        )
        #: Triton's counters per (model, version label): the per-version series
        self.by_version: dict[tuple[str, str], ModelCounters] = {}
        self.live = _LiveCollector(models, admission, self.counters, version)
        self.live.by_version = self.by_version
        self.registry.register(self.live)

    def observe(
        self,
        model: str,
        code: int,
        *,
        total_s: float,
        timing: Sequence[float] = (),
        failure: str | None = None,
        version: str | None = None,
    ) -> None:
        """Count one request. `timing`: its seconds queued, computing, decoding and encoding,
        as far as the request got (both transports collect them as the request goes).
        `version`: the version that answered it (None: the model's default)."""
        self.requests.labels(model, str(code)).inc()
        label = version or (self.live.version_of(model) if self.live.version_of is not None
                            else self.version)
        for counters in (self.counters.setdefault(model, ModelCounters()),
                         self.by_version.setdefault((model, label), ModelCounters())):
            _count(counters, total_s, timing, failure)
        queue_s = timing[0] if timing else None
        if failure is None:
            self.latency.labels(model).observe(total_s)
        if queue_s is not None:
            self.queue.labels(model).observe(queue_s)

    def executed(self, model: str, version: str | None, rows: int, compute_s: float) -> None:
        """Count one successful execution of a request of `rows` rows (its batch size, as
        Triton counts it) at `version` (None: the model's default), when it ends, whatever
        becomes of its answer: Triton's inference count, last inference and batch_stats
        (statistics.py reads them, as /metrics does)."""
        label = version or (self.live.version_of(model) if self.live.version_of is not None
                            else self.version)
        now_ms = int(time.time() * 1000)
        for counters in (self.counters.setdefault(model, ModelCounters()),
                         self.by_version.setdefault((model, label), ModelCounters())):
            counters.inferences += rows
            counters.last_inference_ms = max(counters.last_inference_ms, now_ms)
            batch = counters.batches.setdefault(rows, [0, 0.0])
            batch[0] += 1
            batch[1] += compute_s * 1e6

    def unserved(self, route: str, code: int) -> None:
        """Count one request refused before it reached a model (its name or version)."""
        self.unserved_requests.labels(route, str(code)).inc()

    def render(self) -> bytes:
        """The text exposition, Triton's counters typed `counter` under their own names."""
        text = generate_latest(self.registry)
        for name in TRITON_COUNTERS:
            text = text.replace(f"# TYPE {name} untyped\n".encode(),
                                f"# TYPE {name} counter\n".encode())
        return text


class _LiveCollector(Collector):
    """Triton-named counters and the gauges read from executors and queues at scrape time."""

    def __init__(
        self,
        models: Mapping[str, Executor],
        admission: Callable[[str], Admission | None],
        counters: Mapping[str, ModelCounters],
        version: str,
    ) -> None:
        self.models = models
        self.admission = admission
        self.counters = counters
        self.version = version
        #: A model's version label (model control: the version its unversioned requests
        #: reach); None: `version` for every model
        self.version_of: Callable[[str], str] | None = None
        #: Triton's counters per (model, version label) (ServerMetrics.by_version)
        self.by_version: Mapping[tuple[str, str], ModelCounters] = {}

    def describe(self) -> list[Metric]:
        return []  # names vary with the models served; nothing to check at registration

    def _versions(self, model: str, default: str) -> list[str]:
        """The version labels of `model` with counts, and its default version's."""
        found = {v for (m, v) in list(self.by_version) if m == model}
        return sorted(found | {default}, key=lambda v: (len(v), v))

    def collect(self) -> Iterator[Metric]:
        families = {name: Metric(name, doc, "unknown") for name, doc in TRITON_COUNTERS.items()}
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Inference requests waiting for an execution slot.", labels=["model", "version"],
        )
        gauges = {
            "asyncgraph_frames_in_use": "Execution frames in use.",
            "asyncgraph_frames": "Execution frames allocated (in use and idle).",
            "asyncgraph_frames_max": "The most execution frames the executor allocates.",
            "asyncgraph_frame_waiters": "Executions waiting inside the executor for a frame.",
            "asyncgraph_running_requests": "Inference requests holding an execution slot.",
            "asyncgraph_queued_requests": "Inference requests queued for an execution slot.",
            "asyncgraph_batch_queued_requests": "Requests waiting in the dynamic batcher.",
            "asyncgraph_queued_bytes": "Request body bytes admitted and not yet running.",
            "asyncgraph_expected_wait_seconds": "Expected wait of a request arriving now, for "
                                                "the decodes ahead or a slot (0 until "
                                                "measured).",
            "asyncgraph_service_rate": "Measured requests per second at full load: the slower "
                                       "of the slots and the event loop (0 until calibrated "
                                       "or the first completion).",
            "asyncgraph_decode_seconds": "Mean time a request body takes to decode (0 until "
                                         "measured).",
            "asyncgraph_loop_seconds": "Mean event-loop time a request costs outside its "
                                       "slot, as the admission estimate counts it (0 until "
                                       "measured).",
            "asyncgraph_decode_bytes_per_second": "Request body bytes decoded per second, "
                                                  "which prices a body's decode by its size "
                                                  "(0 until measured).",
            "asyncgraph_calibrated": "1 when the admission estimate was calibrated at "
                                     "start-up, else 0.",
        }
        refusals = CounterMetricFamily(
            "asyncgraph_admission_refusals",
            "Requests refused at admission (503), by reason: deadline, max_queue, "
            "max_queue_bytes.", labels=["model", "reason"],
        )
        batching = {
            "asyncgraph_batches": "Executions of stacked requests (dynamic batching).",
            "asyncgraph_batch_rows": "Rows (dim 0) run in batches; / asyncgraph_batches = "
                                     "mean batch size.",
        }
        totals = {name: CounterMetricFamily(name, doc, labels=["model"])
                  for name, doc in batching.items()}
        live = {
            name: GaugeMetricFamily(name, doc, labels=["model"]) for name, doc in gauges.items()
        }
        for model, ex in list(self.models.items()):
            v = self.version_of(model) if self.version_of is not None else self.version
            batches = ex.batching_statistics()
            for version in self._versions(model, v):
                c = self.by_version.get((model, version), ModelCounters())
                # the default version's Executor batches: its executions are its batches
                executions = (batches.batches if batches is not None and version == v
                              else c.success)
                _triton_samples(families, {"model": model, "version": version}, c, executions)
            frames = ex.statistics().frames
            gate = self.admission(model)
            admitted = gate.statistics() if gate else None
            pending.add_metric([model, v], gate.queued if gate else 0)
            for reason in REASONS:
                refusals.add_metric(
                    [model, reason], admitted.refused[reason] if admitted else 0)
            for name, value in (
                ("asyncgraph_frames_in_use", frames.in_use),
                ("asyncgraph_frames", frames.total),
                ("asyncgraph_frames_max", frames.max_frames),
                ("asyncgraph_frame_waiters", frames.waiters),
                ("asyncgraph_running_requests", gate.running if gate else 0),
                ("asyncgraph_queued_requests", gate.queued if gate else 0),
                ("asyncgraph_batch_queued_requests", batches.queued if batches else 0),
                ("asyncgraph_queued_bytes", admitted.queued_bytes if admitted else 0),
                ("asyncgraph_expected_wait_seconds",
                 admitted.expected_wait_s if admitted else 0),
                ("asyncgraph_service_rate", (admitted.service_rate or 0) if admitted else 0),
                ("asyncgraph_decode_seconds", (admitted.mean_decode_s or 0) if admitted else 0),
                ("asyncgraph_loop_seconds", admitted.loop_s if admitted else 0),
                ("asyncgraph_decode_bytes_per_second", _per_second(
                    admitted.decode_s_per_byte if admitted else None)),
                ("asyncgraph_calibrated", int(admitted is not None
                                              and admitted.calibration is not None)),
            ):
                live[name].add_metric([model], value)
            if batches is not None:
                totals["asyncgraph_batches"].add_metric([model], batches.batches)
                totals["asyncgraph_batch_rows"].add_metric([model], batches.rows)
        yield from families.values()
        yield pending
        yield from live.values()
        yield from totals.values()
        yield refusals


def _triton_samples(
    families: Mapping[str, Metric], labels: dict[str, str], c: ModelCounters, executions: int
) -> None:
    """One model version's samples of Triton's counters."""
    families["nv_inference_request_success"].add_sample(
        "nv_inference_request_success", labels, c.success)
    for reason in (REJECTED, CANCELED, BACKEND, OTHER):
        families["nv_inference_request_failure"].add_sample(
            "nv_inference_request_failure", {**labels, "reason": reason},
            c.failure.get(reason, 0))
    for name, value in (
        ("nv_inference_count", c.inferences),
        ("nv_inference_exec_count", executions),
        ("nv_inference_request_duration_us", c.request_us),
        ("nv_inference_queue_duration_us", c.queue_us),
        ("nv_inference_compute_input_duration_us", c.compute_input_us),
        ("nv_inference_compute_infer_duration_us", c.compute_us),
        ("nv_inference_compute_output_duration_us", c.compute_output_us),
    ):
        families[name].add_sample(name, labels, value)


def _count(
    counters: ModelCounters, total_s: float, timing: Sequence[float], failure: str | None
) -> None:
    """Add one request to Triton's counters: `timing` as ServerMetrics.observe's."""
    if failure is None:
        counters.success += 1
        counters.request_us += total_s * 1e6
    else:
        counters.failure[failure] = counters.failure.get(failure, 0) + 1
        counters.fail_us += total_s * 1e6
    for index, attribute in enumerate(
        ("queue_us", "compute_us", "compute_input_us", "compute_output_us")
    ):
        if len(timing) > index:
            setattr(counters, attribute, getattr(counters, attribute) + timing[index] * 1e6)


def _per_second(seconds_per_unit: float | None) -> float:
    """A rate from a mean time per unit; 0 until measured."""
    return 1.0 / seconds_per_unit if seconds_per_unit else 0.0
