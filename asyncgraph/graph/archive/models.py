"""One model of a .pt2: its graph JSON, weights and constants, and sample inputs.

torch.export.load reads, for each model, models/<name>.json, a weights and a constants config
mapping each tensor to a payload member, the payloads (raw bytes, or torch.save pickles) and
the sample inputs (a torch.save pickle). A config may name a missing, short or pickled-object
payload, and the signature may name a weight the archive lacks: each would fail deep inside
torch, or run code, so they are checked here against the members layout.py found.
"""

from __future__ import annotations

import math
import re
from typing import Any

from asyncgraph.graph.archive.graph_json import check_graph_json
from asyncgraph.graph.archive.layout import Pt2Archive
from asyncgraph.graph.archive.pickle_scan import check_torch_save
from asyncgraph.graph.archive.pytree_types import check_pytree_types

_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")


def check_model(archive: Pt2Archive, model: str) -> set[str]:
    """Check one model's JSON, configs, payloads and sample inputs; return the members used."""
    used: set[str] = set()
    where = f"models/{model}.json"
    graph = archive.read_json(where)
    if not isinstance(graph, dict) or not isinstance(graph.get("graph_module"), dict):
        raise archive.fail(f"{where}: not a serialized ExportedProgram")
    _schema_version(archive, model, graph.get("schema_version"))
    weights_cfg = f"data/weights/{model}_weights_config.json"
    constants_cfg = f"data/constants/{model}_constants_config.json"
    weights = _payload_config(archive, weights_cfg, "data/weights/", used)
    constants = _payload_config(archive, constants_cfg, "data/constants/", used)
    used |= {weights_cfg, constants_cfg}
    check_graph_json(graph, lambda message: archive.fail(f"{where}: {message}"))
    check_pytree_types(graph, lambda message: archive.fail(f"{where}: {message}"))
    _signature_weights(archive, model, graph, weights, constants)
    sample = f"data/sample_inputs/{model}.pt"
    if sample not in archive.members:
        raise archive.fail(f"missing member {sample!r} (the program's sample inputs)")
    if archive.members[sample].file_size:
        check_torch_save(archive.read(sample), f"{archive.path}: {sample}")
    return used


def _schema_version(archive: Pt2Archive, model: str, version: Any) -> None:
    from torch._export.serde.schema import SCHEMA_VERSION

    major = version.get("major") if isinstance(version, dict) else None
    if not isinstance(major, int) or (major != SCHEMA_VERSION[0] and major != 0):
        raise archive.fail(
            f"models/{model}.json: schema version {version!r} is not supported "
            f"(this torch reads major version {SCHEMA_VERSION[0]})"
        )


def _payload_config(
    archive: Pt2Archive, rel: str, directory: str, used: set[str]
) -> dict[str, Any]:
    """The entries of a weights or constants config, each payload checked; `used` gains them."""
    cfg = archive.read_json(rel)
    entries = cfg.get("config") if isinstance(cfg, dict) else None
    if not isinstance(entries, dict):
        raise archive.fail(f"{rel}: expected an object with a 'config' mapping")
    for fqn, meta in entries.items():
        where = f"{rel}: {fqn!r}"
        if not isinstance(meta, dict):
            raise archive.fail(f"{where}: expected an object")
        file = meta.get("path_name")
        if not isinstance(file, str) or not _FILE_NAME.match(file) or file in (".", ".."):
            raise archive.fail(f"{where}: invalid path_name {file!r}")
        member = directory + file
        if member not in archive.members:
            raise archive.fail(f"{where}: its payload {member!r} is missing from the archive")
        used.add(member)
        if file.startswith("custom_obj_") or file.startswith("opaque_obj_"):
            raise archive.fail(
                f"{where}: a pickled Python/TorchScript object ({member}), which can run "
                "code when loaded; asyncgraph loads tensors only"
            )
        if directory == "data/constants/" and not file.startswith("tensor_"):
            raise archive.fail(f"{where}: unknown constant payload {member!r}")
        if meta.get("use_pickle") is True:
            check_torch_save(archive.read(member), f"{archive.path}: {member}")
        elif meta.get("use_pickle") is False:
            _raw_tensor(archive, where, member, meta.get("tensor_meta"))
        else:
            raise archive.fail(f"{where}: use_pickle must be true or false")
    return entries


