"""The benchmark suite behind `asyncgraph bench`: asyncgraph and its peers side by side.

Installed with the package, so `pip install 'asyncgraph[cli]'` runs `asyncgraph bench` with
no source checkout. `suite.py` runs the scenarios in one process (progress, tables, JSON, the
targets); one module per default scenario: `chain.py` (target 1), `transformer.py` (2),
`wide.py` (3), `concurrency.py` (4, "concurrent"), `memory.py` (5), `steady_state.py` (6);
`harness.py` times the peers alternately (medians, ratios, targets), `peers.py` builds them
(a plain loop, eager, `ep.module()`, torch.fx.Interpreter, dask where it imports) and
`models.py` the exported programs. Nothing here is imported by the runtime; the CLI imports it
when the command runs.

A source checkout's benchmarks/ folder keeps what needs heavy peers or another environment
(ONNX Runtime, perf_analyzer, nativert in torch 2.11's venv, a GPU, Ray) and the recorded
results; its scripts import the harness and the shared scenarios from here.
"""
