"""A repository model's `config.pbtxt` (Triton's model configuration, protobuf text format):
what of it applies to an asyncgraph model, and a refusal, naming the file and the field, of
everything else. Nothing in it is ignored.

    DIR/mlp/config.pbtxt
        max_batch_size: 8
        dynamic_batching { max_queue_delay_microseconds: 500 }
        version_policy: { latest { num_versions: 2 } }
        input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]

The file is parsed with google.protobuf's text_format into model_config.py's `ModelConfig`
(Triton's subset, proto/model_config.proto), so a field of Triton's that is not there (say
`sequence_batching`, `ensemble_scheduling`, `model_warmup`) is refused by the parser, by name.
Of the fields that parse:

- `version_policy` is the model's policy (repository.py), as config.json's is;
- `max_batch_size` > 0 turns on dynamic batching (runtime/batching.py) with that many rows,
  its queue delay `dynamic_batching.max_queue_delay_microseconds`; the program's dim 0 must
  be dynamic, and `input` / `output` dims then leave it out, as Triton's do;
- `instance_group`: one group, its `count` the executions that may run at once
  (`max_concurrent_executions`); its kind the device the program is on (or KIND_AUTO);
- `input` / `output` entries rename the served tensors: an entry maps onto the program's
  tensor of the same name, else onto position N for a name ending in `__N` (Triton's PyTorch
  backend convention), else onto its own position in the list; its `data_type` and `dims`
  must be the program's (a config cannot narrow or widen what the program accepts).

Refused with their reason: `name` other than the folder's, a `platform`, `backend` or
`runtime` other than asyncgraph's, a `default_model_filename` other than model.pt2,
`dynamic_batching` without `max_batch_size`, `preferred_batch_size` (the batcher sends what
has queued, up to max_batch_size; it does not wait for preferred sizes), priority levels,
more than one instance group, KIND_MODEL or `gpus`, an input `format` or `optional`, an
output `label_filename`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from asyncgraph.serve.interface import ModelInterface, TensorInfo
from asyncgraph.serve.model_config import BACKEND, PLATFORM, ModelConfig, triton_type

#: A model folder's Triton configuration.
PBTXT_FILE = "config.pbtxt"

_POSITION = re.compile(r".*__([0-9]+)")
_NO_FIELD = re.compile(r'has no field named "(\w+)"')


class ConfigError(ValueError):
    """A config.pbtxt that cannot apply: the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One `input` or `output` entry: its name, Triton datatype (TYPE_*; None: not given)
    and dims, and where it is in the file (`input[0]`)."""

    name: str
    data_type: str | None
    dims: tuple[int, ...]
    where: str


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What a config.pbtxt sets for its model (None, 0, (): not set)."""

    path: Path
    version_policy: str | None = None  # repository.VersionPolicy's text form
    max_batch_size: int = 0
    max_delay_s: float = 0.0
    instances: int | None = None
    gpu: bool | None = None  # the instance group's kind: GPU (True), CPU (False), AUTO (None)
    inputs: tuple[TensorEntry, ...] = ()
    outputs: tuple[TensorEntry, ...] = ()

    def executor_options(self) -> dict[str, Any]:
        """The ExecutorConfig fields it sets: `batching` and `max_concurrent_executions`."""
        from asyncgraph.runtime.config import BatchingConfig

        options: dict[str, Any] = {}
        if self.max_batch_size:
            options["batching"] = BatchingConfig(self.max_batch_size, self.max_delay_s)
        if self.instances is not None:
            options["max_concurrent_executions"] = self.instances
        return options


