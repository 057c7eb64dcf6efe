"""What the scripted and ONNX delegates share: the builder thread and the plain nodes.

Both answer a run of aten nodes faster than the plain graph once they have made something
for it (a TorchScript trace per input signature, an ONNX Runtime session per weights version),
and both make that off the calling thread, which may be the event loop's: until it is ready,
the run's fx module (its plain nodes, the ops the graph would have called) answers, and its
outputs are what the faster form is checked against. So each delegate has:

- a `BuilderThread`: one helper thread at a time, started on demand through
  runtime/threads.py's `start_thread` (a thread started from a stepped-back worker would
  otherwise run stepped back for its whole life), working through what the delegate queued
  under the helper's lock and ending when nothing is left; `aclose` drops what is queued and
  waits, off the loop, for what is running, so a closed Executor leaves no thread behind;
- `run_plain`: the fx module on a call's inputs, and on failure the nodes one by one, so that
  the error names the aten node that failed, as the scheduler names a failing node;
- `mismatch`: whether a faster form's outputs are the plain nodes' (to float rounding);
- `timed_against_plain`: whether the faster form is faster, per signature: a short segment
  whose call into ONNX Runtime or TorchScript costs more than its nodes stays plain.

A new delegate of the same kind (OpenVINO, say) takes these instead of copying them; what it
registers is runtime/delegates.py's SegmentBackend (docs/compiled.md).
"""

from __future__ import annotations

import operator
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch
import torch.fx

from asyncgraph.runtime.threads import start_thread

# how far a faster form's float results may be from the plain nodes': rtol, and atol relative
# to the output's largest magnitude (other kernels, other summation orders)
CHECK_TOLERANCE = {torch.float16: (1e-2, 1e-3), torch.float32: (1e-4, 1e-5),
                   torch.float64: (1e-7, 1e-9)}

# Per segment and signature, once its faster form is made (and checked): the form and the plain
# nodes each run the same inputs TIMED_RUNS times, alternating, on the builder thread; when the
# form's median is over SLOWER_BY times the plain nodes' (a short segment, where the call into
# ONNX Runtime or TorchScript costs more than the nodes themselves), the signature stays plain.
# The margin favours the form: under many callers it runs with the GIL released, while the plain
# nodes hold it between kernels.
TIMED_RUNS = 16
SLOWER_BY = 1.25


class BuilderThread:
    """A delegate's helper thread: at most one runs, started when work is queued and none
    runs, ending when its target finds nothing left (`finish`).

    `lock` guards the delegate's queue as well as the thread (the delegate takes it as its own
    lock), so queueing work and seeing whether a thread will take it are one step.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)  # notified when the thread ends
        self.thread: threading.Thread | None = None
        self.closed = False  # set by aclose: the delegate queues nothing more

    @property
    def running(self) -> bool:
        """Whether a thread (or an inline build, `claim`) is working through the queue."""
        return self.thread is not None

    def start(self, target: Callable[[], None], name: str) -> bool:
        """With `lock` held: start a thread named `name` running `target` unless one runs.
        False when no thread could be had: the caller drops what it queued (the call that
        queued it has its answer already)."""
        if self.thread is not None:
            return True
        thread = threading.Thread(target=self.run, args=(target,), name=name)
        try:
            start_thread(thread)  # at the loop's priority, not a worker's
        except RuntimeError:
            return False
        self.thread = thread
        return True

    def claim(self) -> None:
        """With `lock` held: the calling thread works through the queue itself (tests), by
        calling `run` once it has let go of the lock."""
        self.thread = threading.current_thread()

    def finish(self) -> None:
        """With `lock` held, from the target when nothing is left: the thread ends."""
        self.thread = None
        self._idle.notify_all()

    def run(self, target: Callable[[], None]) -> None:
        """What the thread (or a `claim`ing caller) runs: `target`, and whatever it raised,
        never a thread that `wait_idle` and `aclose` wait for forever."""
        try:
            target()
        finally:
            with self.lock:
                if self.thread is threading.current_thread():  # it raised: not finished
                    self.finish()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no thread runs; False when `timeout` passed first."""
        with self.lock:
            return self._idle.wait_for(lambda: self.thread is None, timeout)

    async def aclose(self) -> None:
        """Queue nothing more (the target drops what is queued) and wait, without holding the
        loop, for the work in progress."""
        with self.lock:
            self.closed = True
        if self.thread is not None:
            await anyio.to_thread.run_sync(self.wait_idle)


