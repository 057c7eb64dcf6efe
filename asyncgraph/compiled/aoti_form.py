"""AOTInductor packages as a fast form: the exported program compiled off the loop, and kept.

Why: on a small model the call into ONNX Runtime costs more than its kernels. The 8-layer MLP
at batch 1 ran 18.3 us a call on the ONNX form against ONNX Runtime's own 11.1 us, and 11.7 us
compiled by AOTInductor with autotuned kernels
(benchmarks/results/cpu/design_measurements.md#aoti-form). A user should not have to know to
run `asyncgraph compile` for that.

What: the "aoti" fast-form backend (asyncgraph/plugins.py) plans no segments on the
Executor's graph. Its form is a program of its own (runtime/delegates.py's
`SegmentBackend.form_program`): the Executor's ExportedProgram compiled by
`compile_program(..., autotune=True)` (compiled/build.py: each segment keeps the faster of
its autotuned and default kernels), for one intra-op thread, and loaded as `asyncgraph.load(...,
trust_compiled=True)` loads a package, on the Executor's weights:

1. the compile runs in a child process (`python -m asyncgraph.compiled.aoti_form`,
   child_process.py) under SCHED_IDLE: 16-60 s of CPU on 2 cores, which in the serving
   process would hold its GIL for seconds at a time. The child then runs the package and the
   plain graph on the program's example inputs and refuses a package whose outputs differ
   (delegate_support.py's `mismatch`);
2. the package is kept in the disk cache, `<root>/aoti/<key>.pt2` (runtime/disk_cache.py),
   keyed by the program's graph, the thread count, autotuning, and the versions and CPU that
   compiled code depends on (export_cache.py's `environment`), not by the weights. A restart
   loads it (a second or so) instead of compiling again;
3. weights: where the Executor's are the package's, value for value, the form runs on the
   package's own tensors; otherwise on the Executor's, loaded into each compiled segment's
   constant buffer as a swap loads them (compiled/delegate.py). A segment whose weights were
   packed at compile time refuses them, and the form is then not built.

Trust: a package is native code, loaded only from a cache folder owned by this user and
writable by no one else (the package itself too); otherwise the form is not built, and
`statistics().forms["passed"]` says why. `ASYNCGRAPH_AOTI_FORM=0` turns the backend off (no
compile is started; plugins.py's `_aoti_missing`), as the tests do unless they test it.

Not yet: a check per input signature (the ONNX delegate checks each signature's first call;
here only the example inputs are, and conformance covers compiled packages), and thread
counts other than one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from asyncgraph.compiled.child_process import last_line, run_child
from asyncgraph.compiled.delegate_support import first_line, mismatch
from asyncgraph.compiled.export_cache import environment
from asyncgraph.graph.importers import Program
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.disk_cache import cache_root, digest
from asyncgraph.runtime.executor import Executor

LOG = logging.getLogger("asyncgraph.forms")
KIND = "aoti"
AUTOTUNE = True  # max-autotune, each segment keeping the faster kernels (tests: False, faster)
COMPILE_TIMEOUT_S = 900.0  # a child's compile that takes longer is given up on


class FormRefused(RuntimeError):
    """Why this program gets no AOTInductor form (in `statistics().forms["passed"]`)."""


def form_program(program: Program, threads: int, runners: int) -> Program:
    """The form's Program: `program`'s package (cached, else compiled in a child process),
    loaded with `runners` runners per segment, on `program`'s weights (build thread)."""
    from asyncgraph.compiled.package import load_compiled

    if program.exported is None:
        raise FormRefused("the program is not an ExportedProgram (a .pt2 or torch.export's)")
    if threads != 1:
        raise FormRefused("AOTInductor forms are compiled for one intra-op thread")
    path = _package(program.exported, program.graph.described(), threads)
    compiled = load_compiled(path, runners=runners, threads=threads, source=program.exported)
    if _inputs(compiled.graph) != _inputs(program.graph):
        raise FormRefused(f"{path} was compiled for other inputs than the program's")
    return Program(compiled.graph, _weights(program.weights, compiled.weights),
                   f"{program.name} [{KIND}]", program.reference, compiled.exported)


def _inputs(graph: Graph) -> list[tuple[Any, ...]]:
    """The user inputs' dtypes and shapes, each symbolic dimension as None."""
    specs = [graph.values[s.value].spec for s in graph.signature.user_inputs]
    return [(spec.dtype, tuple(d if isinstance(d, int) else None for d in spec.shape))
            if isinstance(spec, TensorSpec) else (repr(spec),) for spec in specs]


