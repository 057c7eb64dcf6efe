"""Options shared by the commands that run models, and the thread policy they apply.

Every command that runs a model takes `--threads`: torch's intra-op thread count
(ExecutorConfig.intra_op_threads). Left out, it is the usable CPUs divided by the worker
threads (max_parallel_ops), at least 1, since the workers already run kernels side by side.
A command owns its process, so it sets the count on its own thread too, the one that runs the
event loop and the inline kernels (torch.set_num_threads, in effect process-wide), and tells
its Executors to leave that thread as it set it; an Executor inside someone else's process
sets its worker threads' count and lowers the loop thread's to `loop_intra_op_threads` (1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # torch is imported by the commands, so `--help` stays quick
    from asyncgraph.runtime.config import ExecutorConfig
    from asyncgraph.runtime.executor import Executor

ModelArg = Annotated[
    Path, typer.Argument(metavar="MODEL", help="A .pt2 file written by torch.export.save.")
]

ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads", min=1,
        help="torch intra-op threads per thread that runs kernels (default: CPUs / worker "
             "threads, at least 1).",
        show_default=False,
    ),
]

InputsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input", "-i", metavar="PATH",
        help="An input file (.pt, .npy, .safetensors), as PATH or NAME=PATH; repeatable. "
             "Without it: the sample inputs saved in the file, else random ones.",
    ),
]

RandomOpt = Annotated[
    bool,
    typer.Option("--random", help="Random inputs with the program's example shapes, even when "
                 "the file has sample inputs."),
]

SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")]

# One spelling per concept, ExecutorConfig's field name where there is one; the spellings
# commands used before are read as these (OLD_SPELLINGS, rewritten by cli/main.py's _Command)
# and not shown in help.
MaxConcurrentExecutionsOpt = Annotated[
    int,
    typer.Option(
        "--max-concurrent-executions", min=1,
        help="Executions that run at once (execution frames); more wait for a frame.",
    ),
]

MaxParallelOpsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-parallel-ops", min=1,
        help="Worker threads that run kernels side by side (default: by the CPUs).",
        show_default=False,
    ),
]

OLD_SPELLINGS = {
    "--frames": "--max-concurrent-executions",
    "--max-frames": "--max-concurrent-executions",
    "--parallel-ops": "--max-parallel-ops",
    "--parallel": "--max-parallel-ops",
}

TrustCompiledOpt = Annotated[
    bool,
    typer.Option(
        "--trust-compiled",
        help="Load a package made by `asyncgraph compile`: it runs the native code inside it, "
             "so give this only for packages you built or trust.",
    ),
]

def import_modules(names: list[str] | None) -> list[str] | None:
    """Import each module named by `--import`, before the command loads its model: a program
    whose inputs or outputs nest in a library's own type (transformers' ModelOutput classes)
    can be loaded only once that library has registered the type with torch's pytree, which
    importing its module does. A module that does not import is a usage error naming it."""
    import importlib

    for name in names or ():
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or whatever the module raises as it runs
            raise typer.BadParameter(f"cannot import {name!r}: {exc}") from None
    return names


ImportsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--import", metavar="MODULE", callback=import_modules,
        help="A Python module to import before the model is loaded, for the types its inputs "
             "or outputs are made of (e.g. transformers.modeling_outputs); repeatable.",
    ),
]

ScriptSegmentsOpt = Annotated[
    bool,
    typer.Option(
        "--script-segments",
        help="Run long runs of aten nodes as TorchScript traces, made per input shape on first "
             "use: --segments script (ExecutorConfig.segments; docs/compiled.md).",
    ),
]

SegmentsOpt = Annotated[
    str | None,
    typer.Option(
        "--segments", metavar="BACKENDS",
        help="Delegate backends that run long runs of aten nodes, comma-separated, planned in "
             "this order: script (TorchScript traces), onnx (ONNX Runtime sessions; the "
             "onnxruntime extra) (ExecutorConfig.segments; docs/compiled.md).",
        show_default=False,
    ),
]


def chosen_segments(segments: str | None, script_segments: bool) -> tuple[str, ...]:
    """ExecutorConfig.segments from `--segments a,b` and `--script-segments` (script first,
    once): each name must be a registered backend (runtime/delegates.py)."""
    from asyncgraph.runtime.delegates import registered_backends

    names = [n.strip() for n in (segments or "").split(",") if n.strip()]
    if script_segments and "script" not in names:
        names.insert(0, "script")
    known = registered_backends()
    for name in names:
        if name not in known:
            raise typer.BadParameter(
                f"no segment backend named {name!r}; registered: {', '.join(known)}",
                param_hint="--segments",
            )
    if len(set(names)) != len(names):
        raise typer.BadParameter(f"{segments!r} names a backend twice", param_hint="--segments")
    return tuple(names)


def load_executor(model: Path, config: ExecutorConfig, trust_compiled: bool) -> Executor:
    """The Executor of a .pt2 file; a compiled package loads only with `trust_compiled`."""
    from asyncgraph.loading import load

    return load(model, config, trust_compiled=trust_compiled)


def executor_config(threads: int | None, **options: Any) -> ExecutorConfig:
    """An ExecutorConfig with `intra_op_threads=threads`, its thread count applied to this
    thread as well (the module docstring says why). The command owns this thread, which runs
    the loop: the Executor leaves its count as set here (`loop_intra_op_threads=None`)."""
    from asyncgraph.runtime.config import ExecutorConfig

    options.setdefault("loop_intra_op_threads", None)
    config = ExecutorConfig(intra_op_threads=threads, **options)
    apply_threads(config)
    return config


def apply_threads(config: ExecutorConfig) -> int:
    """Set torch's intra-op thread count of this thread (and of threads started later) to the
    one `config` resolves to; return it."""
    import torch

    count = config.intra_op_threads_or_default
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
