"""asyncgraph against nativert, PyTorch's C++ runtime for exported programs, in torch 2.11's venv.

    make bench-nativert                    # the full run (compiles on the first run: ~10 min)
    make bench-nativert NATIVERT_ARGS=--quick
    .venv-torch-min/bin/python -m benchmarks.nativert_compare [--quick] [--json] [-o FILE]

nativert's Python binding, `torch._C._nativert.PyModelRunner`, has a working `run()` in PyPI's
torch 2.9-2.11 wheels only (later wheels ship a stub without methods), so this scenario runs in
the torch 2.11 venv that `make test-torch-min` uses; with another torch it says why and exits 2.

Graphs (every peer runs the same exported program, batch 1, one intra-op thread):
the MLP (12 x Linear+ReLU, 256 wide: 24 nodes), tiny BERT (token and position embeddings, a
2-layer GELU nn.TransformerEncoder, hidden 128, seq 16), the core-ATen encoder of the main suite
(run_decompositions(), 142 nodes) and the 1,000-relu chain.

Latency peers: asyncgraph `execute`, asyncgraph with compiled segments
(`asyncgraph.compiled.compile_program(ep, path, "auto")`, loaded with trust_compiled=True;
weights swappable), on the MLP and tiny BERT also with `autotune=True` (max-autotune: the
C++ GEMM with its packed weights, still swappable; per segment, kept only where it timed
faster than the default kernels),
nativert `runner.run(x)`, AOTInductor whole-model (`aoti_compile_and_package`,
`aoti_load_package`) and eager `model(x)`. Compiled packages are cached under
build/nativert_compare/torch-<version>/, keyed by graph and a digest of the program and its
weights, so only the first run pays the compiles (printed with their times).

64 callers (MLP and tiny BERT): asyncgraph `execute` from 64 tasks, each request its own
execution (plain graph, compiled segments, autotuned compiled segments) and with dynamic
batching (`BatchingConfig(max_batch_size=32)` on the graph exported with a dynamic batch
dimension; also with that graph's compiled segments, `compiled, batched`), against nativert
`runner.run` via `asyncio.to_thread` from 64
tasks; requests per second.

`--compare-binding` adds the compiled peers once more with their segments called through
torch's binding (`AOTIModelPackageLoader.run`, which holds the GIL while the model runs)
instead of their C entry points (asyncgraph/compiled/native_call.py), in the same rounds:
the peers named `... via binding`.

The harness of the main suite (asyncgraph/bench/harness.py) does the measuring: outputs
compared with asyncgraph's first (a peer that disagrees is marked MISMATCH), rounds alternating
in a new seeded random order each round, medians after warm-up, ratios of medians of the same
run.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

import asyncgraph
from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.bench.concurrency import measure_concurrent
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Peer,
    Settings,
    Target,
    measure,
    new_results,
    sync_peer,
)
from asyncgraph.bench.models import call_nodes, exported_chain, exported_encoder
from asyncgraph.bench.peers import asyncgraph_peer, in_inference

NAME = "nativert"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "nativert_compare"
NEEDS = "a torch between 2.9 and 2.11 (PyPI wheels), whose PyModelRunner has a run() method"
TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}  # eager's fused encoder path and inductor round apart
GRAPHS = ("mlp", "bert", "encoder", "chain")
MAX_BATCH = 32
COMPILED = "asyncgraph (compiled)"
AUTOTUNED = "asyncgraph (compiled, autotuned)"
SEGMENTS_FORMAT = "w5"  # cache key: weights as constants, packed traced, linear ones transposed
SCRIPTED = "asyncgraph (scripted)"
SCRIPTED_BATCHED = "asyncgraph (scripted, batched)"
BATCHED = "asyncgraph (batched)"
COMPILED_BATCHED = "asyncgraph (compiled, batched)"
BINDING = " via binding"  # suffix of the --compare-binding peers: segments through torch's binding
NATIVERT = "nativert"
NATIVERT_THREAD = "nativert via to_thread"


def check_nativert() -> tuple[Any, str | None]:
    """PyModelRunner, or None and the reason it cannot be used here."""
    runner = getattr(getattr(torch._C, "_nativert", None), "PyModelRunner", None)
    if runner is None:
        return None, f"torch {torch.__version__} has no torch._C._nativert.PyModelRunner"
    if not hasattr(runner, "run"):
        return None, (
            f"torch {torch.__version__} ships PyModelRunner as a stub without run(); "
            f"this comparison needs {NEEDS}"
        )
    return runner, None


# -- the graphs ---------------------------------------------------------------------------------


class TinyBert(torch.nn.Module):
    """BERT's shape at toy size: token and position embeddings, LayerNorm, a post-norm GELU
    encoder. Inputs are token ids (batch, seq)."""

    def __init__(self, hidden: int, layers: int, seq: int, vocab: int = 1000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(vocab, hidden)
        self.positions = torch.nn.Embedding(seq, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        layer = torch.nn.TransformerEncoderLayer(
            hidden, 4, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.register_buffer("position_ids", torch.arange(seq))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(self.position_ids)
        out: torch.Tensor = self.encoder(self.norm(x))
        return out


def mlp(width: int, layers: int = 12) -> torch.nn.Module:
    """`layers` x (Linear, ReLU): 2 nodes each in the export graph (linear, relu)."""
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules).eval()


@dataclass
class Workload:
    """One graph: the model, its batch-1 program and input, and (for the 64-caller case) a
    builder of the same model exported with a dynamic batch dimension."""

    key: str
    title: str
    model: torch.nn.Module
    ep: ExportedProgram
    x: torch.Tensor
    dynamic: Callable[[], ExportedProgram] | None = None
    targets: bool = False  # the latency targets are judged on this graph


def _export(model: torch.nn.Module, x: torch.Tensor, dynamic: bool = False) -> ExportedProgram:
    shapes = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},) if dynamic else None
    if dynamic:
        x = torch.cat([x, x])  # export a dynamic dimension from an example of size 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model, (x,), dynamic_shapes=shapes)


def workloads(settings: Settings, names: Sequence[str] = GRAPHS) -> list[Workload]:
    """The compared graphs at the run's size (tiny: small widths, for the smoke test)."""
    out = []
    for name in names:
        if name == "mlp":
            width = settings.pick(256, 256, 16)
            model = mlp(width)
            x = torch.randn(1, width)
            out.append(Workload("mlp", f"MLP, 12 x Linear+ReLU {width} wide, batch 1", model,
                                _export(model, x), x,
                                lambda model=model, x=x: _export(model, x, dynamic=True),
                                targets=True))
        elif name == "bert":
            hidden, layers, seq = settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
            model = TinyBert(hidden, layers, seq).eval()
            x = torch.randint(0, 1000, (1, seq))
            out.append(Workload("bert", f"tiny BERT, hidden {hidden}, {layers} layers, seq {seq}",
                                model, _export(model, x), x,
                                lambda model=model, x=x: _export(model, x, dynamic=True),
                                targets=True))
        elif name == "encoder":
            hidden, layers, seq = settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
            model, ep = exported_encoder(hidden, layers, seq, True)
            out.append(Workload("encoder", f"encoder, core-ATen graph, hidden {hidden}, "
                                f"{layers} layers, seq {seq}", model, ep,
                                torch.randn(1, seq, hidden)))
        elif name == "chain":
            n = settings.pick(1000, 1000, 20)
            model, ep = exported_chain(n, (8, 64))
            out.append(Workload("chain", f"chain of {n} relu on 8x64", model, ep,
                                torch.randn(8, 64)))
        else:
            raise ValueError(f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}")
    return out


