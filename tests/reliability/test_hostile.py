"""Hostile input: damaged or malicious .pt2 files, NaN/inf inputs, huge and negative shapes.

Every hostile archive is refused with ProgramLoadError and a message that names what is
wrong, both by asyncgraph.graph.archive.check_pt2_archive and by loading it (asyncgraph.load), and
nothing from the file ever runs: payloads that would create a marker directory never do.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

import asyncgraph
from asyncgraph import Executor, InputValidationError, ProgramLoadError
from asyncgraph.graph.archive import check_pt2_archive, check_weights_only_pickle
from asyncgraph.testing import FaultInjector

pytestmark = pytest.mark.usefixtures("leak_check")

Members = dict[str, bytes]


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.arange(3.0))
        self.scale = torch.tensor([2.0, 3.0, 4.0])  # a lifted tensor constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


class Shared(torch.nn.Module):
    """Two inputs sharing a dynamic dimension: the JSON has symbols, ranges and a guard."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.sum(1) + y * x.shape[0]


class Derived(torch.nn.Module):
    """A derived dimension (2 * n): expressions in range constraints and guards with max()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.reshape(n // 2, 2 * x.shape[1]) + (n * 3) // 4


class Branchy(torch.nn.Module):
    """torch.cond: a higher-order op with subgraphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


def _save(ep: torch.export.ExportedProgram, path: Path) -> Path:
    torch.export.save(ep, path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("pt2")
    b = Dim("b", min=2, max=64)
    return {
        "affine": _save(torch.export.export(Affine().eval(), (torch.randn(2, 4),)),
                        root / "affine.pt2"),
        "shared": _save(torch.export.export(Shared(), (torch.randn(4, 3), torch.randn(4)),
                                            dynamic_shapes=({0: b}, {0: b})),
                        root / "shared.pt2"),
        "branchy": _save(torch.export.export(Branchy(), (torch.randn(3),)), root / "branchy.pt2"),
        "derived": _save(torch.export.export(Derived(), (torch.randn(4, 3),),
                                             dynamic_shapes=({0: Dim("n", min=2, max=64) * 2},)),
                         root / "derived.pt2"),
    }


def read(path: Path) -> Members:
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i.filename) for i in z.infolist()}


