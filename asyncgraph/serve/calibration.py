"""Start-up calibration: what one representative request costs, before any request comes.

The admission gate (admission.py) admits a request with a deadline by its expected wait, which
it predicts from measured means: decode time, execution (slot) time, encode time. A fresh
server has measured nothing, so without calibration it could promise nothing and refused
every request of a first burst beyond its slots, many of which it could have answered in time.

When the app starts (its lifespan, before it takes traffic), `calibrate` builds a request for
each model from its input specs (random values of the exported example's shape, so a dynamic
dimension takes its example size: `asyncgraph.tools.compare.random_flat_inputs`), encodes it
as a client's JSON body, and times a few rounds of what the server does with a request: decode
that body, execute it once, encode the JSON response. The first round warms the model up and
is not counted; the median of the timed rounds seeds the gate (decode time per body byte, so a
larger body of the same model is priced by its size; execution time as the mean slot time;
encode time), and live measurements take over through the gate's running means.

It is cheap: at most `ROUNDS` timed rounds, and none started once `BUDGET_S` has passed (a
small model: a few ms in all; a model whose execution takes longer than the budget: two
executions). A model whose inputs cannot be synthesised, which fails on random inputs or
takes more than `TIMEOUT_S` is not calibrated: the app logs why, once, and its gate predicts
nothing until the first request completes (admitting, meanwhile, only what its slots hold).
Nor is a program that mutates its buffers (a counter, running statistics): executing it on
made-up inputs would change the state its first real request sees.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from asyncgraph.graph.ir import OutputKind
from asyncgraph.runtime.executor import Executor
from asyncgraph.serve.admission import Calibration
from asyncgraph.serve.codec import InferRequest, json_request_body
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.tools.compare import random_flat_inputs

#: Timed rounds at most (after one round of warm-up that is not counted).
ROUNDS = 5
#: No timed round starts once calibration has taken this long (one always runs).
BUDGET_S = 0.25
#: A calibration that takes longer than this is abandoned (the model is left uncalibrated).
TIMEOUT_S = 10.0

Decode = Callable[[bytes, str | None, ModelInterface], InferRequest]
Encode = Callable[[str, InferRequest, list[Any], str], tuple[bytes, dict[str, str]]]


def representative_body(executor: Executor, iface: ModelInterface) -> bytes:
    """A JSON request body for the model: random values of its example input shapes."""
    flat = random_flat_inputs(executor.graph)
    return json_request_body({info.name: flat[info.position] for info in iface.inputs})


async def calibrate(
    executor: Executor,
    iface: ModelInterface,
    decode: Decode,
    encode: Encode,
    *,
    clock: Callable[[], float] = time.perf_counter,
    rounds: int = ROUNDS,
    budget_s: float = BUDGET_S,
    timeout_s: float = TIMEOUT_S,
) -> Calibration:
    """Time decode, execution and encode of a representative request (module docstring);
    raises what the model raised, or TimeoutError past `timeout_s`; refuses (ValueError) a
    program that mutates its buffers."""
    mutated = [str(o.target) for o in executor.graph.signature.outputs
               if o.kind is OutputKind.BUFFER_MUTATION]
    if mutated:
        raise ValueError(
            f"the program mutates its buffers ({', '.join(mutated)}): calibrating would run "
            "it on made-up inputs and change the state its first request sees"
        )
    body = representative_body(executor, iface)
    async with asyncio.timeout(timeout_s):
        await _round(executor, iface, body, decode, encode, clock)  # warm-up
        started = time.perf_counter()
        samples = [await _round(executor, iface, body, decode, encode, clock)]
        while len(samples) < rounds and time.perf_counter() - started < budget_s:
            samples.append(await _round(executor, iface, body, decode, encode, clock))
    phases = zip(*samples, strict=True)
    decode_s, execute_s, encode_s = (statistics.median(phase) for phase in phases)
    return Calibration(len(body), decode_s, execute_s, encode_s, len(samples))


async def _round(
    executor: Executor,
    iface: ModelInterface,
    body: bytes,
    decode: Decode,
    encode: Encode,
    clock: Callable[[], float],
) -> tuple[float, float, float]:
    """One request's decode, execution and encode times."""
    t0 = clock()
    request = decode(body, None, iface)
    t1 = clock()
    outputs = await executor.execute_flat(request.inputs)
    t2 = clock()
    encode(iface.model, request, outputs, "1")
    return t1 - t0, t2 - t1, clock() - t2
