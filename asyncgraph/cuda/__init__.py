"""CUDA: streams and events for the GPU nodes of a graph.

- `streams`: pure planning, testable without a GPU: which stream each CUDA node is enqueued
  on, and which cross-stream edges need an event.
- `device`: the thin torch.cuda layer that carries a StreamPlan out (stream sets per
  execution, events, host waits), behind a Backend protocol so that tests can run it on a
  simulated GPU; `host_wait`: the one thread that blocks on events the loop stopped polling.
- `capturable`: what may be captured (the per-node predicate, the whole-execution plan), pure;
  `segments`: the plan of captured segments of a program not wholly capturable, pure.
- `capture`: what every capture shares (counters, the capture lock, capture-stream leases,
  the per-frame LRU, copy-in and clone-out); `graphs`: whole executions captured per frame and
  input signature after warm-up, replayed with one launch; `segment_graphs`: the same for
  segments.

- `backend`: the "cuda" DeviceBackend (runtime/device.py's seam), registered by
  asyncgraph/plugins.py: it makes the plans above and hands the Executor their `CudaPlans`.

The runtime never imports this package: it asks the device registry for "cuda" when a program
has CUDA nodes, and a plan's frame state for a frame's GPU state. This package reads only
public runtime names; nothing here knows about the loop.
"""