def write(members: Members, path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def root_of(members: Members) -> str:
    return next(iter(members)).split("/", 1)[0] + "/"


def edit_json(members: Members, rel: str, change: Callable[[Any], Any]) -> None:
    name = root_of(members) + rel
    members[name] = json.dumps(change(json.loads(members[name]))).encode()


class Evil:
    """Unpickling this creates a directory: the observable stand-in for running code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def torch_save_zip(data_pkl: bytes | None = None, extra: Members | None = None) -> bytes:
    """A torch.save archive of a tensor, with its data.pkl (or extra records) replaced."""
    buf = io.BytesIO()
    torch.save(torch.arange(3.0), buf)
    inner = read_bytes_zip(buf.getvalue())
    if data_pkl is not None:
        key = next(k for k in inner if k.endswith("/data.pkl"))
        inner[key] = data_pkl
    prefix = next(iter(inner)).split("/", 1)[0] + "/"
    for rel, data in (extra or {}).items():
        inner[prefix + rel] = data
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in inner.items():
            z.writestr(name, data)
    return out.getvalue()


def read_bytes_zip(data: bytes) -> Members:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def use_pickle(members: Members, weight: str, payload: bytes) -> None:
    """Mark weight `weight` as pickled and replace its payload file."""
    holder: dict[str, str] = {}

    def change(cfg: Any) -> Any:
        cfg["config"][weight]["use_pickle"] = True
        holder["file"] = cfg["config"][weight]["path_name"]
        return cfg

    edit_json(members, "data/weights/model_weights_config.json", change)
    members[root_of(members) + "data/weights/" + holder["file"]] = payload


# -- legitimate archives pass ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["affine", "shared", "branchy", "derived"])
async def test_valid_archives_are_accepted(saved: dict[str, Path], name: str) -> None:
    path = saved[name]
    check_pt2_archive(path)
    ep = torch.export.load(path)
    async with asyncgraph.load(path) as ex:
        inputs: tuple[torch.Tensor, ...] = (torch.randn(2, 4),)
        if name == "shared":
            inputs = (torch.randn(5, 3), torch.randn(5))
        elif name == "branchy":
            inputs = (torch.randn(3),)
        elif name == "derived":
            inputs = (torch.randn(10, 3),)
        torch.testing.assert_close(await ex.execute(*inputs), ep.module()(*inputs))


async def test_a_pickled_plain_tensor_weight_is_accepted(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    members = read(saved["affine"])
    use_pickle(members, "shift", torch_save_zip())
    path = write(members, tmp_path / "pickled.pt2")
    check_pt2_archive(path)
    async with asyncgraph.load(path) as ex:
        torch.testing.assert_close(ex.weights.tensors["shift"], torch.arange(3.0))


# -- hostile archives are refused -----------------------------------------------------------------


def _not_zip(m: Members, tmp: Path) -> bytes | None:
    return b"definitely not a zip archive"


def _truncated(m: Members, tmp: Path) -> bytes | None:
    data = write(m, tmp / "whole.pt2").read_bytes()
    return data[: len(data) // 2]


def _corrupt_member(m: Members, tmp: Path) -> bytes | None:
    data = bytearray(write(m, tmp / "whole.pt2").read_bytes())
    payload = m[root_of(m) + "data/weights/weight_0"]
    at = bytes(data).index(payload)
    data[at] ^= 0xFF
    return bytes(data)


def _invalid_json(m: Members, tmp: Path) -> None:
    m[root_of(m) + "models/model.json"] = b'{"graph_module": {'


def _not_a_program(m: Members, tmp: Path) -> None:
    m[root_of(m) + "models/model.json"] = b"[1, 2, 3]"


def _schema_version(m: Members, tmp: Path) -> None:
    edit_json(m, "models/model.json", lambda j: {**j, "schema_version": {"major": 99, "minor": 0}})


def _retarget(target: str) -> Callable[[Members, Path], None]:
    def change(m: Members, tmp: Path) -> None:
        def edit(j: Any) -> Any:
            j["graph_module"]["graph"]["nodes"][0]["target"] = target
            return j

        edit_json(m, "models/model.json", edit)

    return change


def _missing_payload(m: Members, tmp: Path) -> None:
    del m[root_of(m) + "data/weights/weight_0"]


def _missing_config_entry(m: Members, tmp: Path) -> None:
    def edit(cfg: Any) -> Any:
        del cfg["config"]["lin.weight"]
        return cfg

    edit_json(m, "data/weights/model_weights_config.json", edit)
    del m[root_of(m) + "data/weights/weight_0"]


def _missing_config(m: Members, tmp: Path) -> None:
    del m[root_of(m) + "data/weights/model_weights_config.json"]


def _short_payload(m: Members, tmp: Path) -> None:
    m[root_of(m) + "data/weights/weight_0"] = m[root_of(m) + "data/weights/weight_0"][:8]


def _tensor_meta(change: Callable[[Any], None]) -> Callable[[Members, Path], None]:
    def edit_members(m: Members, tmp: Path) -> None:
        def edit(cfg: Any) -> Any:
            change(cfg["config"]["lin.weight"]["tensor_meta"])
            return cfg

        edit_json(m, "data/weights/model_weights_config.json", edit)
        if "empty" in change.__name__:
            m[root_of(m) + "data/weights/weight_0"] = b""

    return edit_members


def huge_empty(meta: Any) -> None:
    meta["sizes"] = [{"as_int": 10**6}, {"as_int": 10**6}]


def negative_size(meta: Any) -> None:
    meta["sizes"][0] = {"as_int": -3}


def _evil_weight(m: Members, tmp: Path) -> None:
    use_pickle(m, "shift", torch_save_zip(pickle.dumps(Evil(tmp / "MARKER"), protocol=2)))


def _plain_pickle_weight(m: Members, tmp: Path) -> None:
    use_pickle(m, "shift", pickle.dumps(Evil(tmp / "MARKER"), protocol=2))


def _protocol4_weight(m: Members, tmp: Path) -> None:
    use_pickle(m, "shift", torch_save_zip(pickle.dumps(torch.Size([3]), protocol=4)))


def _torchscript_in_weight(m: Members, tmp: Path) -> None:
    use_pickle(m, "shift", torch_save_zip(extra={"constants.pkl": pickle.dumps(())}))


def _evil_sample_inputs(m: Members, tmp: Path) -> None:
    m[root_of(m) + "data/sample_inputs/model.pt"] = torch_save_zip(
        pickle.dumps(Evil(tmp / "MARKER"), protocol=2)
    )


def _custom_object(m: Members, tmp: Path) -> None:
    def edit(cfg: Any) -> Any:
        cfg["config"]["scale"] = {"path_name": "custom_obj_0", "is_param": False,
                                  "use_pickle": True, "tensor_meta": None}
        return cfg

    edit_json(m, "data/constants/model_constants_config.json", edit)
    m[root_of(m) + "data/constants/custom_obj_0"] = pickle.dumps(Evil(tmp / "MARKER"))


def _aoti(m: Members, tmp: Path) -> None:
    m[root_of(m) + "data/aotinductor/model/model.so"] = b"\x7fELF"


def _unsafe_path(m: Members, tmp: Path) -> None:
    m[root_of(m) + "extra/../../evil.py"] = b"print('hi')"


def _unexpected_member(m: Members, tmp: Path) -> None:
    m[root_of(m) + "code/__torch__/model.py"] = b"def forward(self): pass"


def _legacy(m: Members, tmp: Path) -> bytes | None:
    legacy: Members = {"version": b"8.20", "serialized_exported_program.json": b"{}"}
    return write(legacy, tmp / "legacy.pt2").read_bytes()


def _archive_format(m: Members, tmp: Path) -> None:
    m[root_of(m) + "archive_format"] = b"zip"


AFFINE_CASES: list[tuple[str, Callable[[Members, Path], bytes | None], str]] = [
    ("not_zip", _not_zip, "not a zip file"),
    ("truncated", _truncated, "truncated or corrupt"),
    ("corrupt_member", _corrupt_member, "corrupt"),
    ("invalid_json", _invalid_json, "models/model.json: invalid JSON"),
    ("not_a_program", _not_a_program, "not a serialized ExportedProgram"),
    ("schema_version", _schema_version, "schema version"),
    ("target_torch_load", _retarget("torch.load"), "target 'torch.load' is not an operator"),
    ("target_load_library", _retarget("torch.ops.load_library"), "is not an operator"),
    ("target_dunder", _retarget("torch.__builtins__.eval"), "is not an operator"),
    ("target_extension", _retarget("#evil:op"), "is not an operator"),
    ("missing_payload", _missing_payload, "weight_0' is missing from the archive"),
    ("missing_weight", _missing_config_entry, "parameter 'lin.weight', which is missing"),
    ("missing_config", _missing_config, "missing member 'data/weights/model_weights_config"),
    ("short_payload", _short_payload, "needs 48"),
    ("huge_empty_payload", _tensor_meta(huge_empty), "is empty but its shape"),
    ("negative_size", _tensor_meta(negative_size), "negative size"),
    ("evil_pickled_weight", _evil_weight, "references 'posix.mkdir'"),
    ("plain_pickle_weight", _plain_pickle_weight, "outside torch.save's zip format"),
    ("protocol4_weight", _protocol4_weight, "opcode"),
    ("torchscript_in_weight", _torchscript_in_weight, "unexpected record"),
    ("evil_sample_inputs", _evil_sample_inputs, "sample_inputs/model.pt: the pickle references"),
    ("custom_object", _custom_object, "pickled Python/TorchScript object"),
    ("aotinductor", _aoti, "AOTInductor compiled code"),
    ("unsafe_path", _unsafe_path, "unsafe path"),
    ("unexpected_member", _unexpected_member, "unexpected member 'code/"),
    ("legacy_format", _legacy, "legacy .pt2 format"),
    ("archive_format", _archive_format, "archive_format is not 'pt2'"),
]


def _sym_injection(m: Members, tmp: Path) -> None:
    marker = tmp / "MARKER"

    def edit(j: Any) -> Any:
        text = json.dumps(j)
        start = text.index('"expr_str": "') + len('"expr_str": "')
        end = text.index('"', start)
        payload = f"__import__('os').mkdir('{marker}') or " + text[start:end]
        return json.loads(text[:start] + payload.replace("'", "\\u0027") + text[end:])

    edit_json(m, "models/model.json", edit)


def _guard_injection(m: Members, tmp: Path) -> None:
    def edit(j: Any) -> Any:
        j["guards_code"] = [g + f" or __import__('os').mkdir('{tmp / 'MARKER'}')"
                            for g in j["guards_code"]]
        return j

    edit_json(m, "models/model.json", edit)


def _range_key(m: Members, tmp: Path) -> None:
    def edit(j: Any) -> Any:
        j["range_constraints"] = {f"__import__('os').mkdir('{tmp / 'M'}')": v
                                  for v in j["range_constraints"].values()}
        return j

    edit_json(m, "models/model.json", edit)


SHARED_CASES: list[tuple[str, Callable[[Members, Path], bytes | None], str]] = [
    ("sympy_injection", _sym_injection, "symbolic expression"),
    ("guard_injection", _guard_injection, "guard .* is not a comparison"),
    ("range_key_injection", _range_key, "range constraint .* is not an expression"),
]


def _hostile(base: Path, mutate: Callable[[Members, Path], bytes | None], tmp: Path) -> Path:
    members = read(base)
    raw = mutate(members, tmp)
    path = tmp / "hostile.pt2"
    if raw is not None:
        path.write_bytes(raw)
        return path
    return write(members, path)


async def _assert_refused(path: Path, message: str, tmp: Path) -> None:
    with pytest.raises(ProgramLoadError, match=message) as info:
        check_pt2_archive(path)
    assert str(path) in str(info.value), "the error must name the file"
    load_message = "truncated|not a zip" if "truncated" in message else message
    with pytest.raises(ProgramLoadError, match=load_message):
        asyncgraph.load(path)
    with pytest.raises(ProgramLoadError, match=load_message):
        Executor(str(path))
    assert not (tmp / "MARKER").exists(), "code from the file ran"


@pytest.mark.parametrize(("case", "mutate", "message"), AFFINE_CASES,
                         ids=[c[0] for c in AFFINE_CASES])
async def test_hostile_archive_is_refused(
    saved: dict[str, Path], tmp_path: Path, case: str,
    mutate: Callable[[Members, Path], bytes | None], message: str,
) -> None:
    await _assert_refused(_hostile(saved["affine"], mutate, tmp_path), message, tmp_path)


@pytest.mark.parametrize(("case", "mutate", "message"), SHARED_CASES,
                         ids=[c[0] for c in SHARED_CASES])
async def test_hostile_graph_json_is_refused(
    saved: dict[str, Path], tmp_path: Path, case: str,
    mutate: Callable[[Members, Path], bytes | None], message: str,
) -> None:
    await _assert_refused(_hostile(saved["shared"], mutate, tmp_path), message, tmp_path)


def test_torch_alone_would_run_the_pickled_payload(saved: dict[str, Path], tmp_path: Path) -> None:
    """Why the check exists: torch.export.load unpickles `use_pickle` weights fully."""
    path = _hostile(saved["affine"], _evil_weight, tmp_path)
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        torch.export.load(path)
    if not (tmp_path / "MARKER").exists():
        pytest.skip("this torch no longer runs code from pickled weights")
    (tmp_path / "MARKER").rmdir()


def test_torch_alone_would_evaluate_symbolic_expressions(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Why the check exists: torch.export.load passes the JSON's expr_str to sympy.sympify."""
    path = _hostile(saved["shared"], _sym_injection, tmp_path)
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        torch.export.load(path)
    if not (tmp_path / "MARKER").exists():
        pytest.skip("this torch no longer evaluates symbolic expressions from the file")
    (tmp_path / "MARKER").rmdir()


def test_weights_only_pickle_scan() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    pkl = next(v for k, v in read_bytes_zip(buf.getvalue()).items() if k.endswith("data.pkl"))
    check_weights_only_pickle(pkl)
    evil = b"\x80\x02c__builtin__\neval\nq\x00X\x01\x00\x00\x001q\x01\x85q\x02Rq\x03."
    with pytest.raises(ProgramLoadError, match=r"builtins\.eval"):
        check_weights_only_pickle(evil)
    with pytest.raises(ProgramLoadError, match=r"truncated pickle|malformed"):
        check_weights_only_pickle(pkl[:-1])


# -- hostile requests ---------------------------------------------------------------------------


class PassThrough(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + 0, x * 2, torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)


async def test_nan_and_inf_pass_through_unchanged() -> None:
    ep = torch.export.export(PassThrough(), (torch.randn(6),))
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e38])
    async with Executor(ep) as ex:
        same, doubled, cleaned = await ex.execute(x)
    assert torch.equal(same.isnan(), x.isnan())
    assert torch.equal(same[~x.isnan()], x[~x.isnan()])
    torch.testing.assert_close(doubled, x * 2, equal_nan=True)
    torch.testing.assert_close(cleaned, torch.tensor([0.0, 1.0, -1.0, 0.0, -0.0, 1e38]))