def read_settings(path: Path, model: str) -> ModelSettings:
    """Model `model`'s config.pbtxt at `path`, checked; a ConfigError names what cannot
    apply."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc})") from None
    message = ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError(_parse_failure(path, exc)) from None
    return _settings(path, model, message)


def _parse_failure(path: Path, exc: text_format.ParseError) -> str:
    missing = _NO_FIELD.search(str(exc))
    where = f"{path}:{exc.GetLine()}" if exc.GetLine() else str(path)
    if missing:
        return (f"{where}: field {missing.group(1)!r} cannot apply to an asyncgraph model "
                f"(not supported; remove it)")
    return f"{where}: not a valid model configuration ({exc})"


def _settings(path: Path, model: str, config: Any) -> ModelSettings:
    def refuse(field: str, why: str) -> ConfigError:
        return ConfigError(f"{path}: field {field!r} cannot apply: {why}")

    if config.name and config.name != model:
        raise refuse("name", f"{config.name!r} is not the model's folder name {model!r}")
    if config.platform not in ("", PLATFORM):
        raise refuse("platform", f"{config.platform!r}; asyncgraph serves torch.export "
                                 f"programs (platform {PLATFORM!r})")
    if config.backend not in ("", BACKEND):
        raise refuse("backend", f"{config.backend!r}; asyncgraph is the backend "
                                f"(backend {BACKEND!r})")
    if config.runtime:
        raise refuse("runtime", f"{config.runtime!r}; asyncgraph runs the program itself")
    if config.default_model_filename not in ("", "model.pt2"):
        raise refuse("default_model_filename", f"{config.default_model_filename!r}; a version "
                                               f"is <version>/model.pt2 or <version>.pt2")
    if config.max_batch_size < 0:
        raise refuse("max_batch_size", f"{config.max_batch_size} is negative")
    delay_s = 0.0
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        if config.max_batch_size == 0:
            raise refuse("dynamic_batching", "it needs max_batch_size > 0")
        if batching.preferred_batch_size:
            raise refuse("dynamic_batching.preferred_batch_size",
                          "asyncgraph's batcher runs what has queued, up to max_batch_size; "
                          "it does not wait for preferred sizes")
        for field in ("priority_levels", "default_priority_level"):
            if getattr(batching, field):
                raise refuse(f"dynamic_batching.{field}", "requests have no priorities")
        delay_s = batching.max_queue_delay_microseconds / 1e6
    instances, gpu = _instances(config, refuse)
    return ModelSettings(
        path, _policy(config), config.max_batch_size, delay_s, instances, gpu,
        tuple(_entries(config.input, "input", refuse)),
        tuple(_entries(config.output, "output", refuse)),
    )


def _policy(config: Any) -> str | None:
    if not config.HasField("version_policy"):
        return None
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "latest":
        return f"latest:{policy.latest.num_versions}"
    if choice == "specific":
        return "specific:" + ",".join(str(v) for v in policy.specific.versions)
    return "all"


def _instances(config: Any, refuse: Any) -> tuple[int | None, bool | None]:
    groups = list(config.instance_group)
    if not groups:
        return None, None
    if len(groups) > 1:
        raise refuse("instance_group", f"{len(groups)} groups; an asyncgraph model runs as one "
                                       f"group of executions")
    group = groups[0]
    kind = type(group).Kind.Name(group.kind)
    if kind == "KIND_MODEL":
        raise refuse("instance_group[0].kind", "KIND_MODEL; the program's devices are its own")
    if group.gpus:
        raise refuse("instance_group[0].gpus", "the program runs on the devices it was "
                                               "exported for")
    if group.count < 0:
        raise refuse("instance_group[0].count", f"{group.count} is negative")
    gpu = {"KIND_GPU": True, "KIND_CPU": False}.get(kind)
    return (group.count or None), gpu


def _entries(entries: Any, kind: str, refuse: Any) -> list[TensorEntry]:
    out: list[TensorEntry] = []
    for index, entry in enumerate(entries):
        where = f"{kind}[{index}]"
        if kind == "input" and entry.format:
            raise refuse(f"{where}.format", "inputs are tensors of the program's layout")
        if kind == "input" and entry.optional:
            raise refuse(f"{where}.optional", "every input of the program is required")
        if kind == "output" and entry.label_filename:
            raise refuse(f"{where}.label_filename", "classification is not supported")
        data_type = None
        if entry.data_type:
            data_type = type(entry).DESCRIPTOR.fields_by_name["data_type"].enum_type \
                .values_by_number[entry.data_type].name
        out.append(TensorEntry(entry.name, data_type, tuple(entry.dims), where))
    return out


# -- applying it to a served program ---------------------------------------------------------


def apply_settings(interface: ModelInterface, settings: ModelSettings) -> ModelInterface:
    """`interface` with the config's names, checked against it: a renamed copy (the same
    interface when the config names nothing), or a ConfigError naming the file and field."""
    path = settings.path
    batched = settings.max_batch_size > 0
    if batched:
        for info in interface.inputs:
            if not info.shape or info.shape[0] != -1:
                raise ConfigError(
                    f"{path}: field 'max_batch_size' cannot apply: input {info.name!r} of "
                    f"the program is {info.datatype} {info.shape}, without a dynamic batch "
                    f"dimension 0 (export it with one)")
    if settings.gpu is not None:
        on_gpu = any(i.device.type == "cuda" for i in interface.inputs)
        if on_gpu != settings.gpu:
            raise ConfigError(
                f"{path}: field 'instance_group[0].kind' cannot apply: the program runs on "
                f"the {'GPU' if on_gpu else 'CPU'}")
    if not settings.inputs and not settings.outputs:
        return interface
    inputs = _renamed(interface.inputs, settings.inputs, batched, path)
    outputs = _renamed(interface.outputs, settings.outputs, batched, path)
    renamed = copy.copy(interface)
    renamed.inputs = inputs
    renamed.inputs_by_name = {i.name: i for i in inputs}
    renamed.outputs = outputs
    renamed.outputs_by_name = {o.name: o for o in outputs}
    return renamed


def _renamed(
    served: list[TensorInfo], entries: tuple[TensorEntry, ...], batched: bool, path: Path
) -> list[TensorInfo]:
    if len(entries) > len(served):
        kind = entries[0].where.partition("[")[0]
        raise ConfigError(
            f"{path}: field {kind!r} cannot apply: {len(entries)} entries, the program has "
            f"{len(served)} ({', '.join(s.name for s in served)})")
    by_name = {s.name: index for index, s in enumerate(served)}
    names = [s.name for s in served]
    mapped: dict[int, str] = {}
    for position, entry in enumerate(entries):
        index = _target(entry, position, by_name)
        if index >= len(served):
            raise ConfigError(f"{path}: field '{entry.where}.name' cannot apply: "
                              f"{entry.name!r} names position {index}, the program has "
                              f"{len(served)}")
        if index in mapped:
            raise ConfigError(f"{path}: field '{entry.where}.name' cannot apply: "
                              f"{entry.name!r} maps onto {served[index].name!r}, which "
                              f"{mapped[index]!r} maps onto already")
        _check(served[index], entry, batched, path)
        mapped[index] = entry.name
        names[index] = entry.name
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: the names given leave two tensors named alike: "
                          f"{', '.join(names)}")
    return [dataclasses.replace(s, name=n) for s, n in zip(served, names, strict=True)]


def _target(entry: TensorEntry, position: int, by_name: dict[str, int]) -> int:
    if entry.name in by_name:
        return by_name[entry.name]
    numbered = _POSITION.fullmatch(entry.name)
    return int(numbered.group(1)) if numbered else position


def _check(info: TensorInfo, entry: TensorEntry, batched: bool, path: Path) -> None:
    expected = triton_type(info.datatype)
    if entry.data_type is not None and entry.data_type != expected:
        raise ConfigError(f"{path}: field '{entry.where}.data_type' cannot apply: "
                          f"{entry.data_type}, the program's {info.name!r} is {expected}")
    dims = info.shape[1:] if batched else info.shape
    if list(entry.dims) != dims:
        batch = " (without the batch dimension: max_batch_size > 0)" if batched else ""
        raise ConfigError(f"{path}: field '{entry.where}.dims' cannot apply: "
                          f"{list(entry.dims)}, the program's {info.name!r} has dims "
                          f"{dims}{batch}; -1 where a dimension varies")