def _raw_tensor(archive: Pt2Archive, where: str, member: str, meta: Any) -> None:
    """A raw payload holds every byte its dtype, sizes, strides and offset reach."""
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    if not isinstance(meta, dict):
        raise archive.fail(f"{where}: missing tensor_meta")
    code = meta.get("dtype")
    dtype = _SERIALIZE_TO_TORCH_DTYPE.get(code) if type(code) is int else None
    if dtype is None:
        raise archive.fail(f"{where}: unknown dtype code {meta.get('dtype')!r}")
    sizes = _ints(meta.get("sizes"))
    strides = _ints(meta.get("strides"))
    offset = _ints([meta.get("storage_offset")])
    if sizes is None or strides is None or offset is None or len(sizes) != len(strides):
        raise archive.fail(f"{where}: malformed sizes, strides or storage_offset")
    if any(s < 0 for s in sizes) or any(s < 0 for s in strides) or offset[0] < 0:
        raise archive.fail(f"{where}: negative size, stride or storage offset {sizes}")
    numel = math.prod(sizes)
    needed = 0 if numel == 0 else offset[0] + 1 + sum(
        (n - 1) * s for n, s in zip(sizes, strides, strict=True)
    )
    nbytes = archive.members[member].file_size
    element = dtype.itemsize
    if nbytes % element:
        raise archive.fail(f"{where}: {member} has {nbytes} bytes, not a multiple of {element}")
    if nbytes == 0 and numel != 0:
        raise archive.fail(
            f"{where}: {member} is empty but its shape {sizes} has {numel} elements"
        )
    if needed * element > nbytes:
        raise archive.fail(
            f"{where}: {member} has {nbytes} bytes, but shape {sizes} with strides "
            f"{strides} needs {needed * element}"
        )


def _ints(items: Any) -> list[int] | None:
    """[{"as_int": 3}, ...] -> [3, ...]; None when malformed or symbolic."""
    if not isinstance(items, list):
        return None
    out = []
    for item in items:
        value = item.get("as_int") if isinstance(item, dict) else None
        if type(value) is not int:
            return None
        out.append(value)
    return out


def _signature_weights(
    archive: Pt2Archive, model: str, graph: dict[str, Any], weights: dict[str, Any],
    constants: dict[str, Any],
) -> None:
    """Every parameter, buffer and tensor constant the signature names has a payload."""
    signature = graph["graph_module"].get("signature")
    specs = signature.get("input_specs") if isinstance(signature, dict) else None
    if not isinstance(specs, list):
        raise archive.fail(f"models/{model}.json: the signature has no input_specs list")
    for spec in specs:
        if not isinstance(spec, dict) or len(spec) != 1:
            raise archive.fail(f"models/{model}.json: malformed input spec {spec!r:.100}")
        kind, body = next(iter(spec.items()))
        body = body if isinstance(body, dict) else {}
        if kind in ("parameter", "buffer"):
            name = body.get(f"{kind}_name")
            if name not in weights and name not in constants:
                raise archive.fail(
                    f"the signature names {kind} {name!r}, which is missing from "
                    f"the archive's weights"
                )
        elif kind == "tensor_constant":
            name = body.get("tensor_constant_name")
            if name not in constants:
                raise archive.fail(
                    f"the signature names tensor constant {name!r}, which is missing "
                    "from the archive's constants"
                )
        elif kind == "custom_obj":
            raise archive.fail("the program takes a custom (TorchScript) object input")
