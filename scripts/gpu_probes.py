"""The GPU-side checks of scripts/gpu_report.py, one per process (a crash, a hang or a poisoned
CUDA context in one cannot spoil the others):

    python scripts/gpu_probes.py env|wait|capture_failure|concurrency OUT.json

- env: versions (Python, torch, CUDA, cuDNN, the device and its driver, asyncgraph), the
  imports asyncgraph and its tests need, and one capture and replay through the real backend:
  a small exported GPU program run by `asyncgraph.Executor` with `cuda.graphs=True` until
  `cuda_graph_statistics()` shows a capture and replays, every output compared with eager.
- wait (issue 36, item 1): what the host's wait adds to GPU work of about 50 us, 300 us and
  1.5 ms (`torch.cuda._sleep`, calibrated once), on asyncio, uvloop and trio: each wait's
  awaited time minus its GPU time (CUDA timing events around the kernel), median and p99,
  for asyncgraph's wait (`asyncgraph.cuda.device.wait_events` with the policy and waiter of
  an Executor's `CudaRuntime`, a `WaitSite` per loop and GPU time as the runtime keeps one per
  place), for a blocking `event.synchronize()` (the floor: what launching and waking cost), and
  for the sleeping poll of before issue 36 (`PollPolicy(thread=False)`) where it still exists.
- capture_failure (issue 36, item 2): a program whose CUDA node syncs the host inside the
  capture (`masked_fill` with a 0-dim CUDA value, which calls `.item()`; else `histc` with
  min == max), its capture forced past the planner's deny list; then whether
  `torch.cuda.empty_cache()` raises (torch 2.11: `INTERNAL ASSERT captures_underway.empty()`),
  and `memory_allocated()` / `memory_reserved()` growth over 20 more executions with their
  outputs dropped, against a plain stream-path Executor before and after.
- concurrency (issue 36, item 7): 64 frames (`max_concurrent_executions=64`, one stream each,
  `cuda.graphs=True`) replaying a GEMM chain with small M and large K (split-K territory) for
  64 concurrent callers with distinct inputs; every output compared with eager; the same with
  `cuda.graphs=False` as the control; how many capture streams were made and how many of them
  were distinct (torch hands out 32 per device and priority).

Each writes its findings to OUT.json (rewritten as it goes, so a probe killed by its time limit
leaves what it had) and prints a line per finding. Exit status: 0 when it ran and found nothing
wrong, 1 when it crashed or found a wrong result (a mismatch, an `empty_cache` that raised, a
leak), 2 on bad usage. Without CUDA each says so and exits 0. Only long-stable torch APIs:
this runs on torch 2.11 to 2.13.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/gpu_probes.py`: sys.path[0] is scripts/
    sys.path.insert(1, str(ROOT))

import torch  # noqa: E402

from tests.support.real_gpu import MaskedFillSync  # noqa: E402

MiB = 2**20


class Findings:
    """The probe's result, a JSON object rewritten to its file after every change."""

    def __init__(self, path: str | None, probe: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"probe": probe, "complete": False}
        self.failed = False
        self.save()

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def save(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def error_text(exc: BaseException, limit: int = 800) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


def stats_dict(ex: Any) -> dict[str, Any] | None:
    stats = ex.cuda_graph_statistics()
    if stats is None:
        return None
    d = dataclasses.asdict(stats)
    d["failed"] = [str(f)[:600] for f in d.get("failed", ())]
    return d


def sync() -> None:
    torch.cuda.synchronize()


# -- env ------------------------------------------------------------------------------------------

# module -> distribution; True: the report cannot run its phases fully without it
IMPORTS: dict[str, tuple[str, bool]] = {
    "torch": ("torch", True),
    "numpy": ("numpy", True),
    "anyio": ("anyio", True),
    "asyncgraph": ("asyncgraph", True),
    "asyncgraph.kernels": ("asyncgraph", True),
    "pytest": ("pytest", True),
    "pytest_asyncio": ("pytest-asyncio", True),
    "pytest_timeout": ("pytest-timeout", True),
    "trio": ("trio", True),
    "uvloop": ("uvloop", True),
    "hypothesis": ("hypothesis", True),
    "xdist": ("pytest-xdist", False),
    "httpx": ("httpx", False),
    "starlette": ("starlette", False),
    "uvicorn": ("uvicorn", False),
    "prometheus_client": ("prometheus-client", False),
    "typer": ("typer", False),
    "rich": ("rich", False),
    "safetensors": ("safetensors", False),
}


def version_of(module: str, dist: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"MISSING ({error_text(exc, 160)})"
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(mod, "__version__", "present"))


class TinyModel(torch.nn.Module):
    """Two matmuls and pointwise ops: what every capture records."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.left = torch.nn.Linear(dim, dim)
        self.right = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.left(x)) + torch.sigmoid(self.right(x))


def probe_env(out: Findings) -> None:
    out["python"] = platform.python_version()
    out["platform"] = platform.platform()
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    imports = {}
    missing = []
    for module, (dist, required) in IMPORTS.items():
        imports[module] = version_of(module, dist)
        if required and imports[module].startswith("MISSING"):
            missing.append(module)
    out["imports"] = imports
    out["missing_required"] = missing
    with contextlib.suppress(Exception):
        import asyncgraph

        out["asyncgraph_path"] = str(Path(asyncgraph.__file__).resolve().parent)
    for var in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                "CUDA_MODULE_LOADING", "TORCH_CUDA_SANITIZER"):
        if var in os.environ:
            out[f"env_{var}"] = os.environ[var]
    if not torch.cuda.is_available():
        out["note"] = "no CUDA here: nothing GPU-side was checked"
        return
    try:
        props = torch.cuda.get_device_properties(0)
        out["device"] = torch.cuda.get_device_name(0)
        out["device_count"] = torch.cuda.device_count()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        out["memory_total_GiB"] = round(props.total_memory / 2**30, 1)
        out["cudnn"] = torch.backends.cudnn.version()
        out["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    except Exception as exc:
        out["device_error"] = error_text(exc)
    with contextlib.suppress(Exception):
        import subprocess

        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        if smi.returncode == 0:
            out["driver"] = smi.stdout.strip().splitlines()[0]
    try:  # the C functions TorchCudaBackend switches streams with
        from asyncgraph.cuda.device import CudaFunctions

        f = CudaFunctions.from_torch()
        out["cuda_functions"] = f"ok (current stream {f.get_current(0)})"
    except Exception as exc:
        out["cuda_functions"] = f"ERROR {error_text(exc)}"
        out.failed = True
    try:
        out["capture_check"] = asyncio.run(_capture_check())
    except Exception as exc:
        out["capture_check"] = {"ok": False, "error": error_text(exc),
                                "traceback": traceback.format_exc()[-3000:]}
    if not out["capture_check"].get("ok"):
        out.failed = True
    if missing:
        out.failed = True


async def _capture_check() -> dict[str, Any]:
    """Executions of a small program through the Executor with cuda.graphs=True, through the
    real backend (TorchCudaBackend), until a capture and replays; each output against eager."""
    from asyncgraph import Executor, ExecutorConfig
    from asyncgraph.runtime.config import CudaConfig

    torch.manual_seed(0)
    model = TinyModel().cuda().eval()
    x0 = torch.randn(16, 64, device="cuda")
    ep = torch.export.export(model, (x0,))
    config = ExecutorConfig(
        cuda=CudaConfig(graphs=True, graph_warmup=1), adaptive_placement=False)
    result: dict[str, Any] = {}
    async with Executor(ep, config) as ex:
        plan = ex.cuda_graph_plan
        result["plan"] = plan.describe() if plan is not None else "no CUDA nodes"
        result["backend"] = type(ex.cuda_runtime.backend).__name__ if ex.cuda_runtime else None
        worst = 0.0
        for _ in range(6):
            x = torch.randn(16, 64, device="cuda")
            out = await ex.execute(x)
            with torch.inference_mode():
                ref = model(x)
            worst = max(worst, float((out - ref).abs().max()))
        result["maxdiff"] = worst
        stats = stats_dict(ex)
        result["stats"] = stats
    s = stats or {}
    result["ok"] = bool(s.get("captures", 0) >= 1 and s.get("replays", 0) >= 1 and worst <= 1e-4)
    return result


# -- wait -----------------------------------------------------------------------------------------

WAIT_TARGETS_US = (50, 300, 1500)
LOOPS = ("asyncio", "uvloop", "trio")


def calibrate_sleep() -> float:
    """`torch.cuda._sleep` cycles per microsecond on this GPU (timing events)."""
    torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]
    sync()
    best = 0.0
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(5_000_000)  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        best = max(best, 5_000_000 / (start.elapsed_time(end) * 1000.0))
    return best


def quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclasses.dataclass
class AsyncgraphWait:
    """asyncgraph's wait as a frame calls it: `wait_events(events, runtime.poll,
    runtime.waiter, site)`, with the arguments the function in this checkout takes."""

    describe: str
    make_site: Callable[[], Any]
    call: Callable[[list[Any], Any], Awaitable[Any]]
    waiter: Any
    old: Callable[[list[Any]], Awaitable[Any]] | None


def asyncgraph_wait() -> AsyncgraphWait:
    from asyncgraph.cuda import device

    wait_events = device.wait_events
    params = inspect.signature(wait_events).parameters
    policy = waiter = None
    source = "defaults"
    with contextlib.suppress(Exception):  # what an Executor's CudaRuntime uses
        from asyncgraph import Executor, ExecutorConfig

        model = TinyModel(16).cuda().eval()
        ep = torch.export.export(model, (torch.randn(4, 16, device="cuda"),))
        ex = Executor(ep, ExecutorConfig(adaptive_placement=False))  # CUDA graphs off
        runtime = ex.cuda_runtime
        policy = getattr(runtime, "poll", None)
        waiter = getattr(runtime, "waiter", None)
        source = "an Executor's CudaRuntime"
        asyncio.run(ex.aclose())
    policy_cls = getattr(device, "PollPolicy", None)
    if policy is None and policy_cls is not None:
        policy = policy_cls()
    if waiter is None:
        with contextlib.suppress(Exception):
            from asyncgraph.cuda.host_wait import shared_waiter

            waiter = shared_waiter()
    site_cls = getattr(device, "WaitSite", None)

    def kwargs_for(site: Any, chosen_policy: Any) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if "policy" in params and chosen_policy is not None:
            kw["policy"] = chosen_policy
        if "waiter" in params and waiter is not None:
            kw["waiter"] = waiter
        if "site" in params and site is not None:
            kw["site"] = site
        return kw

    async def call(events: list[Any], site: Any) -> Any:
        return await wait_events(events, **kwargs_for(site, policy))

    old = None
    if policy_cls is not None and "thread" in {f.name for f in dataclasses.fields(policy_cls)}:
        old_policy = policy_cls(thread=False)

        async def old(events: list[Any]) -> Any:
            return await wait_events(events, **kwargs_for(None, old_policy))

    described = (f"{wait_events.__module__}.wait_events({', '.join(params)}) with the policy and "
                 f"waiter of {source}: {policy!r}")
    return AsyncgraphWait(described, site_cls if site_cls is not None else (lambda: None),
                          call, waiter, old)


async def _wait_round(
    wait: AsyncgraphWait, loop_name: str, cycles_per_us: float, n: int
) -> list[dict[str, Any]]:
    rows = []
    for target in WAIT_TARGETS_US:
        cycles = int(target * cycles_per_us)
        site = wait.make_site()

        def launch(cycles: int = cycles) -> tuple[Any, Any]:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
            end.record()
            return start, end

        async def block(events: list[Any]) -> None:
            for e in events:
                e.synchronize()

        async def ours(events: list[Any], site: Any = site) -> None:
            await wait.call(events, site)

        modes: list[tuple[str, Callable[[list[Any]], Awaitable[Any]]]] = [
            ("sync", block), ("asyncgraph", ours),
        ]
        if wait.old is not None:
            modes.append(("old_poll", wait.old))
        added: dict[str, list[float]] = {m: [] for m, _ in modes}
        gpu: list[float] = []
        handed_before = getattr(wait.waiter, "handed", None)
        for i in range(n + 5):  # the first 5 of each: warm-up, dropped
            for mode, fn in modes if i % 2 else reversed(modes):
                sync()
                t0 = time.perf_counter()
                start, end = launch()
                await fn([end])
                took = time.perf_counter() - t0
                g = start.elapsed_time(end) / 1e3
                if i >= 5:
                    added[mode].append(took - g)
                    if mode == "sync":
                        gpu.append(g)
        handed = None
        if handed_before is not None:  # of the n + 5 asyncgraph waits
            handed = getattr(wait.waiter, "handed", 0) - handed_before
        row: dict[str, Any] = {"loop": loop_name, "target_us": target,
                               "gpu_us": round(1e6 * statistics.median(gpu), 1), "n": n,
                               "handed_to_thread": handed}
        for mode, xs in added.items():
            row[f"{mode}_p50_us"] = round(1e6 * statistics.median(xs), 1)
            row[f"{mode}_p99_us"] = round(1e6 * quantile(xs, 0.99), 1)
        rows.append(row)
    return rows


def probe_wait(out: Findings, n: int = 100) -> None:
    per_us = calibrate_sleep()
    out["cycles_per_us"] = round(per_us, 1)
    wait = asyncgraph_wait()
    out["wait"] = wait.describe
    say(f"wait: {wait.describe}; _sleep {per_us:.0f} cycles/us")
    rows: list[dict[str, Any]] = []
    out["rows"] = rows
    errors: dict[str, str] = {}

    def keep(new: list[dict[str, Any]]) -> None:
        rows.extend(new)
        out["rows"] = rows
        for r in new:
            say(json.dumps(r))

    for loop_name in LOOPS:
        try:
            if loop_name == "asyncio":
                keep(asyncio.run(_wait_round(wait, "asyncio", per_us, n)))
            elif loop_name == "uvloop":
                import uvloop

                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    keep(runner.run(_wait_round(wait, "uvloop", per_us, n)))
            else:
                import anyio

                keep(anyio.run(_wait_round, wait, "trio", per_us, n, backend="trio"))
        except Exception as exc:
            errors[loop_name] = error_text(exc)
            say(f"wait on {loop_name}: {errors[loop_name]}")
            out["errors"] = errors
    if errors:
        out.failed = True


# -- capture failure ------------------------------------------------------------------------------

N_BIG = 1 << 20  # floats per big output: 4 MiB
GROWTH_RUNS = 20


class HistcSync(torch.nn.Module):
    """`aten.histc` with min == max: reads the input's range on the host."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.histc(torch.relu(x), bins=8), x * 2.0 + 1.0


class Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 1.0


TRIGGERS: tuple[tuple[str, str, type[torch.nn.Module]], ...] = (
    ("masked_fill", "masked_fill", MaskedFillSync),
    ("histc", "histc", HistcSync),
)


@contextlib.contextmanager
def forced_capture(op: str) -> Iterator[str]:
    """Let the capture planner accept nodes whose target names `op`, whatever its deny list
    says (the point is to see what a failing capture leaves behind, as tests/integration/
    test_cuda_graphs.py does on the simulated backend with a node the planner accepts)."""
    from asyncgraph.cuda import capturable

    original = getattr(capturable, "node_blocker", None)
    if original is None:
        yield "not forced (asyncgraph.cuda.capturable.node_blocker not found)"
        return

    def blocker(graph: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        node = graph.nodes[index]
        name = node.target_name() if hasattr(node, "target_name") else str(node.target)
        if op in str(name):
            return None
        return original(graph, index, *args, **kwargs)

    capturable.node_blocker = blocker
    try:
        yield f"forced: capturable.node_blocker accepts {op}"
    finally:
        capturable.node_blocker = original


def leaked(growth: dict[str, Any] | None) -> bool:
    """At least half of what the dropped outputs took is still allocated."""
    if not growth or "allocated_MiB" not in growth:
        return False
    return bool(growth["allocated_MiB"] >= growth["if_every_output_were_kept_MiB"] / 2)


def memory() -> tuple[int, int]:
    """(allocated, reserved) after the GPU is done and the allocator has processed the events
    of freed blocks that had record_stream uses (it does that in a malloc)."""
    sync()
    tmp = torch.empty(1024, device="cuda")
    del tmp
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


async def _growth(ex: Any, runs: int = GROWTH_RUNS) -> dict[str, Any]:
    x = torch.randn(N_BIG, device="cuda")
    first = await ex.execute(x)
    outputs = first if isinstance(first, (tuple, list)) else (first,)
    per_run = sum(o.numel() * o.element_size() for o in outputs if isinstance(o, torch.Tensor))
    del first, outputs
    alloc0, res0 = memory()
    for _ in range(runs):
        out = await ex.execute(x)
        del out
    alloc1, res1 = memory()
    return {"runs": runs, "allocated_MiB": round((alloc1 - alloc0) / MiB, 2),
            "reserved_MiB": round((res1 - res0) / MiB, 2),
            "if_every_output_were_kept_MiB": round(runs * per_run / MiB, 1)}


async def _plain_growth() -> dict[str, Any]:
    from asyncgraph import Executor, ExecutorConfig
    from asyncgraph.runtime.config import CudaConfig

    x = torch.randn(N_BIG, device="cuda")
    ep = torch.export.export(Plain().cuda().eval(), (x,))
    config = ExecutorConfig(
        cuda=CudaConfig(streams=1, graphs=False), adaptive_placement=False)
    async with Executor(ep, config) as ex:
        return await _growth(ex)


async def _failing(model: torch.nn.Module, op: str) -> tuple[dict[str, Any], Any]:
    """Run `model` with its capture forced until the capture has been tried; returns the
    findings and the still-open Executor (the caller closes it)."""
    from asyncgraph import Executor, ExecutorConfig
    from asyncgraph.runtime.config import CudaConfig

    x = torch.randn(N_BIG, device="cuda")
    ep = torch.export.export(model, (x,))
    config = ExecutorConfig(
        cuda=CudaConfig(graphs=True, graph_warmup=1), adaptive_placement=False)
    with forced_capture(op) as how:
        ex = Executor(ep, config)
    r: dict[str, Any] = {"forced": how}
    plan = ex.cuda_graph_plan
    r["plan"] = plan.describe() if plan is not None else "no CUDA nodes"
    await ex.__aenter__()
    worst = 0.0
    try:
        for _ in range(4):
            xi = torch.randn(N_BIG, device="cuda")
            outs = await ex.execute(xi)
            with torch.inference_mode():
                refs = model(xi)
            for o, ref in zip(outs, refs, strict=True):
                worst = max(worst, float((o.float() - ref.float()).abs().max()))
    except Exception as exc:
        r["run_error"] = error_text(exc)
        r["run_traceback"] = traceback.format_exc()[-3000:]
    r["maxdiff"] = worst
    r["stats"] = stats_dict(ex)
    return r, ex


def probe_capture_failure(out: Findings) -> None:
    out["torch"] = torch.__version__
    out["plain_before"] = asyncio.run(_plain_growth())
    say(f"plain stream path, before: {out['plain_before']}")
    tried = []
    chosen: dict[str, Any] | None = None

    async def attempt(model: torch.nn.Module, op: str) -> dict[str, Any]:
        r, ex = await _failing(model, op)
        try:
            if (r.get("stats") or {}).get("failures"):
                # the capture failed: what is left after it, this Executor still open
                try:
                    sync()
                    torch.cuda.empty_cache()
                    r["empty_cache"] = "ok"
                except Exception as exc:
                    r["empty_cache"] = f"RAISED {error_text(exc, 600)}"
                try:
                    r["growth_after_failure"] = await _growth(ex)
                except Exception as exc:
                    r["growth_after_failure"] = {"error": error_text(exc)}
                r["stats_after"] = stats_dict(ex)
        finally:
            await ex.aclose()
        return r

    for name, op, cls in TRIGGERS:
        try:
            r = asyncio.run(attempt(cls().cuda().eval(), op))
        except Exception as exc:
            r = {"error": error_text(exc), "traceback": traceback.format_exc()[-3000:]}
        r["trigger"] = name
        tried.append(r)
        out["tried"] = tried
        say(f"trigger {name}: {json.dumps({k: v for k, v in r.items() if 'traceback' not in k})}")
        if (r.get("stats") or {}).get("failures"):
            chosen = r
            break
    out["failed_capture"] = chosen is not None
    if chosen is None:
        out["note"] = "no trigger made a capture fail: nothing to check after one"
        out.failed = True
        return
    try:
        out["plain_after"] = asyncio.run(_plain_growth())
    except Exception as exc:
        out["plain_after"] = {"error": error_text(exc)}
    say(f"plain stream path, after: {out['plain_after']}")
    try:  # torch's own API: its __enter__ synchronizes and empties the cache
        g = torch.cuda.CUDAGraph()
        x = torch.randn(1024, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 3
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            y = x * 3
        g.replay()
        sync()
        out["torch_cuda_graph_after"] = "ok" if torch.equal(y, x * 3) else "WRONG RESULT"
    except Exception as exc:
        out["torch_cuda_graph_after"] = f"RAISED {error_text(exc)}"
    out["leak"] = any(leaked(g) for g in (chosen.get("growth_after_failure"),
                                          out.get("plain_after")))
    if (str(chosen.get("empty_cache", "")).startswith("RAISED") or out["leak"]
            or str(out["torch_cuda_graph_after"]) != "ok"):
        out.failed = True


# -- concurrency ----------------------------------------------------------------------------------


class Gemms(torch.nn.Module):
    def __init__(self, dim: int, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def probe_concurrency(out: Findings, callers: int = 64, rounds: int = 20,
                      dim: int = 4096) -> None:
    from asyncgraph import Executor, ExecutorConfig
    from asyncgraph.cuda import device
    from asyncgraph.runtime.config import CudaConfig

    made: list[tuple[int, int]] = []
    original = getattr(device.TorchCudaBackend, "new_capture_stream", None)
    if original is not None:

        def counting(self: Any, dev: int) -> Any:
            stream = original(self, dev)
            made.append((int(stream.stream_id), int(stream.device_index)))
            return stream

        device.TorchCudaBackend.new_capture_stream = counting  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = Gemms(dim).cuda().eval()
    xs = [torch.randn(8, dim, device="cuda") for _ in range(callers)]
    with torch.inference_mode():
        refs = [model(x) for x in xs]
    sync()
    ep = torch.export.export(model, (xs[0],))
    out["callers"] = callers
    out["rounds"] = rounds
    out["model"] = f"3 x Linear({dim}, {dim}) + relu, batch 8"

    async def storm(graphs: bool) -> dict[str, Any]:
        config = ExecutorConfig(
            max_concurrent_executions=callers,
            cuda=CudaConfig(streams=1, graphs=graphs, graph_warmup=1), adaptive_placement=False,
        )
        r: dict[str, Any] = {}
        async with Executor(ep, config) as ex:
            captures = -1
            for _ in range(12):  # until captures stop (graph instances, not one per frame)
                await asyncio.gather(*(ex.execute(x) for x in xs))
                s = ex.cuda_graph_statistics()
                if not graphs or (s is not None and s.captures == captures):
                    break
                captures = s.captures if s is not None else captures
            before = stats_dict(ex) or {}
            worst, bad, calls = 0.0, 0, 0
            t = time.perf_counter()
            for k in range(rounds):
                order = [(i + k) % callers for i in range(callers)]  # frames see new inputs
                outs = await asyncio.gather(*(ex.execute(xs[i]) for i in order))
                sync()
                for i, o in zip(order, outs, strict=True):
                    ref = refs[i]
                    d = float((o - ref).abs().max())
                    worst = max(worst, d)
                    bad += d > 1e-3 * (1.0 + float(ref.abs().max()))
                    calls += 1
            after = stats_dict(ex) or {}
            r.update(maxdiff=worst, bad=bad, calls=calls, seconds=round(time.perf_counter() - t, 2),
                     live_graphs=after.get("live_graphs"),
                     replays=after.get("replays", 0) - before.get("replays", 0),
                     failures=after.get("failures"), failed=after.get("failed"))
        return r

    for graphs in (True, False):
        key = "graphs" if graphs else "no_graphs"
        try:
            out[key] = asyncio.run(storm(graphs))
        except Exception as exc:
            out[key] = {"error": error_text(exc), "traceback": traceback.format_exc()[-3000:]}
            out.failed = True
        say(f"{key}: {json.dumps({k: v for k, v in out[key].items() if k != 'traceback'})}")
        if out[key].get("bad"):
            out.failed = True
    out["capture_streams_made"] = len(made) if original is not None else None
    out["capture_streams_distinct"] = len(set(made)) if original is not None else None


# -- main -----------------------------------------------------------------------------------------

PROBES: dict[str, Callable[[Findings], None]] = {
    "env": probe_env,
    "wait": probe_wait,
    "capture_failure": probe_capture_failure,
    "concurrency": probe_concurrency,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in PROBES:
        print(f"usage: gpu_probes.py {'|'.join(PROBES)} [OUT.json]", file=sys.stderr)
        return 2
    name = args[0]
    out = Findings(args[1] if len(args) > 1 else None, name)
    if name != "env" and not torch.cuda.is_available():
        out["skipped"] = "no CUDA (torch.cuda.is_available() is False)"
        say(f"{name}: skipped, no CUDA")
        return 0
    try:
        PROBES[name](out)
    except Exception as exc:
        out["error"] = error_text(exc)
        out["traceback"] = traceback.format_exc()[-4000:]
        say(out["traceback"])
        out.failed = True
    out["complete"] = True
    out["ok"] = not out.failed
    return 1 if out.failed else 0


if __name__ == "__main__":
    sys.exit(main())