def run_plain(module: torch.fx.GraphModule, inputs: Sequence[Any], segment: str) -> list[Any]:
    """The run's plain nodes (its fx module) on `inputs`; when they fail, the error of the
    node that failed, with a note naming it and `segment`."""
    try:
        return list(module(*inputs))
    except Exception:
        run_nodes_naming_failure(module, inputs, segment)  # raises the failing node's error
        raise


def run_nodes_naming_failure(module: torch.fx.GraphModule, inputs: Sequence[Any],
                             segment: str) -> None:
    """Run a segment's fx nodes one by one: the failing one's error gets a note naming it and
    the segment, as the scheduler names a failing node (a delegate reruns a failed call this
    way: a trace's or a session's error names no node)."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    for node in module.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            try:
                env[node] = node.target(*args, **kwargs)
            except Exception as exc:
                exc.add_note(f"While executing %{node.name} = {node.target}(...) in {segment}")
                raise


def mismatch(actual: Sequence[torch.Tensor], expected: Sequence[Any]) -> str:
    """"" when `actual` are the plain nodes' outputs `expected` (floats within
    CHECK_TOLERANCE, others equal), else the first difference, named by output."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, the plain nodes {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not isinstance(e, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return f"output {k}: {a.dtype}{list(a.shape)}, the plain nodes' {_describe(e)}"
        tolerance = CHECK_TOLERANCE.get(e.dtype)
        if tolerance is None:
            if not torch.equal(a, e):
                return f"output {k} differs from the plain nodes'"
            continue
        rtol, atol = tolerance
        finite = e[torch.isfinite(e)]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        if not torch.allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True):
            diff = float((a.double() - e.double()).abs().nan_to_num(0.0).max())
            return f"output {k} differs from the plain nodes' by up to {diff:.3g}"
    return ""


def timed_against_plain(form: Callable[[], Any], plain: Callable[[], Any],
                        runtime: str) -> tuple[tuple[float, float], str]:
    """The medians of TIMED_RUNS calls of `form` and of `plain`, alternating (seconds), and ""
    when the form is about as fast as the plain nodes or faster (within SLOWER_BY), else why
    the signature stays plain (`runtime` names what runs the form: "ONNX Runtime")."""
    clock = time.perf_counter
    form_s, plain_s = [], []
    for _ in range(TIMED_RUNS):
        start = clock()
        form()
        middle = clock()
        plain()
        form_s.append(middle - start)
        plain_s.append(clock() - middle)
    medians = statistics.median(form_s), statistics.median(plain_s)
    if medians[0] <= SLOWER_BY * medians[1]:
        return medians, ""
    return medians, (f"the plain nodes ran faster: {medians[1] * 1e6:.0f} us against "
                     f"{runtime}'s {medians[0] * 1e6:.0f} us (medians of {TIMED_RUNS} runs "
                     "each, alternating)")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def same_tensors(held: tuple[Any, ...], weights: tuple[Any, ...]) -> bool:
    """Whether `held` are `weights`, object by object: a swap makes new tensor objects for
    what it replaces, so identity tells weights versions apart without reading a byte."""
    return len(held) == len(weights) and all(map(operator.is_, held, weights))


def first_line(exc: BaseException) -> str:
    """`exc` as "Type: its message's first line" (at most 200 characters), for statistics
    and logs; an exception without a message is its type and ": "."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
