"""asyncgraph against nativert (torch._C._nativert.PyModelRunner), in a separate environment.

nativert is the C++ executor asyncgraph is modelled on. PyPI's torch 2.9, 2.10 and 2.11
wheels ship a working `PyModelRunner`; later wheels ship a stub with no methods, so this
comparison cannot run in the project's own environment. Make a second one:

    python3 -m venv /tmp/nrt && /tmp/nrt/bin/pip install "torch>=2.9,<2.12"
    /tmp/nrt/bin/python benchmarks/nativert_compare.py [--rounds 15] [--json]

Only torch is needed there: asyncgraph is imported from this checkout (the script maps
kernels/ to asyncgraph.kernels, as the editable install does). If asyncgraph cannot be
imported with that torch, the asyncgraph rows are left out and the others still run.

What is compared, alternating round by round, medians after warm-up, one intra-op thread:
nativert `runner.run(x)`, eager `model(x)`, `ep.module()(x)` and asyncgraph `execute(x)` on
the chain of 1,000 relu ops and the transformer encoder of the main suite. nativert runs the
core-ATen program (run_decompositions(), as its loader expects); so do the other graph peers,
while eager runs the module.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NEEDS = "a torch between 2.9 and 2.11 (PyPI wheels), whose PyModelRunner has a run() method"


def check_nativert() -> tuple[Any, str | None]:
    """PyModelRunner, or None and the reason it cannot be used here."""
    try:
        import torch
    except ImportError:
        return None, f"torch is not installed in this environment; it needs {NEEDS}"
    runner = getattr(getattr(torch._C, "_nativert", None), "PyModelRunner", None)
    if runner is None:
        return None, f"torch {torch.__version__} has no torch._C._nativert.PyModelRunner"
    if not hasattr(runner, "run"):
        return None, (
            f"torch {torch.__version__} ships PyModelRunner as a stub without run(); "
            f"this comparison needs {NEEDS}"
        )
    return runner, None


class _KernelsFinder(importlib.abc.MetaPathFinder):
    """Maps asyncgraph.kernels to kernels/ of this checkout, as the editable install does."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "asyncgraph.kernels":
            return None
        init = ROOT / "kernels" / "__init__.py"
        return importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)]
        )


def import_asyncgraph() -> tuple[Any, str | None]:
    try:
        import asyncgraph

        return asyncgraph, None
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, _KernelsFinder())
    try:
        import asyncgraph

        return asyncgraph, None
    except Exception as exc:  # an API this torch lacks, a missing dependency
        return None, f"{type(exc).__name__}: {exc}"


def package(ep: Any, directory: str, name: str) -> str:
    """Write `ep` as the PT2 archive nativert loads (model name "forward")."""
    import torch

    path = f"{directory}/{name}.pt2"
    torch.export.pt2_archive._package.package_pt2(path, exported_programs={"forward": ep})
    return path


def workloads() -> list[tuple[str, Any, Any, Any]]:
    """(name, model, core-ATen exported program, input) for each compared graph."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.models import ReluChain, encoder

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain = ReluChain(1000)
        x = torch.randn(8, 64)
        out.append(("chain (1,000 relu)", chain, torch.export.export(chain, (x,)), x))
        model = encoder(128, 2)
        x = torch.randn(1, 16, 128)
        ep = torch.export.export(model, (x,)).run_decompositions()
        out.append(("transformer (core-aten)", model, ep, x))
    return out


def measure(
    peers: dict[str, Callable[[], Any]], rounds: int, warmup: int, sample_s: float = 0.02
) -> dict[str, float]:
    """Median seconds per call of each peer, interleaved round by round (order rotated)."""
    names = list(peers)
    calls = {}
    for name in names:
        start = time.perf_counter()
        peers[name]()
        calls[name] = max(1, round(sample_s / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn, n = peers[name], calls[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            if r >= warmup:
                samples[name].append((time.perf_counter() - start) / n)
    return {n: statistics.median(xs) for n, xs in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)

    runner_cls, why = check_nativert()
    if runner_cls is None:
        print(f"nativert_compare: cannot run: {why}.", file=sys.stderr)
        print("\n\n".join(__doc__.split("\n\n")[1:4]), file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    asyncgraph, ag_error = import_asyncgraph()
    loop = asyncio.new_event_loop()
    report: dict[str, Any] = {"torch": torch.__version__, "asyncgraph_error": ag_error,
                              "rounds": args.rounds, "cases": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, model, ep, x in workloads():
                runner = runner_cls(package(ep, tmp, name.split()[0]), "forward")
                module = ep.module()

                def inference(fn: Callable[..., Any], x: Any = x) -> Callable[[], Any]:
                    def call() -> Any:
                        with torch.inference_mode():
                            return fn(x)
                    return call

                peers: dict[str, Callable[[], Any]] = {}
                executor = None
                if asyncgraph is not None:
                    executor = asyncgraph.Executor(ep)
                    execute = executor.execute

                    def run_ag(x: Any = x, execute: Any = execute) -> Any:
                        return loop.run_until_complete(execute(x))

                    peers["asyncgraph"] = run_ag
                peers["nativert"] = lambda runner=runner, x=x: runner.run(x)
                peers["eager model(x)"] = inference(model)
                peers["ep.module()"] = inference(module)
                expected = peers["ep.module()"]()
                matched = {}
                for peer, fn in peers.items():
                    got = fn()
                    got = got[0] if isinstance(got, (list, tuple)) else got
                    matched[peer] = bool(torch.allclose(got, expected, rtol=1e-3, atol=1e-3))
                medians = measure(peers, args.rounds, args.warmup)
                if executor is not None:
                    loop.run_until_complete(executor.aclose())
                report["cases"].append({
                    "case": name,
                    "nodes": sum(1 for n in ep.graph.nodes if n.op == "call_function"),
                    "median_ms": {k: v * 1e3 for k, v in medians.items()},
                    "matched": matched,
                })
    finally:
        loop.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"torch {report['torch']}, 1 intra-op thread, {args.rounds} rounds alternating, "
          "medians per call")
    if ag_error:
        print(f"asyncgraph left out: {ag_error}")
    for case in report["cases"]:
        print(f"\n{case['case']}: {case['nodes']} nodes")
        base = case["median_ms"]["nativert"]
        for peer, ms in case["median_ms"].items():
            ok = "ok" if case["matched"][peer] else "MISMATCH"
            print(f"  {peer:<16} {ms:9.3f} ms   {ms / base:6.2f}x nativert   {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
