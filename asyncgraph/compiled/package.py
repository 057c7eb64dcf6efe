"""The compiled package (MODEL.aoti.pt2): write it, check it belongs here, load it.

Layout: one .pt2 archive in torch's own package_pt2 layout, so the rules of
asyncgraph/graph/archive/ check it like any other:

    <root>/models/model.json, data/weights/..., data/sample_inputs/model.pt, ...
        the original ExportedProgram, exactly as torch.export.save writes it;
    <root>/data/aotinductor/aoti_segment_<i>/*.so, *.cpp, *_metadata.json
        one AOTInductor model per segment, as aoti_compile_and_package writes it;
    <root>/extra/asyncgraph_compiled.json
        the manifest: segment -> node names, inputs and outputs, the torch version, the
        platform (machine, CPU instruction set) and the asyncgraph version it was built with.

Loading runs native code (the .so files), so it needs the caller's explicit trust
(`trust_compiled=True`, `--trust-compiled`). A package built with another torch version or for
another machine or CPU is refused before any of its code is loaded: the AOTI ABI and the
instructions the kernels use both depend on them. The program is then imported as usual from
the archive's ExportedProgram (read from a copy without the compiled members, so torch never
loads them itself), and each segment's run of nodes is replaced by one delegate node named
after the segment, followed by operator.getitem nodes for its outputs.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

# registers the package's AOTI members with the archive check: load_compiled checks with them,
# and a caller may reach it (compile_program's load-back) without asyncgraph.loading
from asyncgraph.compiled import package_members  # noqa: F401
from asyncgraph.compiled.delegate import AOTIDelegate
from asyncgraph.compiled.loop_call import LoopBindingContainer, wants_loop_binding
from asyncgraph.compiled.native_call import (
    CALL_ENV,
    CheckedContainer,
    NativeModel,
    NativeUnavailable,
    call_mode,
    checked_verdict,
)
from asyncgraph.compiled.packing import PackedConstant
from asyncgraph.compiled.segments import Segment, _segment, replace_segments
from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph.archive import COMPILED_MANIFEST, check_pt2_archive
from asyncgraph.graph.ir import WEIGHT_KINDS, Graph

logger = logging.getLogger(__name__)

FORMAT = "asyncgraph-aoti/2"  # /2: weights are constants of the segments
_AOTI_DIR = "data/aotinductor/"


@dataclass(frozen=True)
class SegmentRecord:
    """One compiled segment as the manifest lists it."""

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    contiguous: tuple[bool, ...]
    cost: int = 0
    compile_s: float = 0.0
    # per input: its AOTI constant name when the segment bakes it in (a weight), else ""
    constants: tuple[str, ...] = ()
    autotuned: bool = False  # compiled with max-autotune (compile_program(autotune=True))
    kernels: str = ""  # why these kernels: autotuned against default, timed (choice.py)
    packed: tuple[PackedConstant, ...] = ()  # constants a swap derives from its weights
    frozen: str = ""  # why its weights cannot be swapped ("" when they can)
    transposed: tuple[str, ...] = ()  # constants stored as their weight's contiguous transpose


def build_platform() -> dict[str, str]:
    """What compiled code depends on, of the running process: torch, machine, CPU ISA."""
    from torch._inductor.codecache import get_device_information

    info = {k: str(v) for k, v in get_device_information("cpu").items()}
    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_isa": info.get("AOTI_CPU_ISA", ""),
        "system": info.get("AOTI_PLATFORM", platform.system().lower()),
    }


def write_package(
    output: str | os.PathLike[str],
    ep: ExportedProgram,
    segments: Sequence[tuple[SegmentRecord, Path]],
    *,
    mode: str,
    nodes_total: int,
    failed: list[dict[str, Any]],
    threads: int = 1,
) -> None:
    """Write the package: `ep` (torch.export.save), each segment's AOTI model, the manifest."""
    import asyncgraph

    manifest = {
        "format": FORMAT,
        "asyncgraph": asyncgraph.__version__,
        "platform": build_platform(),
        "mode": mode,
        "threads": threads,  # the intra-op thread count its kernels were built for
        "nodes_total": nodes_total,
        "segments": [asdict(record) for record, _ in segments],
        "failed": failed,
        "program": program_digest(ep),  # which program the segments were spliced out of
    }
    out = Path(output)
    with tempfile.TemporaryDirectory(prefix="asyncgraph-pkg-") as tmp:
        program_file = Path(tmp) / "program.pt2"
        torch.export.save(ep, program_file)
        staging = Path(tmp) / out.name
        with zipfile.ZipFile(program_file) as program, zipfile.ZipFile(
            staging, "w", zipfile.ZIP_STORED
        ) as archive:
            root = "model/"
            for info in program.infolist():
                rel = info.filename.split("/", 1)[1]
                archive.writestr(root + rel, program.read(info))
            for record, aoti in segments:
                _copy_aoti_model(aoti, record.name, archive, root)
            archive.writestr(root + "extra/" + COMPILED_MANIFEST, json.dumps(manifest, indent=1))
        shutil.move(staging, out)


