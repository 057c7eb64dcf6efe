"""NVIDIA's perf_analyzer against `asyncgraph serve`: Triton's own load tool, unchanged.

    asyncgraph bench -s perf-analyzer [--quick] [--json]
    python -m benchmarks.perf_analyzer [--quick] [--json] [-o FILE]
    make bench-serve                              # BENCH_SERVE_ARGS=--quick for a look

A team moving from Triton Inference Server measures a server with perf_analyzer; this runs it
as such a team would. The model is the MLP of benchmarks/ort.py (8 x Linear(64, 64)+ReLU),
exported once with a dynamic batch dimension (1 to 64). Two `asyncgraph serve` processes on
free ports, HTTP and --grpc-port each, default settings: one plain (the config answers
`max_batch_size` 0 and dims [-1, 64], so perf_analyzer gets `--shape input:1,64`) and one with
`--max-batch-size 32` (dims [64]; perf_analyzer sends `-b 4`: 4 rows per request). Against
each, over HTTP and over gRPC: `--concurrency-range 1:4:3` (concurrency 1, then 4); against
the plain one also `--shared-memory system` at concurrency 1, once per transport.
perf_analyzer's defaults otherwise (synchronous requests, "time_windows" stabilisation),
except a measurement window of MEASUREMENT_MS (QUICK_MS with --quick) and a stability band of
STABILITY_PCT: on a shared 2-core machine the default 10% rarely settles at concurrency 4.

Figures are perf_analyzer's client-side ones, parsed from its output: "Throughput: X
infer/sec" (inferences, so rows: with -b 4 each request counts 4) and the average, p50, p90,
p95 and p99 latencies in microseconds. perf_analyzer, the server and its clients share the
machine's cores: these are the figures of one box, not of a server with a client elsewhere.

perf_analyzer is an optional benchmark dependency, never in the test tier: the binary ships in
tritonclient's manylinux wheels up to 2.60.0 and needs glibc 2.38 or newer. It is found as
$PERF_ANALYZER, `perf_analyzer` on PATH, or ~/.cache/perf_analyzer/bin/perf_analyzer; where
none runs (or grpcio, which --grpc-port needs, is missing), the scenario reports one case,
skipped, with the reason, and exits 0.

With --json the report is the suite's (asyncgraph/bench/suite.py: environment with the CPU count
and load average at the start and end, settings, cases) plus `summary`: run -> "concurrency N"
-> {throughput, avg_us, p50_us, p90_us, p95_us, p99_us, requests_per_s (throughput / the -b
batch)}, which the README's serving table quotes (benchmarks/results/cpu/perf_analyzer.json,
written by scripts/bench_record.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncgraph.bench.harness import CaseResult, Context, PeerResult

NAME = "perf-analyzer"
HOST = "127.0.0.1"
MODEL = "mlp"
WIDTH, LAYERS = 64, 8  # benchmarks/ort.py's MLP
MAX_BATCH = 32  # --max-batch-size of the batching server
BATCH = 4  # perf_analyzer -b against the batching server
CONCURRENCY = "1:4:3"  # perf_analyzer --concurrency-range: 1, then 4
MEASUREMENT_MS, QUICK_MS = 2000, 500  # perf_analyzer --measurement-interval
STABILITY_PCT = 25  # perf_analyzer --stability-percentage (its default, 10, rarely settles here)
READY_TIMEOUT_S = 120.0  # a server's start: importing torch, loading the program
RUN_TIMEOUT_S = 300.0  # one perf_analyzer invocation
DEFAULT_PATH = Path.home() / ".cache" / "perf_analyzer" / "bin" / "perf_analyzer"
INSTALL = ("set PERF_ANALYZER to a perf_analyzer binary or put one on PATH: tritonclient "
           "2.60.0's manylinux wheel bundles it (the last that does); it needs glibc 2.38")


# -- perf_analyzer's output ------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One concurrency level of one perf_analyzer run: its client-side figures."""

    concurrency: int
    throughput: float  # inferences per second (rows: -b 4 counts 4 per request)
    avg_us: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float


