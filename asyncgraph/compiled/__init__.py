"""AOTInductor-compiled segments: nativert's delegate nodes (AOTIModelContainerRunner).

`asyncgraph compile MODEL.pt2 -o MODEL.aoti.pt2 [--segments auto|whole]` (compile_program)
compiles runs of CPU aten nodes of an exported program with
torch._inductor.aoti_compile_and_package and writes them, with the original program, into one
.pt2 (package.py). `asyncgraph.load(path, trust_compiled=True)` imports the program as usual
and replaces each run by one delegate node (delegate.py) that the scheduler runs like any
kernel: on a worker thread, cancellable between segments, profiled and traced under its name
(`aoti_segment_0`). The nodes outside the segments stay interpreted. A segment is called
through its AOTI model's C entry point with the GIL released (native_call.py), so on a worker it
runs beside the event loop; torch's binding, which holds the GIL, is the fallback.

Weights are constants of the compiled segments, so inductor folds them (transposed weights
are folded once, not transposed per call), and `swap_weights` reaches them with AOTInductor's
constant-buffer update, never a recompile. The buffer of one AOTI container is shared by all
its calls, while asyncgraph promises that a running execution finishes on the weights version
it started with (asyncgraph/runtime/weights.py): so each delegate keeps up to two containers
and runs a call on the one whose buffer holds that execution's weight tensors (delegate.py);
a swap loads the new version into the spare one before executions see it.

`compare_with_plain(package)` (compare.py) times a package against the plain graph it came
from, on the example inputs; `asyncgraph compile` prints the verdict: a model bound by memory
bandwidth may run no faster compiled.
"""

from asyncgraph.compiled.build import CompileReport, FailedSegment, compile_program
from asyncgraph.compiled.compare import PlainComparison, compare_with_plain
from asyncgraph.compiled.delegate import AOTIDelegate
from asyncgraph.compiled.package import SegmentRecord, load_compiled
from asyncgraph.compiled.segments import Segment, find_segments

__all__ = [
    "AOTIDelegate",
    "CompileReport",
    "FailedSegment",
    "PlainComparison",
    "Segment",
    "SegmentRecord",
    "compare_with_plain",
    "compile_program",
    "find_segments",
    "load_compiled",
]
