"""What the server's tests share: polling server state, an async kernel that holds an
execution in flight, reading Prometheus samples, and `asyncgraph serve` as a subprocess."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import Graph, TensorSpec

CPU = torch.device("cpu")
WAIT_S = 20.0  # the bound on every wait for something an in-process server must do
PROCESS_WAIT_S = 60.0  # the bound on every wait for an `asyncgraph serve` process


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll server-side state that has no event to wait on, bounded by WAIT_S."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.005)


class Gate:
    """An async kernel that signals it started, then waits to be released (or cancelled)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = 0
        self.cancelled = 0

    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return x * 2


def gated_graph(gate: Any) -> Graph:
    """x (FP32 [2]) -> gate(x); the async kernel lets a test hold an execution in flight."""
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(gate, x, name="gate")
    b.output(y)
    graph = b.build()
    spec = TensorSpec(torch.float32, CPU, (2,), (2,))
    graph.values[x.id].spec = spec
    graph.values[y.id].spec = spec
    return graph


def identity_graph(dtype: torch.dtype, shape: tuple[Any, ...]) -> Graph:
    """x -> a copy of x, declared as `dtype` of `shape` (ints, or sympy symbols for dynamic
    dimensions): the smallest model the protocol codecs can be checked against."""
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(torch.clone, x, name="copy")
    b.output(y)
    graph = b.build()
    hint = tuple(d if isinstance(d, int) else 2 for d in shape)
    graph.values[x.id].spec = TensorSpec(dtype, CPU, shape, hint)
    graph.values[y.id].spec = TensorSpec(dtype, CPU, shape, hint)
    return graph


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text, matched by exact name and these labels."""
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    raise AssertionError(f"no sample {name}{labels} in metrics")


def save_linear(path: Path) -> Path:
    """A Linear(4, 3) exported with a dynamic batch (1-32), saved at `path`: the model the
    command-line tests serve."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).eval()
    batch = torch.export.Dim("batch", min=1, max=32)
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)
    return path


class Served:
    """A running `asyncgraph serve` process and the lines it has printed so far."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line)

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first line matching `pattern` (waiting for it), or fail with the output."""
        deadline = time.monotonic() + PROCESS_WAIT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, self.output()
                continue
            self.seen.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"no line matching {pattern!r} in:\n{self.output()}")

    def output(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)


@contextmanager
def serve(*args: str) -> Iterator[Served]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgraph.cli.main", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    served = Served(proc)
    try:
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=PROCESS_WAIT_S)
        served.reader.join(timeout=PROCESS_WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()
