"""The scripts of asyncgraph's benchmarks that need heavy peers or another environment, run
from a source checkout: `python -m benchmarks.ort` (ONNX Runtime), `benchmarks.perf_analyzer`
(NVIDIA's perf_analyzer against `asyncgraph serve`), `benchmarks.nativert_compare` (nativert
and AOTInductor, in torch 2.11's venv), `benchmarks.gpu`, `benchmarks.overhead` and the
others here; results/ holds the recorded runs.

The suite `asyncgraph bench` runs, its harness and its default scenarios are the installed
package asyncgraph.bench; these scripts import them from there, and `asyncgraph bench -s
onnxruntime` / `-s perf-analyzer` import ort.py / perf_analyzer.py from this folder.
"""