_BLOCK = re.compile(r"^Request concurrency: (\d+)\s*$", re.MULTILINE)
_FIGURES = {
    "throughput": re.compile(r"Throughput: ([\d.]+) infer/sec"),
    "avg_us": re.compile(r"Avg latency: (\d+) usec"),
    "p50_us": re.compile(r"p50 latency: (\d+) usec"),
    "p90_us": re.compile(r"p90 latency: (\d+) usec"),
    "p95_us": re.compile(r"p95 latency: (\d+) usec"),
    "p99_us": re.compile(r"p99 latency: (\d+) usec"),
}


def parse_output(text: str) -> list[Measurement]:
    """Every "Request concurrency: N" block of perf_analyzer's output that reports all of
    _FIGURES (its client section comes first, so the first match of each is the client's);
    a block that does not (a level that failed to stabilise) is left out."""
    starts = list(_BLOCK.finditer(text))
    out = []
    for i, m in enumerate(starts):
        block = text[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        found = {key: pattern.search(block) for key, pattern in _FIGURES.items()}
        if all(found.values()):
            figures = {key: float(hit.group(1)) for key, hit in found.items() if hit}
            out.append(Measurement(int(m.group(1)), **figures))
    return out


def failure_reason(returncode: int, text: str) -> str:
    """perf_analyzer's own words for a run that measured nothing (its last error line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error|fail|unable|invalid", line, re.I)]
    said = (errors or lines or ["no output"])[-1]
    return f"perf_analyzer exited {returncode}: {said[:300]}"


# -- finding perf_analyzer -------------------------------------------------------------------


def find_perf_analyzer() -> tuple[str | None, str]:
    """(path of a perf_analyzer that runs, "") or (None, why there is none)."""
    named = os.environ.get("PERF_ANALYZER")
    candidates = [named] if named else [shutil.which("perf_analyzer"), str(DEFAULT_PATH)]
    tried = []
    for path in candidates:
        if not path:
            continue
        if not os.access(path, os.X_OK):
            tried.append(f"{path}: not an executable file")
            continue
        try:
            proc = subprocess.run([path], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{path}: {type(exc).__name__}: {exc}"[:200])
            continue
        if "usage" in (proc.stdout + proc.stderr).lower():
            return path, ""
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        tried.append(f"{path}: does not run (exit {proc.returncode}: {said[:160]})")
    where = "; ".join(tried) or "not on PATH, no $PERF_ANALYZER, nothing at " + str(DEFAULT_PATH)
    return None, f"no runnable perf_analyzer ({where}); {INSTALL}"


def why_not_runnable() -> tuple[str | None, str]:
    """(perf_analyzer's path, "") when the scenario can run, else (None, the reason)."""
    if importlib.util.find_spec("grpc") is None:
        return None, "grpcio is not installed: asyncgraph serve --grpc-port needs asyncgraph[grpc]"
    return find_perf_analyzer()


# -- the server ------------------------------------------------------------------------------


def export_model(path: Path) -> None:
    """The MLP with a dynamic batch dimension (1 to 64), saved as a .pt2 at `path`."""
    import torch

    from benchmarks.nativert_compare import mlp

    model = mlp(WIDTH, LAYERS)
    batch = torch.export.Dim("batch", min=1, max=2 * MAX_BATCH)
    ep = torch.export.export(model, (torch.randn(2, WIDTH),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """One `asyncgraph serve` subprocess; its stderr goes to `log`."""

    label: str
    http_port: int
    grpc_port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_server(model: Path, label: str, folder: Path, flags: Sequence[str]) -> Server:
    """Start `asyncgraph serve MODEL` on free HTTP and gRPC ports with `flags`."""
    server = Server(label, free_port(), free_port(), folder / f"server-{label}.log")
    command = [sys.executable, "-m", "asyncgraph.cli.main", "serve", str(model),
               "--name", MODEL, "--port", str(server.http_port),
               "--grpc-port", str(server.grpc_port), "--log-level", "warning", *flags]
    with server.log.open("wb") as log:
        server.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log,
                                       env={**os.environ, "COLUMNS": "200"})
    return server


def wait_ready(server: Server) -> str | None:
    """None once the model answers ready over HTTP and the gRPC port accepts; else why not."""
    assert server.proc is not None
    url = f"http://{HOST}:{server.http_port}/v2/models/{MODEL}/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return (f"asyncgraph serve ({server.label}) exited {server.proc.returncode} "
                    f"before it was ready: {server.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    socket.create_connection((HOST, server.grpc_port), timeout=2).close()
                    return None
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.25)
    return f"asyncgraph serve ({server.label}) not ready after {READY_TIMEOUT_S:.0f} s"


def stop_server(server: Server) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    server.proc.terminate()
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=30)


# -- the runs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One perf_analyzer invocation: which server, which transport, which flags."""

    server: str  # "plain" or "batching"
    transport: str  # "http" or "grpc"
    flags: tuple[str, ...] = ()
    concurrency: str = CONCURRENCY

    @property
    def label(self) -> str:
        """The run as the report and the README's table key it: transport, then the flags
        that differ from a plain run ("http", "grpc -b 4", "http --shared-memory system")."""
        extra = [f for f in self.flags if not f.startswith("--shape")]
        return " ".join([self.transport, *extra])


def runs() -> list[Run]:
    shape = (f"--shape=input:1,{WIDTH}",)
    out = [Run("plain", t, shape) for t in ("http", "grpc")]
    out += [Run("batching", t, ("-b", str(BATCH))) for t in ("http", "grpc")]
    out += [Run("plain", t, (*shape, "--shared-memory", "system"), "1") for t in ("http", "grpc")]
    return out


def command(path: str, run: Run, server: Server, interval_ms: int) -> list[str]:
    port = server.http_port if run.transport == "http" else server.grpc_port
    return [path, "-m", MODEL, "-u", f"{HOST}:{port}", "-i", run.transport, *run.flags,
            "--concurrency-range", run.concurrency, "--measurement-interval", str(interval_ms),
            "--stability-percentage", str(STABILITY_PCT)]


@dataclass
class Outcome:
    """What one perf_analyzer run gave: its measurements, or why it gave none."""

    run: Run
    command: list[str]
    measurements: list[Measurement] = field(default_factory=list)
    error: str | None = None
    output: str = ""


def run_perf_analyzer(path: str, run: Run, server: Server, interval_ms: int) -> Outcome:
    argv = command(path, run, server, interval_ms)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Outcome(run, argv, error=f"perf_analyzer ran past {RUN_TIMEOUT_S:.0f} s")
    text = proc.stdout + proc.stderr
    outcome = Outcome(run, argv, parse_output(text), output=text)
    if not outcome.measurements or proc.returncode != 0:
        outcome.error = failure_reason(proc.returncode, text)
        tail = server.log_tail(5)
        if tail:
            outcome.error += f"; server log: {tail[-300:]}"
    return outcome


def figures_of(run: Run, m: Measurement) -> dict[str, float]:
    """A measurement's figures, and requests per second beside perf_analyzer's inferences per
    second (with -b N each request carries N inferences)."""
    batch = int(run.flags[run.flags.index("-b") + 1]) if "-b" in run.flags else 1
    figures = {k: v for k, v in asdict(m).items() if k != "concurrency"}
    return {**figures, "requests_per_s": round(m.throughput / batch, 1)}


def peers(outcome: Outcome) -> list[PeerResult]:
    """One peer per concurrency level measured (or one failed peer saying why)."""
    if not outcome.measurements:
        return [PeerResult(outcome.run.label, failed=True, error=outcome.error)]
    out = []
    for m in outcome.measurements:
        out.append(PeerResult(f"{outcome.run.label}, concurrency {m.concurrency}", matched=True,
                              error=outcome.error, extra=figures_of(outcome.run, m)))
    return out


def summary(outcomes: Sequence[Outcome]) -> dict[str, dict[str, dict[str, float]]]:
    """run label -> "concurrency N" -> figures: what the README's serving table quotes."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for outcome in outcomes:
        for m in outcome.measurements:
            level = f"concurrency {m.concurrency}"
            out.setdefault(outcome.run.label, {})[level] = figures_of(outcome.run, m)
    return out


def skipped(why: str) -> list[CaseResult]:
    case = CaseResult(NAME, "perf_analyzer (skipped)", f"perf_analyzer skipped: {why}",
                      {"skipped": why})
    case.metrics["skipped"] = why
    return [case]


def measure_all(ctx: Context, path: str, folder: Path) -> tuple[list[Outcome], str | None]:
    """Start both servers and run every Run against its server: (the outcomes, None), or
    ([], why) when a server did not start."""
    model = folder / f"{MODEL}.pt2"
    export_model(model)
    servers = {"plain": start_server(model, "plain", folder, ()),
               "batching": start_server(model, "batching", folder,
                                        ("--max-batch-size", str(MAX_BATCH)))}
    interval = ctx.settings.pick(MEASUREMENT_MS, QUICK_MS, QUICK_MS)
    try:
        for server in servers.values():
            why = wait_ready(server)
            if why is not None:
                return [], why
        advance = ctx.task("perf_analyzer runs", len(runs()))
        outcomes = []
        for run in runs():
            outcomes.append(run_perf_analyzer(path, run, servers[run.server], interval))
            advance()
        return outcomes, None
    finally:
        for server in servers.values():
            stop_server(server)


def cases(outcomes: Sequence[Outcome], interval_ms: int) -> list[CaseResult]:
    params = {"model": f"MLP, {LAYERS} x Linear({WIDTH}, {WIDTH})+ReLU",
              "measurement_interval_ms": interval_ms, "stability_pct": STABILITY_PCT}
    out = []
    for server, what in (("plain", "asyncgraph serve, no batching"),
                         ("batching", f"asyncgraph serve --max-batch-size {MAX_BATCH}")):
        case = CaseResult(NAME, f"perf_analyzer, {server}", what, dict(params), columns="metrics")
        for outcome in outcomes:
            if outcome.run.server == server:
                case.peers += peers(outcome)
                case.params[outcome.run.label] = " ".join(outcome.command[1:])
        out.append(case)
    return out


async def run(ctx: Context) -> list[CaseResult]:
    """The suite's entry (`asyncgraph bench -s perf-analyzer`): the cases, or one skipped."""
    return (await measure(ctx))[0]


async def measure(ctx: Context) -> tuple[list[CaseResult], list[Outcome]]:
    path, why = why_not_runnable()
    if path is None:
        return skipped(why), []
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        outcomes, why_not = await asyncio.to_thread(measure_all, ctx, path, Path(tmp))
    if why_not is not None:
        return skipped(why_not), []
    interval = ctx.settings.pick(MEASUREMENT_MS, QUICK_MS, QUICK_MS)
    return cases(outcomes, interval), outcomes


# -- standalone ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.perf_analyzer`: the suite's report, plus `summary` in the JSON;
    exit 0 when perf_analyzer cannot run (the case says why)."""
    import json

    from rich.console import Console

    from asyncgraph.bench import suite
    from asyncgraph.bench.harness import Settings, environment

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_MS} ms measurement windows: a look, not a figure")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, progress on stderr")
    parser.add_argument("-o", "--output", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    settings = Settings(size="quick" if args.quick else "full")

    def start_task(description: str, total: int) -> Any:
        print(f"{description}: {total}", file=sys.stderr, flush=True)
        return lambda: None

    report = suite.Report(environment(), asdict(settings))
    start = time.perf_counter()
    report.cases, outcomes = asyncio.run(measure(Context(settings, start_task)))
    report.elapsed_s = time.perf_counter() - start
    report.environment["load_average_end"] = environment()["load_average"]
    data = {**report.as_dict(), "summary": summary(outcomes)}
    text = json.dumps(data, indent=2, default=str)
    if args.output is not None:
        args.output.write_text(text)
    if args.json:
        print(text)
    else:
        suite.render(report, Console(width=None if sys.stdout.isatty() else 150))
    for outcome in outcomes:
        if outcome.error:
            print(f"{outcome.run.label}: {outcome.error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