# -- building the peers' artefacts (cached) -----------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What a run builds: `compiled` False leaves out AOTInductor and compiled segments (they
    take minutes to build); `nativert` False leaves out nativert (torch 2.12 and later)."""

    graphs: tuple[str, ...] = GRAPHS
    compiled: bool = True
    nativert: bool = True
    cache: Path = CACHE
    compare_binding: bool = False  # also the compiled peers called through torch's binding


@dataclass
class Built:
    """Compiled artefacts of one workload and what building them cost."""

    notes: dict[str, Any] = field(default_factory=dict)
    aoti: Any = None
    segments: Path | None = None
    autotuned: Path | None = None  # compiled segments with autotune=True
    batched: Path | None = None  # compiled segments of the dynamic-batch export
    autotuned_batched: Path | None = None  # the same with autotune=True (benchmarks/ort.py)


def digest(ep: ExportedProgram) -> str:
    """A key for the compiled caches: the graph's text and every weight's bytes."""
    h = hashlib.sha1(str(ep.graph).encode())
    for name, value in sorted({**ep.state_dict, **ep.constants}.items()):
        if isinstance(value, torch.Tensor):
            h.update(name.encode())
            h.update(value.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def build_compiled(work: Workload, options: Options) -> Built:
    """AOTInductor's whole-model package and asyncgraph's compiled-segments package, from the
    cache when there, else compiled now (times printed to stderr and kept in the notes)."""
    built = Built()
    folder = options.cache / f"torch-{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    key = f"{work.key}-{digest(work.ep)}"
    aoti_path = folder / f"{key}.aoti-whole.pt2"
    segments_path = folder / f"{key}.segments-auto-{SEGMENTS_FORMAT}.pt2"
    try:
        built.notes["aoti_compile_s"], built.notes["aoti_cached"] = _cached(
            aoti_path, lambda: torch._inductor.aoti_compile_and_package(
                work.ep, package_path=str(aoti_path)))
        built.aoti = torch._inductor.aoti_load_package(str(aoti_path))
    except Exception as exc:
        built.notes["aoti_error"] = f"{type(exc).__name__}: {exc}"[:300]
    built.segments = _compile_segments(built.notes, "segments", work.ep, segments_path)
    kinds = ["aoti", "segments"]
    if work.targets:  # max-autotune compiles take half a minute: the target graphs only
        kinds.append("autotuned")
        # "kept": each segment's autotuned kernels kept only where they timed faster
        autotuned_path = folder / f"{key}.segments-auto-autotuned-kept-{SEGMENTS_FORMAT}.pt2"
        built.autotuned = compile_autotuned(built.notes, "autotuned", work.ep, autotuned_path)
    if work.targets and work.dynamic is not None:  # the batched rows' own compile
        kinds.append("batched")
        dynamic = work.dynamic()
        batched_path = (folder / f"{work.key}-{digest(dynamic)}"
                        f".segments-auto-batch-{SEGMENTS_FORMAT}.pt2")
        built.batched = _compile_segments(built.notes, "batched", dynamic, batched_path)
    for what in kinds:
        if f"{what}_error" in built.notes:
            print(f"  {work.key}: {what}: {built.notes[what + '_error']}", file=sys.stderr)
        else:
            cached = " (cached)" if built.notes[f"{what}_cached"] else ""
            print(f"  {work.key}: {what} compiled in {built.notes[what + '_compile_s']} s{cached}",
                  file=sys.stderr)
    return built


def _compile_segments(
    notes: dict[str, Any], what: str, ep: ExportedProgram, path: Path, **options: Any
) -> Path | None:
    """`compile_program(ep, path, "auto", **options)`, from the cache when there: the path
    (with the thread count its kernels are built for in its name, so that a package built for
    another count is not reused), or None with the error in `notes` (as `<what>_error`; times
    as `<what>_compile_s`)."""
    try:
        from asyncgraph.compiled import compile_program

        threads = ExecutorConfig().intra_op_threads_or_default  # compile_program's default
        path = path.with_name(f"{path.stem}-threads{threads}{path.suffix}")
        notes[f"{what}_compile_s"], notes[f"{what}_cached"] = _cached(
            path, lambda: compile_program(ep, path, "auto", threads=threads, **options))
    except Exception as exc:
        notes[f"{what}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    return path


def compile_autotuned(
    notes: dict[str, Any], what: str, ep: ExportedProgram, path: Path
) -> Path | None:
    """`_compile_segments(..., autotune=True)`, and which kernels each segment kept, with their
    times, in `notes` (as `<what>_kernels`)."""
    compiled = _compile_segments(notes, what, ep, path, autotune=True)
    if compiled is not None:
        from asyncgraph.compiled.package import read_manifest

        notes[f"{what}_kernels"] = "; ".join(
            s.get("kernels", "") for s in read_manifest(compiled)["segments"])
    return compiled


def _cached(path: Path, compile_now: Callable[[], Any]) -> tuple[float, bool]:
    """Seconds compiling `path` took, and whether it came from the cache (the time of the
    first compile is kept beside the package)."""
    record = path.with_name(path.name + ".compile_s")
    if path.exists():
        try:
            return float(record.read_text()), True
        except (OSError, ValueError):
            return float("nan"), True
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's export-time advice
        compile_now()
    seconds = round(time.perf_counter() - start, 1)
    record.write_text(f"{seconds}\n")
    return seconds, False


def nativert_runner(ep: ExportedProgram, folder: Path, key: str) -> Any:
    """nativert's runner of `ep`, packaged as the PT2 archive it loads (model "forward")."""
    runner_cls, why = check_nativert()
    if runner_cls is None:
        raise RuntimeError(why)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}-{digest(ep)}.nativert.pt2"
    if not path.exists():
        torch.export.pt2_archive._package.package_pt2(str(path), exported_programs={"forward": ep})
    return runner_cls(str(path), "forward")


