"""CUDA: streams and events for the GPU nodes of a graph.

- `streams`: pure planning, testable without a GPU: which stream each CUDA node is enqueued
  on, and which cross-stream edges need an event.
- `device`: the thin torch.cuda layer that carries a StreamPlan out (stream sets per
  execution, events, host waits), behind a Backend protocol so that tests can run it on a
  simulated GPU.
- `graphs`: CUDA graphs: whole executions of a capturable program captured per frame and
  input signature after warm-up, and replayed with one launch (outputs cloned out).

The runtime asks this package for a frame's GPU state; nothing here knows about the loop.
"""
