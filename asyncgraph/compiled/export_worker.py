"""Exporting a segment in a process of its own, for builds that run while the loop serves.

Why: a fast form (runtime/forms.py) is built on a thread of the serving process. Its first
export (torch.export, then torch.onnx's translation and onnxscript's optimiser: about a second
for tiny BERT on 2 cores) is Python and C++ that hold the GIL, some of it for tens of
milliseconds at a time (loading onnxscript's extensions, building the registry of ONNX
functions), and the event loop's thread waits for the GIL meanwhile: the first burst of
requests saw the loop stall for 75-340 ms. In a child process the export shares no GIL with the
loop; the serving process only unpickles the bytes (and keeps them in the disk cache,
export_cache.py, so a restart needs no child at all).

How: onnx_export.py's `export_elsewhere` runs `python -m asyncgraph.compiled.export_worker`
(this module's `main`), which reads one pickled job from stdin (the
segment's fx module and its input specs), exports it as onnx_export.py does in process, and
writes a pickled answer to stdout: the OnnxModel, or why the export failed (and the aten op
it failed on, by name: the caller leaves that op out of the run and tries again). The child
runs at the lowest priority and one intra-op thread, with the parent's `sys.path`, and is
started with `subprocess` (not multiprocessing: a spawned child would import the
application's `__main__` again).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch

from asyncgraph.compiled.onnx_export import ExportFailed


def main() -> int:
    from asyncgraph.compiled import onnx_export
    from asyncgraph.runtime.threads import step_back

    step_back(19, idle=True)
    torch.set_num_threads(1)
    module, specs = pickle.loads(sys.stdin.buffer.read())
    answer: tuple[Any, ...]
    try:
        answer = ("ok", onnx_export._export(module, specs))
    except ExportFailed as failed:
        answer = ("failed", failed.reason, str(failed.op) if failed.op is not None else None)
    sys.stdout.buffer.write(pickle.dumps(answer))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
