"""AOTInductor-compiled segments: nativert's delegate nodes (AOTIModelContainerRunner).

`asyncgraph compile MODEL.pt2 -o MODEL.aoti.pt2 [--segments auto|whole]` (compile_program)
compiles runs of CPU aten nodes of an exported program with
torch._inductor.aoti_compile_and_package and writes them, with the original program, into one
.pt2 (package.py). `asyncgraph.load(path, trust_compiled=True)` imports the program as usual
and replaces each run by one delegate node (delegate.py) that the scheduler runs like any
kernel: on a worker thread, cancellable between segments, profiled and traced under its name
(`aoti_segment_0`). The nodes outside the segments stay interpreted.

Weights are inputs of the compiled segments, not constants inside them. AOTInductor can bake
weights into the model and swap them with the runner's constant-buffer update
(update_constant_buffer), but that buffer is shared by every call of the runner: updated in
place, it would change the weights under executions already running, and asyncgraph's
swap_weights promises that a running execution finishes on the weights version it started
with (asyncgraph/runtime/weights.py). Passed as inputs, the weights come from the execution's
frame like for any other node, so a swap is the ordinary one: no recompile, no buffer update,
the guarantee kept. What it costs: inductor cannot constant-fold or pre-pack weights (freezing),
so a compiled segment calls the same matmul kernels as the plain graph and gains from fusing
the elementwise work around them.
"""

from asyncgraph.compiled.build import CompileReport, FailedSegment, compile_program
from asyncgraph.compiled.delegate import AOTIDelegate
from asyncgraph.compiled.package import SegmentRecord, load_compiled
from asyncgraph.compiled.segments import Segment, find_segments

__all__ = [
    "AOTIDelegate",
    "CompileReport",
    "FailedSegment",
    "Segment",
    "SegmentRecord",
    "compile_program",
    "find_segments",
    "load_compiled",
]