class Rows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1).sum(1)


class Zeros(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.sum() + torch.ones(n).sum()


async def test_huge_dimension_rejected_before_any_allocation() -> None:
    rows = Dim("rows", min=1, max=1024)
    ep = torch.export.export(Rows(), (torch.randn(4, 8),), dynamic_shapes=({0: rows},))
    faults = FaultInjector()
    async with Executor(ep, kernel_factory=faults.kernel_factory()) as ex:
        huge = torch.zeros(1, 8).expand(2**40, 8)  # 2**43 elements, no memory behind them
        with pytest.raises(InputValidationError, match=r"^x\.shape\[0\].*\[1, 1024\]"):
            await ex.execute(huge)
        wrong = torch.zeros(1).expand(2**40)
        with pytest.raises(InputValidationError, match="expected 2 dimension"):
            await ex.execute(wrong)
        stats = ex.statistics()
        assert stats.started == 0 and stats.frames.created == 0
        assert sum(faults.calls(n.name) for n in ex.graph.nodes) == 0, "a kernel ran"
        torch.testing.assert_close(await ex.execute(torch.ones(3, 8)), torch.full((3,), 16.0))


async def test_negative_size_rejected_before_any_allocation() -> None:
    ep = torch.export.export(Zeros(), (torch.ones(3), 5),
                             dynamic_shapes={"x": None, "n": Dim.DYNAMIC})
    faults = FaultInjector()
    async with Executor(ep, kernel_factory=faults.kernel_factory()) as ex:
        with pytest.raises(InputValidationError, match=r"^n: "):
            await ex.execute(torch.ones(3), -3)
        assert ex.statistics().started == 0
        assert sum(faults.calls(n.name) for n in ex.graph.nodes) == 0
        assert float(await ex.execute(torch.ones(3), 4)) == 7.0


async def test_huge_unbounded_size_rejected_before_any_allocation() -> None:
    ep = torch.export.export(Zeros(), (torch.ones(3), 5),
                             dynamic_shapes={"x": None, "n": Dim.DYNAMIC})
    async with Executor(ep) as ex:
        with pytest.raises(InputValidationError):
            await ex.execute(torch.ones(3), 2**50)  # 4 PiB: beyond any address space