# -- the scenario -------------------------------------------------------------------------------


async def run(ctx: Context, options: Options | None = None) -> list[CaseResult]:
    """One latency case per graph, and a 64-caller case for the graphs with targets."""
    options = options or Options()
    cases = []
    for work in workloads(ctx.settings, options.graphs):
        built = build_compiled(work, options) if options.compiled else Built()
        runner = (nativert_runner(work.ep, options.cache / "nativert", work.key)
                  if options.nativert else None)
        cases.append(await _latency_case(ctx, work, built, runner, options))
        if work.dynamic is not None:
            cases.append(await _concurrent_case(ctx, work, built, runner, options))
    return cases


async def _latency_case(
    ctx: Context, work: Workload, built: Built, runner: Any, options: Options
) -> CaseResult:
    x = work.x
    executors = [Executor(work.ep, ExecutorConfig()),
                 Executor(work.ep, ExecutorConfig(segments=("script",)))]
    peers = [asyncgraph_peer("asyncgraph", executors[0], [x], "plain graph, default config"),
             asyncgraph_peer(SCRIPTED, executors[1], [x], "ExecutorConfig(segments=('script',))")]
    for binding in (False, True) if options.compare_binding else (False,):
        compiled = _load_compiled(built, built.segments, binding=binding)
        if compiled is not None:
            executors.append(compiled)
            peers.append(asyncgraph_peer(COMPILED + (BINDING if binding else ""), compiled, [x],
                                         "compile_program(ep, path, 'auto')"))
    autotuned = _load_compiled(built, built.autotuned)
    if autotuned is not None:
        executors.append(autotuned)
        peers.append(asyncgraph_peer(AUTOTUNED, autotuned, [x], "autotune=True"))
    if runner is not None:
        peers.append(sync_peer(NATIVERT, lambda: runner.run(x), "PyModelRunner.run(x)"))
    if built.aoti is not None:
        aoti = in_inference(built.aoti)
        peers.append(sync_peer("AOTInductor", lambda: aoti(x), "aoti_load_package, whole model"))
    eager = in_inference(work.model)
    peers.append(sync_peer("eager model(x)", lambda: eager(x), "the nn.Module itself"))
    try:
        advance = ctx.task(f"{NAME}: {work.key} ({call_nodes(work.ep)} nodes)", ctx.rounds_total)
        results = await measure(peers, ctx.settings, advance, **TOLERANCE)
    finally:
        for ex in executors:
            await ex.aclose()
    case = CaseResult(NAME, f"{work.key} latency", f"{work.title}; one caller",
                      {"nodes": call_nodes(work.ep), **built.notes}, results)
    names = {p.name for p in results}
    for peer in ("asyncgraph", SCRIPTED, COMPILED, COMPILED + BINDING, AUTOTUNED,
                 "AOTInductor", "eager model(x)"):
        if peer in names and NATIVERT in names:
            case.metrics[f"{peer} / nativert"] = case.ratio(peer, NATIVERT)
    if work.targets and NATIVERT in names:
        for number, peer, what, limit in ((1, "asyncgraph", "asyncgraph", 1.0),
                                          (1, SCRIPTED, "asyncgraph scripted", 1.0),
                                          (2, COMPILED, "asyncgraph compiled", 0.6),
                                          (2, AUTOTUNED, "asyncgraph compiled autotuned", 0.6)):
            if peer in names or peer != AUTOTUNED:  # a compiled peer that did not load misses
                case.targets.append(Target(
                    number, f"{work.key}: latency, {what} / nativert", case.ratio(peer, NATIVERT),
                    "<=", limit, rounds=case.round_spread(peer, NATIVERT)))
    return case


