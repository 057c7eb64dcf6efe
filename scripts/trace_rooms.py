"""Follow one steady-state `Executor.execute` through the code: which files it runs in, how
often each is entered, and how many stays (runs of consecutive code in one file) it makes.

The measure of issue #53's "Done when": following the inputs of `Executor.execute`, no
runtime file entered more than twice, at most 9 stays. Python's profile hook sees every call
and return of asyncgraph's code; code outside asyncgraph (torch, anyio, asyncio) does not
end a stay, so a kernel called from the run loop and returning to it is one stay.

    python scripts/trace_rooms.py            # the default path: a small MLP, default config
    python scripts/trace_rooms.py --dataflow # a program with a worker branch: the dataflow
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import torch

import asyncgraph
from asyncgraph import Executor, ExecutorConfig, GraphBuilder

ROOT = Path(asyncgraph.__file__).resolve().parent


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layers(x))


def _add_one(x: int) -> int:
    return x + 1


def _program(dataflow: bool) -> Any:
    if not dataflow:
        return torch.export.export(_Mlp(), (torch.randn(2, 32),))
    b = GraphBuilder()
    x = b.call(_add_one, b.input("x"), name="a", placement="inline")
    b.output([b.call(_add_one, x, name="w", placement="worker"),
              b.call(_add_one, x, name="i", placement="inline")])
    return b.build()


def _holds(frame: Any, inputs: tuple[Any, ...]) -> bool:
    """Whether the call `frame` was handed the inputs: one of them, or a list or tuple
    holding one (the flat inputs, a frame's values), among its arguments."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    for name in names:
        value = frame.f_locals.get(name)
        if any(value is x for x in inputs):
            return True
        if isinstance(value, list | tuple) and any(v is x for v in value for x in inputs):
            return True
        values = getattr(value, "values", None)  # an ExecutionFrame, loaded with them
        if isinstance(values, list) and any(v is x for v in values for x in inputs):
            return True
    return False


async def _follow(ex: Executor, args: tuple[Any, ...]) -> tuple[list[str], list[str]]:
    """The asyncgraph files one execute() moves through while its code holds the inputs, in
    order, across its awaits: a call handed them enters the callee's file; its return goes
    back to the file of the nearest caller that holds them."""
    rooms: list[str] = []
    holding: set[Any] = set()
    called: list[str] = []  # the rooms entered by a call (a return goes back)

    def room_of(frame: Any) -> str | None:
        try:
            return Path(frame.f_code.co_filename).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            return None

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            room = room_of(frame)
            if room is None or not _holds(frame, args):
                return
            holding.add(frame)
            if rooms and rooms[-1] != room:
                called.append(room)
        elif event == "return" and frame in holding:
            holding.discard(frame)
            caller = frame.f_back
            while caller is not None and caller not in holding:
                caller = caller.f_back
            if caller is None:
                return
            room = room_of(caller)
        else:
            return
        if room is not None and (not rooms or rooms[-1] != room):
            rooms.append(room)

    sys.setprofile(hook)
    try:
        await ex.execute(*args)
    finally:
        sys.setprofile(None)
    return rooms, called


async def _main(dataflow: bool) -> tuple[list[str], list[str], dict[str, int]]:
    async with Executor(_program(dataflow), ExecutorConfig()) as ex:
        args = (1000,) if dataflow else (torch.randn(2, 32),)
        for _ in range(200):  # warm: profiled placement, schedules, the straight line
            await ex.execute(*args)
        rooms, called = await _follow(ex, args)
        return rooms, called, ex.statistics().modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataflow", action="store_true", help="a program with a worker branch")
    options = parser.parse_args()
    rooms, called, modes = asyncio.run(_main(options.dataflow))
    stays: dict[str, int] = {}
    for room in rooms:
        stays[room] = stays.get(room, 0) + 1
    print(" -> ".join(rooms))
    print(f"stays: {len(rooms)}; rooms: {len(stays)}; modes run: "
          f"{ {mode: n for mode, n in modes.items() if n} }")
    for room, count in sorted(stays.items(), key=lambda kv: -kv[1]):
        print(f"  {room}: {count} stays, entered by {called.count(room)} calls")


if __name__ == "__main__":
    main()
