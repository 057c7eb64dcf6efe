"""RayMetricsBridge: a replica's Prometheus metrics, copied into Ray's metrics system.

Every replica keeps the metrics of `asyncgraph serve` in its app's registry (docs/serving.md);
`GET /metrics` through Serve's proxy reaches one replica at random, so it is no way to watch a
deployment. Ray's way is its own metrics: each node's metrics agent exports what the processes
on the node recorded, and Prometheus scrapes every node (Ray writes the node list for
Prometheus's file service discovery). This bridge copies each sample of the replica's registry,
every `interval_s`, into a `ray.serve.metrics.Gauge` of the same name, which Ray tags with the
application, deployment and replica and exports as `ray_<name>`. Counters stay monotonic per
replica, so `sum by (model) (rate(ray_nv_inference_request_success[1m]))` is the deployment's
rate; histograms arrive as their `_bucket` (with `le`), `_sum` and `_count` series.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

logger = logging.getLogger("asyncgraph.ray")


class RayMetricsBridge:
    """Copies the samples of one registry into Ray gauges of the same names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._gauges: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self.published = 0  # samples copied by the last publish (statistics)

    def publish(self) -> int:
        """Copy every sample now; returns how many were copied."""
        from ray.serve.metrics import Gauge

        count = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # creation timestamps, not measurements
                entry = self._gauges.get(sample.name)
                if entry is None:
                    keys = tuple(sorted(sample.labels))
                    tag_keys: Any = keys  # ray annotates a 1-tuple; any tuple of str works
                    entry = (Gauge(sample.name, description=family.documentation,
                                   tag_keys=tag_keys), keys)
                    self._gauges[sample.name] = entry
                gauge, keys = entry
                gauge.set(float(sample.value),
                          tags={k: str(sample.labels.get(k, "")) for k in keys})
                count += 1
        self.published = count
        return count

    async def run(self, interval_s: float, until: Callable[[], bool] = lambda: False) -> None:
        """Publish every `interval_s` until `until()` or cancelled; an error is logged."""
        while not until():
            try:
                self.publish()
            except Exception:
                logger.exception("copying metrics into Ray's metrics failed")
            await asyncio.sleep(interval_s)

    def statistics(self) -> dict[str, int]:
        return {"gauges": len(self._gauges), "published": self.published}