def _copy_aoti_model(aoti: Path, name: str, archive: zipfile.ZipFile, root: str) -> None:
    with zipfile.ZipFile(aoti) as package:
        for info in package.infolist():
            rel = info.filename.split("/", 1)[1]
            if rel.startswith(_AOTI_DIR + "model/"):
                file = rel[len(_AOTI_DIR + "model/"):]
                archive.writestr(f"{root}{_AOTI_DIR}{name}/{file}", package.read(info))


# -- loading -------------------------------------------------------------------------------------


def program_digest(ep: ExportedProgram) -> str:
    """What tells one exported program from another for splicing: its imported graph with
    every value's spec (`Graph.described`), hashed."""
    from asyncgraph.graph.importers import from_exported_program

    return _graph_digest(from_exported_program(ep).graph)


def _graph_digest(graph: Graph) -> str:
    return hashlib.sha256(graph.described().encode()).hexdigest()


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a compiled package (after check_pt2_archive has checked it)."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/extra/" + COMPILED_MANIFEST))
        manifest: dict[str, Any] = json.loads(archive.read(name))
    return manifest


def check_compatible(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> None:
    """Refuse a package built with another torch version, or for another machine or CPU."""
    built = manifest.get("platform", {})
    here = build_platform()
    what = {"torch": "torch version", "machine": "machine", "cpu_isa": "CPU instruction set",
            "system": "operating system"}
    for key, label in what.items():
        if str(built.get(key)) != here[key]:
            raise ProgramLoadError(
                f"{path}: compiled for {label} {built.get(key)!r}, but this process runs "
                f"{label} {here[key]!r}; compile the program again here "
                "(asyncgraph compile MODEL.pt2 -o MODEL.aoti.pt2)"
            )


def load_compiled(
    path: str | os.PathLike[str], *, runners: int = 1, threads: int | None = None,
    source: ExportedProgram | None = None,
) -> Any:
    """The Program of a compiled package: checked, then imported with its delegate nodes.

    `runners` is how many copies of each compiled model can run at once (executions in
    parallel on worker threads); the caller has already opted in to native code. `threads`:
    the intra-op thread count the workers run with, when known (a warning says when the
    package's kernels were built for fewer). `source`: the exported program the package was
    compiled from, when the caller holds it (a fast form's build, compiled/aoti_form.py): its
    graph takes the delegate nodes instead of the archive's copy, which `torch.export.load`
    would decode on the calling thread holding the GIL for milliseconds at a time while a
    restart's first requests wait (README, the first-burst table); the archive's copy is
    loaded unless the manifest names `source` as the program the package was compiled from
    (`program_digest`: the same graph with the same shapes, dtypes and dynamic dimensions).
    """
    from asyncgraph.graph.importers import Program, from_exported_program

    p = Path(path)
    check_pt2_archive(p, trust_compiled=True)
    manifest = read_manifest(p)
    check_compatible(p, manifest)
    built_for = manifest.get("threads")
    if threads is not None and isinstance(built_for, int) and built_for < threads:
        logger.warning(
            "%s: its kernels were built for %d intra-op thread(s) and the workers run %d: "
            "each compiled segment uses %d (compile again with --threads %d to use them all)",
            p, built_for, threads, built_for, threads,
        )
    records = [_record(s) for s in manifest["segments"]]
    program = from_exported_program(source) if source is not None else None
    if program is None or manifest.get("program") != _graph_digest(program.graph):
        source = load_source_program(p)
        program = from_exported_program(source)
    graph = splice(program.graph, records, str(p), max(1, runners), program.weights)
    return Program(graph, program.weights, p.name, program.reference, source)


def _record(entry: Mapping[str, Any]) -> SegmentRecord:
    return SegmentRecord(
        name=str(entry["name"]), nodes=tuple(entry["nodes"]), inputs=tuple(entry["inputs"]),
        outputs=tuple(entry["outputs"]), contiguous=tuple(bool(c) for c in entry["contiguous"]),
        cost=int(entry.get("cost", 0)), compile_s=float(entry.get("compile_s", 0.0)),
        constants=tuple(str(c) for c in entry.get("constants", ())),
        autotuned=bool(entry.get("autotuned", False)),
        kernels=str(entry.get("kernels", "")),
        packed=tuple(PackedConstant(str(p["name"]), str(p["source"]), bool(p["transposed"]),
                                    (int(p["shape"][0]), int(p["shape"][1]), int(p["shape"][2])))
                     for p in entry.get("packed", ())),
        frozen=_frozen_reason(entry.get("frozen", "")),
        transposed=tuple(str(c) for c in entry.get("transposed", ())),
    )


def _frozen_reason(value: Any) -> str:
    """The manifest's "frozen": a reason, or true from packages of frozen_weights=True."""
    if value is True:
        return "weights packed at compile time (frozen_weights=True)"
    return str(value or "")


def load_source_program(path: Path) -> ExportedProgram:
    """torch.export.load of the archive without its compiled members (torch would load every
    AOTI model itself, single-runner, on top of ours)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(buffer, "w") as copy:
        for info in source.infolist():
            if f"/{_AOTI_DIR}" not in info.filename:
                copy.writestr(info, source.read(info))
    buffer.seek(0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return torch.export.load(buffer)
    except Exception as exc:
        raise ProgramLoadError(f"{path}: cannot load the exported program: {exc}") from exc


def splice(
    graph: Graph, records: Sequence[SegmentRecord], package: str, runners: int,
    weights: Mapping[str, Any] | None = None,
) -> Graph:
    """`graph` with each segment's nodes replaced by its delegate node and getitems.
    `weights` (name -> tensor) are those the compiled segments were built with."""
    named = weights or {}
    baked = {s.value: (s.target or "", named.get(s.target or "")) for s in graph.signature.inputs
             if s.kind in WEIGHT_KINDS}
    matched = {segment.start: (record, segment)
               for record in records for segment in [_match(graph, record, package)]}

    def delegate(segment: Segment) -> tuple[str, AOTIDelegate]:
        record = matched[segment.start][0]
        return record.name, _delegate(record, segment, package, runners, baked)

    return replace_segments(graph, [s for _, s in matched.values()], delegate)


def _match(graph: Graph, record: SegmentRecord, package: str) -> Segment:
    """The segment of `graph` the record names, checked to be the run it was compiled from."""
    try:
        indices = [graph.node(name).index for name in record.nodes]
    except KeyError as exc:
        raise ProgramLoadError(
            f"{package}: {record.name} names {exc.args[0]}; the program does not match "
            "its compiled segments"
        ) from None
    start = indices[0] if indices else -1
    if not indices or indices != list(range(start, start + len(indices))):
        raise ProgramLoadError(
            f"{package}: the nodes of {record.name} are not one run of the program"
        )
    segment = _segment(graph, 0, start, start + len(indices))
    inputs = tuple(graph.values[v].name for v in segment.inputs)
    outputs = tuple(graph.values[v].name for v in segment.outputs)
    if inputs != record.inputs or outputs != record.outputs:
        raise ProgramLoadError(
            f"{package}: {record.name} was compiled for inputs {list(record.inputs)} and "
            f"outputs {list(record.outputs)}, but the program gives it {list(inputs)} and "
            f"{list(outputs)}"
        )
    if len(record.contiguous) != len(inputs):
        raise ProgramLoadError(f"{package}: {record.name}: malformed 'contiguous' list")
    if record.constants and len(record.constants) != len(inputs):
        raise ProgramLoadError(f"{package}: {record.name}: malformed 'constants' list")
    stray = sorted(set(record.transposed) - set(record.constants) - {""})
    if stray or "" in record.transposed:
        raise ProgramLoadError(  # a swap would transpose a weight the model reads as it is
            f"{package}: {record.name} lists transposed constants {stray or ['']} that are "
            f"not among its constants {[c for c in record.constants if c]}"
        )
    return segment


def _delegate(
    record: SegmentRecord, segment: Segment, package: str, runners: int,
    weights: Mapping[int, tuple[str, Any]],
) -> AOTIDelegate:
    try:
        loader, new_loader, call = segment_containers(package, record.name, runners)
    except Exception as exc:
        raise ProgramLoadError(f"{package}: cannot load {record.name}: {exc}") from exc
    constants = record.constants or ("",) * len(record.inputs)
    named = [weights.get(v, ("", None)) if c else ("", None)
             for v, c in zip(segment.inputs, constants, strict=True)]
    fqns = set(loader.get_constant_fqns())
    unknown = [c for c in (*constants, *(p.name for p in record.packed))
               if c and c not in fqns and not record.frozen]
    if unknown:
        raise ProgramLoadError(
            f"{package}: {record.name} lists constants {unknown} that its AOTI model lacks "
            f"(it has {sorted(fqns)})"
        )
    return AOTIDelegate(record.name, loader, record.contiguous, record.nodes, record.cost,
                        constants=constants, baked=[t for _, t in named],
                        new_loader=new_loader, weight_names=[n for n, _ in named],
                        packed=record.packed, frozen=record.frozen, call=call,
                        transposed=record.transposed)


def segment_containers(
    package: str, segment: str, runners: int
) -> tuple[Any, Callable[[], Any], str]:
    """The first container of a segment, a maker of more, and how they are called: through
    the model's C entry points with the GIL released (native_call.py), the first call checked
    against torch's binding once per model in the process; or through the binding
    (AOTIModelPackageLoader, which holds the GIL while the model runs) where the C path is
    unavailable or ASYNCGRAPH_AOTI_CALL=binding."""

    def binding() -> Any:
        return torch._C._aoti.AOTIModelPackageLoader(package, segment, False, runners, -1)

    mode = call_mode()  # read once: every container of the segment is called alike
    if mode == "binding":
        return binding(), binding, f"binding ({CALL_ENV}=binding)"
    try:
        model = NativeModel.load(package, segment)
    except NativeUnavailable as exc:
        return binding(), binding, f"binding ({exc})"
    verdict = checked_verdict(model.digest)
    if verdict:  # this model disagreed with the binding before, in this process
        return binding(), binding, f"binding ({verdict})"

    def container() -> Any:
        """Native, checked on its first call until this process has the model's verdict;
        a small model's with torch's binding beside it for calls on the loop (loop_call.py)."""
        verdict = checked_verdict(model.digest)
        if verdict:
            return binding()
        native = model.container(runners, binding)
        pair = LoopBindingContainer if wants_loop_binding(native, mode) else None
        if verdict == "":
            return native if pair is None else pair(native, binding())
        return CheckedContainer(native, binding(), None, model.digest, pair)

    return container(), container, "native"
