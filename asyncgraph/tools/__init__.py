"""Tools to see into an execution and to check it against eager PyTorch.

- `compare`: leaf-by-leaf comparison of two results, with paths and tolerances.
- `check`: `asyncgraph check`, a program run through eager, serial and parallel executors.
- `trace`: per-node spans as Chrome trace JSON (ExecutorConfig(trace=True)).
- `profile`: `asyncgraph profile`, per-node time and placement, built on the trace spans.
"""
