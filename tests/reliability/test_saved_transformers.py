"""Saved transformers models load as torch.export.load reads them: the archive checks
(asyncgraph/graph/archive/) must refuse hostile programs without refusing real ones.

Every language model below combines its attention mask with `&`, saved as the node target
`torch.ops.aten.__and__.Tensor`, and returns a transformers ModelOutput, a pytree type that
exists only once `transformers.modeling_outputs` is imported.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import torch

import asyncgraph
from asyncgraph.graph.archive import check_pt2_archive
from asyncgraph.graph.archive.operators import is_allowed_target
from asyncgraph.serve import create_app, running_server
from tests.support.transformers_zoo import ZOO, example_inputs, export_zoo_model

pytestmark = pytest.mark.usefixtures("leak_check")

CHILD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("transformers")
    out: dict[str, tuple[torch.nn.Module, Path]] = {}
    for name in ZOO:
        model, ep = export_zoo_model(name)
        torch.export.save(ep, root / f"{name}.pt2")
        out[name] = (model, root / f"{name}.pt2")
    return out


def _targets(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return "".join(z.read(n).decode() for n in z.namelist() if n.endswith("models/model.json"))


@pytest.mark.parametrize("name", list(ZOO))
async def test_a_saved_transformers_model_loads_and_matches_eager(
    saved: dict[str, tuple[torch.nn.Module, Path]], name: str
) -> None:
    model, path = saved[name]
    assert "torch.ops.aten.__and__.Tensor" in _targets(path), "the case this test is for"
    check_pt2_archive(path)
    args, kwargs = example_inputs(seed=1)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    async with asyncgraph.load(path) as ex:
        got = await ex.execute(*args, **kwargs)
    assert type(got) is type(expected)
    assert list(got.keys()) == list(expected.keys())
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=f"{name}: output {key!r}")


@pytest.mark.parametrize("target", [
    "torch.ops.aten.__and__.Tensor", "torch.ops.aten.__or__.Tensor",
    "torch.ops.aten.__xor__.Tensor", "torch.ops.aten.__lshift__.Scalar",
    "torch.ops.aten.__rshift__.Scalar", "torch.ops.aten.__and__", "torch.ops.aten.add.Tensor",
    "torch.ops.higher_order.cond",
])
def test_registered_operators_are_allowed_whatever_their_name(target: str) -> None:
    assert is_allowed_target(target)


@pytest.mark.parametrize("target", [
    "torch.ops.aten.__class__", "torch.ops.aten.__init__", "torch.ops.aten.__dict__",
    "torch.ops.aten.add.__call__", "torch.ops.aten.__and__.__init__",
    "torch.ops.__class__.__init__", "torch.ops.load_library", "torch.ops.loaded_libraries",
    "torch.ops.aten.add.Tensor.__call__", "torch.ops.higher_order.cond.__call__",
    "torch.ops.aten.name", "torch.__builtins__.eval",
])
def test_anything_else_under_torch_ops_is_refused(target: str) -> None:
    assert not is_allowed_target(target)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`asyncgraph ARGS` in a process of its own: transformers is not imported there unless
    the command imports it."""
    return subprocess.run(
        [sys.executable, "-m", "asyncgraph.cli.main", *args], capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S, check=False,
    )


def test_an_unregistered_output_type_is_one_line_naming_the_import(
    saved: dict[str, tuple[torch.nn.Module, Path]],
) -> None:
    _, path = saved["bert"]
    refused = _cli("run", str(path), "--random")
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr  # not torch's 30 lines of warnings
    assert "transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions" in lines[0]
    assert "--import transformers.modeling_outputs" in lines[0]
    assert str(path) in lines[0]

    served = _cli("run", str(path), "--random", "--import", "transformers.modeling_outputs")
    assert served.returncode == 0, served.stderr
    assert "last_hidden_state" in served.stdout and "pooler_output" in served.stdout


def test_an_import_that_fails_is_a_usage_error_naming_the_module(
    saved: dict[str, tuple[torch.nn.Module, Path]],
) -> None:
    _, path = saved["bert"]
    result = _cli("run", str(path), "--random", "--import", "no_such_module_here")
    assert result.returncode != 0
    assert "cannot import 'no_such_module_here'" in result.stderr


async def test_served_outputs_keep_the_model_output_names(
    saved: dict[str, tuple[torch.nn.Module, Path]],
) -> None:
    model, path = saved["bert"]
    (ids,), kwargs = example_inputs(seed=2)
    async with asyncgraph.load(path) as ex:
        app = create_app({"bert": ex}, calibrate=False)
        async with running_server(app) as url, httpx.AsyncClient(base_url=url) as client:
            meta = (await client.get("/v2/models/bert")).json()
            assert [o["name"] for o in meta["outputs"]] == ["last_hidden_state", "pooler_output"]
            body = {"inputs": [
                {"name": meta["inputs"][0]["name"], "datatype": "INT64", "shape": list(ids.shape),
                 "data": ids.reshape(-1).tolist()},
                {"name": meta["inputs"][1]["name"], "datatype": "INT64",
                 "shape": list(ids.shape), "data": kwargs["attention_mask"].reshape(-1).tolist()},
            ]}
            answer = (await client.post("/v2/models/bert/infer", json=body)).json()
    with torch.no_grad():
        expected = model(ids, **kwargs)
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert set(outputs) == {"last_hidden_state", "pooler_output"}
    got = torch.tensor(outputs["pooler_output"]["data"]).reshape(outputs["pooler_output"]["shape"])
    torch.testing.assert_close(got, expected.pooler_output)
