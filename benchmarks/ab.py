"""Two versions of asyncgraph side by side: the same workloads, alternating in one run.

A change to the run loop must leave its speed as it was; this measures that. Each round runs
one process per version (its source tree first on PYTHONPATH), the versions alternating, so
that the machine's load drifts over both alike; each process builds every workload, warms
it, and times it through the public API only (`Executor`, `execute`), so both versions run
the very same benchmark code. Reported: per workload, each version's median over the rounds,
the ratio after/before of the medians, and the spread of the per-round ratios.

    python -m benchmarks.ab --before /path/to/old/tree --after . --rounds 5
    python -m benchmarks.ab --before /tmp/old --after . --json results.json

Workloads (torch at 1 intra-op thread, as the suite runs):
  one_node       a one-node graph (relu, 8x64), one caller: us per execute (fixed cost)
  chain          1,000 relu nodes, one caller: us per node
  encoder        nn.TransformerEncoder, 2 layers, hidden 128, seq 16, batch 1: us per execute
  bert_64        transformers BertModel (2 layers, hidden 128, 4 heads, seq 16), 64 callers
                 unbatched: executions/s
  bert_onnx      the same model with segments=("onnx",) and 2 intra-op threads, one caller:
                 us per execute (the ONNX Runtime table's path)
  branches_8     4 branches of 3 matmuls (256x256) on worker threads, 8 callers: executions/s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

WORKLOADS = ("one_node", "chain", "encoder", "bert_64", "bert_onnx", "branches_8")
HIGHER_IS_BETTER = {"bert_64", "branches_8"}


# -- the worker: one version, every workload -------------------------------------------------


def _models() -> dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    import torch

    class Relu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(1000):
                x = torch.relu(x)
            return x

    class Branches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 3, 256, 256) / 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            outs = []
            for b in range(4):
                y = x
                for i in range(3):
                    y = torch.tanh(y @ self.w[b, i])
                outs.append(y)
            return torch.stack(outs).sum(0)

    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=512, vocab_size=1000)).eval()

    class Bert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids).last_hidden_state

    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0), 2,
        enable_nested_tensor=False,
    ).eval()
    ids = torch.randint(0, 1000, (1, 16))
    return {
        "one_node": (Relu(), (torch.randn(8, 64),), {}),
        "chain": (Chain(), (torch.randn(8, 64),), {}),
        "encoder": (encoder, (torch.randn(1, 16, 128),), {}),
        "bert_64": (Bert(), (ids,), {}),
        "bert_onnx": (Bert(), (ids,), {"segments": ("onnx",), "intra_op_threads": 2}),
        "branches_8": (Branches(), (torch.randn(16, 256),), {}),
    }


async def _latency_us(call: Callable[[], Awaitable[Any]], seconds: float) -> float:
    """Median us of back-to-back calls over about `seconds` (after a warm-up of the same)."""
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 20:
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[len(samples) // 5:]) * 1e6


async def _throughput(call: Callable[[], Awaitable[Any]], callers: int, each: int) -> float:
    """Executions per second of `callers` concurrent callers making `each` calls."""

    async def caller() -> None:
        for _ in range(each):
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return callers * each / (time.perf_counter() - start)


async def _run_worker(seconds: float, only: Sequence[str] = WORKLOADS) -> dict[str, Any]:
    import torch

    import asyncgraph
    from asyncgraph import Executor, ExecutorConfig

    torch.set_num_threads(1)
    results: dict[str, Any] = {"asyncgraph": asyncgraph.__file__}
    for name, (model, args, config) in _models().items():
        if name not in only:
            continue
        ep = torch.export.export(model, args)
        async with Executor(ep, ExecutorConfig(**config)) as ex:

            async def call(ex: Executor = ex, args: tuple[Any, ...] = args) -> Any:
                return await ex.execute(*args)

            if name in HIGHER_IS_BETTER:
                callers = 64 if name == "bert_64" else 8
                await _throughput(call, callers, 20)  # warm: placement, schedules, threads
                results[name] = await _throughput(call, callers, int(40 * seconds))
            else:
                await _latency_us(call, seconds / 2)  # warm
                us = await _latency_us(call, seconds)
                results[name] = us / 1000 if name == "chain" else us  # chain: per node
    return results


# -- the parent: alternate the versions ----------------------------------------------------


def _one_round(tree: Path, seconds: float, only: Sequence[str]) -> dict[str, float]:
    """One worker process on `tree`'s asyncgraph: run as a script from that tree, so that
    nothing but PYTHONPATH decides which asyncgraph it imports (it says which it did)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, __file__, "--worker", "--seconds", str(seconds), "--only", *only],
        env=env, cwd=tree, capture_output=True, text=True, check=False, timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the worker on {tree} failed:\n{out.stderr[-3000:]}")
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    imported = Path(result.pop("asyncgraph"))
    if not imported.is_relative_to(tree):
        raise RuntimeError(f"the worker for {tree} imported asyncgraph from {imported}")
    return result


def compare(
    before: Path, after: Path, rounds: int, seconds: float, only: Sequence[str] = WORKLOADS
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(rounds):
        order = (("before", before), ("after", after))
        for side, tree in order if i % 2 == 0 else reversed(order):
            runs[side].append(_one_round(tree, seconds, only))
            print(f"round {i + 1}/{rounds} {side}: {runs[side][-1]}", file=sys.stderr)
    table: dict[str, Any] = {}
    for name in only:
        b = [r[name] for r in runs["before"]]
        a = [r[name] for r in runs["after"]]
        ratios = [y / x for x, y in zip(b, a, strict=True)]
        table[name] = {
            "unit": "executions/s" if name in HIGHER_IS_BETTER
            else "us per node" if name == "chain" else "us per execute",
            "before": statistics.median(b),
            "after": statistics.median(a),
            "after/before": statistics.median(a) / statistics.median(b),
            "round ratios": [round(r, 3) for r in ratios],
            "higher is better": name in HIGHER_IS_BETTER,
        }
    return {"rounds": rounds, "seconds": seconds, "load": os.getloadavg(), "workloads": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the old version's source tree")
    parser.add_argument("--after", type=Path, default=Path("."), help="the new version's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per workload")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="the workloads to run (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(asyncio.run(_run_worker(options.seconds, options.only))))
        return
    if options.before is None:
        parser.error("--before is required")
    report = compare(options.before.resolve(), options.after.resolve(), options.rounds,
                     options.seconds, options.only)
    for name, row in report["workloads"].items():
        print(f"{name:12s} {row['unit']:15s} before {row['before']:10.2f}  after "
              f"{row['after']:10.2f}  after/before {row['after/before']:.3f}  "
              f"rounds {row['round ratios']}")
    if options.json is not None:
        options.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