def _load_compiled(
    built: Built, path: Path | None, config: ExecutorConfig | None = None, *,
    binding: bool = False,
) -> Executor | None:
    """The Executor of a compiled-segments package, or None with the load error kept in the
    notes (a package asyncgraph refuses is a finding to report, not a reason to lose the run).
    `binding`: its segments called through torch's binding (which holds the GIL) rather than
    their C entry points."""
    if path is None:
        return None
    from asyncgraph.compiled.native_call import CALL_ENV

    before = os.environ.get(CALL_ENV)
    try:
        if binding:
            os.environ[CALL_ENV] = "binding"
        return asyncgraph.load(path, config, trust_compiled=True)
    except Exception as exc:
        built.notes[f"{path.name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"  {path.name}: not loaded: {built.notes[f'{path.name}_error']}",
              file=sys.stderr)
        return None
    finally:
        if before is None:
            os.environ.pop(CALL_ENV, None)
        else:
            os.environ[CALL_ENV] = before


async def callers_case(
    ctx: Context, scenario: str, work: Workload, peers: list[Peer], executors: list[Executor],
    load: tuple[int, int], batched: Executor,
) -> CaseResult:
    """`load` = (callers, requests per caller) calling every peer at once, round by round; the
    executors closed after; the case with the batched Executor's mean batch rows."""
    callers, per_caller = load
    results = new_results(peers)
    try:
        await measure_concurrent(ctx, peers, results, callers, per_caller,
                                 f"{scenario}: {work.key}, {callers} callers")
    finally:
        for ex in executors:
            await ex.aclose()
    case = CaseResult(scenario, f"{work.key} x {callers} callers",
                      f"{work.title}; {callers} concurrent callers x {per_caller} requests",
                      {"nodes": call_nodes(work.ep), "callers": callers,
                       "requests_per_caller": per_caller},
                      [results[p.name] for p in peers], columns="metrics")
    stats = batched.batching_statistics()
    if stats is not None:
        case.params["mean_batch_rows"] = round(stats.mean_rows, 1)
    return case


