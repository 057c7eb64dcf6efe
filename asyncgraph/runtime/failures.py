"""How an execution fails: a kernel's error with its node named, or an error of the runtime's
own steps, either of which stops the execution and reaches its caller.

Shared by the dataflow (scheduler.py) and the straight line (straight.py). On a worker thread
the frame's tasks are cancelled through the loop, the only thread that touches them.
"""

from __future__ import annotations

import contextlib

from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.backend import Loop
from asyncgraph.runtime.frame import ExecutionFrame


def fail(
    frame: ExecutionFrame, graph: Graph, node: int, exc: BaseException,
    loop: Loop | None, on_worker: bool,
) -> None:
    """Record a kernel error with node context and stop the execution."""
    add_node_note(exc, graph, node)
    stop_with(frame, exc, loop, on_worker)


def internal_error(
    frame: ExecutionFrame, exc: BaseException, loop: Loop | None, on_worker: bool
) -> None:
    """An error of the runtime's own steps, not of a kernel: it fails the execution as a
    kernel error does, so the execution still ends and its caller gets the error."""
    with contextlib.suppress(Exception):  # a type refusing attributes keeps its message
        exc.add_note(
            f"asyncgraph internal error in execution {frame.execution_id}: "
            "the execution was stopped"
        )
    stop_with(frame, exc, loop, on_worker)


def stop_with(
    frame: ExecutionFrame, exc: BaseException, loop: Loop | None, on_worker: bool
) -> None:
    """Record the execution's error, stop dispatching and cancel its async kernels."""
    with frame.lock:
        frame.errors.append(exc)
        frame.stopped = True
    if on_worker:
        # Not `if frame.tasks` here: the loop may have checked `stopped` and be about to
        # add a task (Scheduler._start_task), which this thread would miss. The cancellation
        # runs on the loop after that add, or else the task is never created; the callback
        # comes before this unit's end, hence before the frame can be released.
        assert loop is not None
        loop.call_soon_threadsafe(cancel_tasks, frame)
    elif frame.tasks:
        cancel_tasks(frame)


def cancel_tasks(frame: ExecutionFrame) -> None:
    """Cancel the frame's async kernels (loop thread: the only one touching `tasks`)."""
    for task in list(frame.tasks):
        task.cancel()


def raise_errors(frame: ExecutionFrame) -> None:
    """Raise what stopped the execution: its one error, or all of them as a group. Holds
    no reference to it once raised (a cycle through this frame in its traceback would keep
    the failed execution's values alive until a collection)."""
    errors = frame.errors
    error: BaseException = (
        errors[0] if len(errors) == 1
        else BaseExceptionGroup(f"{len(errors)} nodes failed in one execution", list(errors))
    )
    errors.clear()
    try:
        raise error
    finally:
        del error


def add_node_note(exc: BaseException, graph: Graph, index: int) -> None:
    """Name the node, its target and the user's source line, as torch.fx does."""
    node = graph.nodes[index]
    line = f"While executing %{node.name} = {node.target_name()}(...) [node {index}]"
    notes = getattr(exc, "__notes__", [])
    if line in notes:
        return
    if node.stack_trace:
        line += "\nOriginal traceback:\n" + node.stack_trace.rstrip()
    with contextlib.suppress(Exception):  # a type refusing attributes keeps its message
        exc.add_note(line)
