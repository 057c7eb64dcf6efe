"""The persistent cache of exported segments (asyncgraph/compiled/export_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from asyncgraph.compiled import export_cache
from asyncgraph.compiled.onnx_export import OnnxModel


class Scaled(torch.nn.Module):
    """At module level: a traced module pickles by its class's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3 - 1


MODEL = OnnxModel(b"\x08\x07model-bytes", ("x", "w"), (False, True), ("out",), False, False,
                  ("w",))


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(export_cache.ENV, str(tmp_path))
    return tmp_path


def test_a_stored_export_loads_back_equal(root: Path) -> None:
    key = export_cache.key_of("onnx", "code", ("spec",))
    assert export_cache.load("onnx", key, OnnxModel) is None
    export_cache.store("onnx", key, MODEL)
    assert export_cache.load("onnx", key, OnnxModel) == MODEL
    assert sorted(p.suffix for p in (root / "onnx").iterdir()) == [".json", ".onnx"]


def test_the_key_depends_on_the_code_the_specs_and_the_kind() -> None:
    base = export_cache.key_of("onnx", "code", ("spec",))
    assert base == export_cache.key_of("onnx", "code", ("spec",))
    assert len({base, export_cache.key_of("onnx", "code2", ("spec",)),
                export_cache.key_of("onnx", "code", ("spec2",)),
                export_cache.key_of("aoti", "code", ("spec",))}) == 4


def test_a_truncated_file_is_a_miss_and_is_rewritten(root: Path, caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    key = export_cache.key_of("onnx", "truncated")
    export_cache.store("onnx", key, MODEL)
    (root / "onnx" / f"{key}.onnx").write_bytes(MODEL.model[:3])
    assert export_cache.load("onnx", key, OnnxModel) is None
    assert "not the size written" in caplog.text
    export_cache.store("onnx", key, MODEL)
    assert export_cache.load("onnx", key, OnnxModel) == MODEL


def test_an_empty_setting_turns_the_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    monkeypatch.setenv(export_cache.ENV, "")
    assert export_cache.cache_root() is None
    export_cache.store("onnx", "k", MODEL)
    assert export_cache.load("onnx", "k", OnnxModel) is None
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_root_only_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(export_cache.ENV, str(blocker))
    export_cache.store("onnx", "k", MODEL)
    assert "could not cache an export" in caplog.text


def test_a_second_export_of_a_segment_reads_the_disk_not_the_exporter(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from asyncgraph.compiled import onnx_export

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 2 + 1

    module = torch.fx.symbolic_trace(Net())
    specs = [onnx_export.InputSpec(torch.float32, (2, 3), (2, 3), baked=False)]
    first = onnx_export.export_segment(module, specs)
    monkeypatch.setattr(onnx_export, "_CACHE", type(onnx_export._CACHE)())  # a new process
    monkeypatch.setattr(onnx_export, "_export", lambda *a: pytest.fail("exported again"))
    assert onnx_export.export_segment(module, specs) == first


def test_an_export_in_a_child_process_is_the_in_process_export(root: Path) -> None:
    """A fast form's export runs in a child (compiled/export_worker.py), which shares no GIL
    with the serving loop; what comes back is the model the process would have made."""
    import torch

    from asyncgraph.compiled import onnx_export

    module = torch.fx.symbolic_trace(Scaled())
    specs = [onnx_export.InputSpec(torch.float32, (2, 3), (2, 3), baked=False)]
    here = onnx_export._export(module, specs)
    there = onnx_export.export_elsewhere(module, specs)
    assert (there.inputs, there.baked, there.outputs) == (here.inputs, here.baked, here.outputs)
    assert len(there.model) > 0


def test_a_child_whose_export_fails_names_the_reason(root: Path) -> None:
    import torch

    from asyncgraph.compiled import onnx_export

    specs = [onnx_export.InputSpec(torch.complex64, (2, 3), (2, 3), baked=False)]
    with pytest.raises(onnx_export.ExportFailed, match="complex64"):
        onnx_export.export_elsewhere(torch.fx.symbolic_trace(Scaled()), specs)