async def _concurrent_case(
    ctx: Context, work: Workload, built: Built, runner: Any, options: Options
) -> CaseResult:
    s = ctx.settings
    callers, per_caller = s.pick(64, 64, 4), s.pick(8, 4, 1)
    assert work.dynamic is not None
    x = work.x
    unbatched = Executor(work.ep, ExecutorConfig())
    scripted = Executor(work.ep, ExecutorConfig(segments=("script",)))
    batching = ExecutorConfig(batching=BatchingConfig(max_batch_size=MAX_BATCH))
    batched = Executor(work.dynamic(), batching)
    scripted_batched = Executor(work.dynamic(), ExecutorConfig(
        segments=("script",), batching=BatchingConfig(max_batch_size=MAX_BATCH)))
    peers = [
        asyncgraph_peer("asyncgraph", unbatched, [x], "each request its own execution"),
        asyncgraph_peer(SCRIPTED, scripted, [x], "segments=('script',), unbatched"),
        asyncgraph_peer(BATCHED, batched, [x], f"dynamic batching, up to {MAX_BATCH} rows"),
        asyncgraph_peer(SCRIPTED_BATCHED, scripted_batched, [x],
                        f"segments=('script',), dynamic batching, up to {MAX_BATCH} rows"),
    ]
    executors = [unbatched, scripted, batched, scripted_batched]
    bindings = (False, True) if options.compare_binding else (False,)
    for name, path, config, binding in (
        *((COMPILED, built.segments, None, b) for b in bindings),
        (AUTOTUNED, built.autotuned, None, False),
        *((COMPILED_BATCHED, built.batched, batching, b) for b in bindings),
    ):
        loaded = _load_compiled(built, path, config, binding=binding)
        if loaded is not None:
            executors.append(loaded)
            what = (f"compiled segments, dynamic batching, up to {MAX_BATCH}"
                    if config is batching else f"{name}, unbatched")
            peers.append(asyncgraph_peer(name + (BINDING if binding else ""), loaded, [x],
                                         what + (", torch's binding" if binding else "")))
    if runner is not None:
        run_native = runner.run

        async def native_in_thread() -> Any:
            return await asyncio.to_thread(run_native, x)

        peers.append(Peer(NATIVERT_THREAD, native_in_thread, "asyncio.to_thread(runner.run, x)"))
    case = await callers_case(ctx, NAME, work, peers, executors, (callers, per_caller), batched)
    results = {r.name: r for r in case.peers}
    if runner is not None:
        base = results[NATIVERT_THREAD].extra.get("throughput")
        for number, peer, limit in ((3, "asyncgraph", 1.5), (3, SCRIPTED, 1.5),
                                    (3, COMPILED, 1.5), (3, AUTOTUNED, 1.5), (4, BATCHED, 4.0),
                                    (4, SCRIPTED_BATCHED, 4.0), (4, COMPILED_BATCHED, 4.0)):
            if peer not in results:
                continue
            mine = results[peer].extra.get("throughput")
            case.targets.append(Target(
                number, f"{work.key}, {callers} callers: throughput, {peer} / nativert "
                "via to_thread", mine / base if mine and base else None, ">=", limit,
                rounds=case.round_spread(peer, NATIVERT_THREAD)))
    return case


# -- the command --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    from asyncgraph.bench import suite

    parser = suite.standalone_parser(__doc__.splitlines()[0], GRAPHS)
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out AOTInductor and compiled segments")
    parser.add_argument("--cache", type=Path, default=CACHE, help="compiled packages' folder")
    parser.add_argument("--compare-binding", action="store_true",
                        help="also the compiled peers with their segments called through "
                        "torch's binding (holds the GIL), in the same rounds")
    args = parser.parse_args(argv)

    _, why = check_nativert()
    if why is not None:
        print(f"nativert_compare: cannot run: {why}. Run `make bench-nativert` (torch 2.11).",
              file=sys.stderr)
        return 2
    options = Options(graphs=tuple(args.graph or GRAPHS), compiled=not args.no_compile,
                      cache=args.cache, compare_binding=args.compare_binding)
    return suite.run_standalone(args, lambda ctx: run(ctx, options), width=130)


if __name__ == "__main__":
    sys.exit(main())