def _weights(current: Mapping[str, Any], packaged: Mapping[str, Any]) -> dict[str, Any]:
    """The package's own tensors where they are `current`'s values, else `current`."""
    if set(current) != set(packaged):
        raise FormRefused(f"the package's weights {sorted(packaged)} are not the program's "
                          f"{sorted(current)}")
    same = all(_same(value, packaged[name]) for name, value in current.items())
    return dict(packaged) if same else dict(current)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def _package(ep: ExportedProgram, graph_text: str, threads: int) -> Path:
    """The cached package of `ep`, compiled first in a child process when there is none."""
    root = cache_root()
    if root is None:
        raise FormRefused("the disk cache is off")
    folder = root / KIND
    path = folder / f"{digest(KIND, environment(), graph_text, threads, AUTOTUNE)}.pt2"
    if path.exists():
        _check_own(path)
        return path
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_own(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".compiling-") as tmp:
        source, package = Path(tmp) / "program.pt2", Path(tmp) / "package.pt2"
        torch.export.save(ep, source)
        job = {"program": str(source), "package": str(package), "threads": threads,
               "autotune": AUTOTUNE}
        done = run_child(__name__, json.dumps(job).encode(), COMPILE_TIMEOUT_S, "compile",
                         FormRefused)
        try:
            answer = json.loads(done.stdout)
        except ValueError:  # a crash: no answer, the reason is on stderr
            raise FormRefused(f"the compile process exited {done.returncode}: "
                              f"{last_line(done)}") from None
        if not answer.get("ok"):
            raise FormRefused(str(answer.get("reason")))
        os.chmod(package, 0o600)
        os.replace(package, path)
    LOG.info("compiled an AOTInductor form in %.1f s: %s", answer["compile_s"], path)
    return path


def _check_own(path: Path) -> None:
    """Refuse a package, or its folder, that another user owns or others may write."""
    for each in (path, path.parent):
        status = each.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            raise FormRefused(
                f"{each} is another user's or writable by others: an AOTInductor package is "
                "native code, loaded only from a cache folder that is this user's alone")


# -- the child process ---------------------------------------------------------------------------


def main() -> int:
    """The child: compile the job's program, check the package, answer in JSON on stdout."""
    from asyncgraph.runtime.threads import step_back

    step_back(19, idle=True)
    torch.set_num_threads(1)
    job = json.loads(sys.stdin.buffer.read())
    try:
        answer = {"ok": True, **_compile_checked(job)}
    except Exception as exc:  # whatever it was, the parent gets the reason
        answer = {"ok": False, "reason": f"the compile failed: {first_line(exc)}"}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    return 0


def _compile_checked(job: Mapping[str, Any]) -> dict[str, Any]:
    from asyncgraph.compiled.build import compile_program

    ep = torch.export.load(job["program"])
    report = compile_program(ep, job["package"], "auto", autotune=bool(job["autotune"]),
                             threads=int(job["threads"]))
    if not report.segments:
        reasons = "; ".join(f.reason for f in report.failed) or "no run long enough"
        raise FormRefused(f"no segment compiled: {reasons}")
    why = asyncio.run(_differs(ep, Path(job["package"])))
    if why:
        raise FormRefused(f"its outputs differ from the plain graph's: {why}")
    return {"compile_s": round(report.compile_s, 1), "segments": len(report.segments),
            "kernels": [s.kernels for s in report.segments if s.kernels]}


async def _differs(ep: ExportedProgram, package: Path) -> str:
    """"" when the package's outputs are the plain graph's on the program's example inputs."""
    from asyncgraph.compiled.build import default_inputs
    from asyncgraph.compiled.package import load_compiled
    from asyncgraph.graph.importers import from_exported_program

    inputs = default_inputs(ep, from_exported_program(ep).graph)
    config = ExecutorConfig(fast_paths=False)
    async with Executor(ep, config) as plain, Executor(load_compiled(package), config) as aoti:
        expected = await plain.execute_flat(inputs)
        actual = await aoti.execute_flat(inputs)
    return _outputs_differ(actual, expected)


def _outputs_differ(actual: Sequence[Any], expected: Sequence[Any]) -> str:
    tensors = [isinstance(v, torch.Tensor) for v in expected]
    if len(actual) != len(expected) or any(
            t != isinstance(a, torch.Tensor) or (not t and a != e)
            for t, a, e in zip(tensors, actual, expected, strict=True)):
        return f"outputs {actual!r:.200} against {expected!r:.200}"
    return mismatch([a for a, t in zip(actual, tensors, strict=True) if t],
                    [e for e, t in zip(expected, tensors, strict=True) if t])


if __name__ == "__main__":
    sys.exit(main())
