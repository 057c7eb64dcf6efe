"""`asyncgraph run` and `asyncgraph trace`: execute a model once, or trace many executions.

Both take the model as a .pt2 file and inputs as files (see asyncgraph.cli.inputs) or random
inputs that fit the signature. Heavy imports happen inside the commands, so `--help` is quick.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from asyncgraph.cli.options import (
    ImportsOpt,
    InputsOpt,
    MaxConcurrentExecutionsOpt,
    MaxParallelOpsOpt,
    ModelArg,
    RandomOpt,
    SeedOpt,
    ThreadsOpt,
    TrustCompiledOpt,
    executor_config,
    load_executor,
)

console = Console()


def _load(model: Path, threads: int | None, trust_compiled: bool, **config: Any) -> Any:
    with console.status(f"loading {model} ..."):
        return load_executor(model, executor_config(threads, **config), trust_compiled)


def run(
    model: ModelArg,
    inputs: InputsOpt = None,
    random: RandomOpt = False,
    seed: SeedOpt = 0,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Save the outputs: .safetensors, .pt or .npy."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Do not print outputs.")] = False,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
) -> None:
    """Execute a model once on inputs from files (or random ones); print or save the outputs.

    Without --input: the sample inputs saved in the file, else random ones with the shapes the
    program was exported with (--random: random ones always).
    """
    from torch.utils import _pytree as pytree

    from asyncgraph.cli.inputs import (
        check_output_path,
        chosen_inputs,
        output_names,
        save_outputs,
        summarize,
    )

    if output is not None:
        check_output_path(output)
    ex = _load(model, threads, trust_compiled)
    flat_in = chosen_inputs(ex, inputs, random, seed)

    async def once() -> tuple[list[Any], float]:
        async with ex:
            start = time.perf_counter()
            out = await ex.execute_flat(flat_in)
            return out, time.perf_counter() - start

    flat, elapsed = asyncio.run(once())
    names = output_names(ex.graph, len(flat))
    out_spec = ex.graph.signature.out_spec
    structured = pytree.tree_unflatten(flat, out_spec) if out_spec is not None else flat
    if output is not None:
        save_outputs(output, names, flat, structured)
    if not quiet:
        table = Table(title=f"{model.name}: {len(flat)} output(s) in {elapsed * 1e3:.2f} ms")
        for column in ("output", "dtype", "shape", "values"):
            table.add_column(column)
        for name, value in zip(names, flat, strict=True):
            table.add_row(name, *summarize(value))
        console.print(table)
    if output is not None:
        console.print(f"saved {len(flat)} output(s) to {output}")


def trace(
    model: ModelArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to write the Chrome trace JSON.")
    ] = Path("trace.json"),
    executions: Annotated[int, typer.Option(min=1, help="Executions to trace.")] = 20,
    warmup: Annotated[
        int, typer.Option(min=0, help="Executions before tracing, left out of the trace "
                          "(the first calls are cold: allocations, profiling).")
    ] = 3,
    concurrency: Annotated[int, typer.Option(min=1, help="Concurrent callers.")] = 4,
    max_concurrent_executions: MaxConcurrentExecutionsOpt = 2,
    max_parallel_ops: MaxParallelOpsOpt = None,
    inputs: InputsOpt = None,
    random: RandomOpt = False,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
) -> None:
    """Trace executions into Chrome trace-event JSON that ui.perfetto.dev opens.

    The first --warmup executions run untraced, so cold calls do not dominate the summary.

    One row per thread (the event loop, each worker) and CUDA stream, a slice per node with its
    op and shapes, and per execution its frame wait, queue and run time. With more callers than
    frames, executions queue for frames, and the trace shows it.
    """
    from rich.progress import Progress

    from asyncgraph.cli.inputs import check_output_path, chosen_inputs

    check_output_path(output)
    config: dict[str, Any] = {"trace": True,
                              "max_concurrent_executions": max_concurrent_executions}
    if max_parallel_ops is not None:
        config["max_parallel_ops"] = max_parallel_ops
    ex = _load(model, threads, trust_compiled, **config)
    flat_in = chosen_inputs(ex, inputs, random, seed)

    async def drive(progress: Progress) -> None:
        async def calls(label: str, count: int) -> None:
            bar = progress.add_task(label, total=count)
            remaining = iter(range(count))

            async def caller() -> None:
                for _ in remaining:
                    await ex.execute_flat(list(flat_in))
                    progress.advance(bar)

            await asyncio.gather(*(caller() for _ in range(concurrency)))

        async with ex:
            if warmup:
                await calls("warming up", warmup)
                ex.recorder.clear()
            await calls("tracing", executions)

    with Progress(console=console, transient=True) as progress:
        asyncio.run(drive(progress))
    recorder = ex.recorder
    assert recorder is not None
    recorder.save(output)
    _print_trace_summary(model, recorder, output)


def _print_trace_summary(model: Path, recorder: Any, output: Path) -> None:
    phases = recorder.execution_phases()
    table = Table(title=f"{model.name}: {len(phases)} execution(s) traced")
    for column in ("phase", "mean ms", "max ms"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for name in ("frame wait", "queue", "run"):
        durations = [(p[name][1] - p[name][0]) / 1e6 for p in phases.values() if name in p]
        if durations:
            table.add_row(name, f"{sum(durations) / len(durations):.3f}", f"{max(durations):.3f}")
    console.print(table)
    ops = Table(title="time by op (top 10)")
    for column in ("op", "calls", "total ms", "mean us"):
        ops.add_column(column, justify="right" if column != "op" else "left")
    for op in recorder.op_summary()[:10]:
        ops.add_row(op.op, str(op.calls), f"{op.total_ns / 1e6:.3f}", f"{op.mean_ns / 1e3:.1f}")
    console.print(ops)
    console.print(f"wrote {output}: open it in https://ui.perfetto.dev or chrome://tracing")
