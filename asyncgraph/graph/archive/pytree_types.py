"""The pytree types a program's inputs and outputs are made of, and whether this process knows
them.

A program's signature records how its flat inputs and outputs nest (treespecs), naming each
container type by its registered name: `builtins.tuple`, or a library's own output class such
as transformers' `BaseModelOutputWithPooling`. torch.export.load can rebuild only the types
registered in this process's pytree registry, which a library fills when its module is
imported. Unregistered, torch logs a 30-line traceback as a warning and raises "We ran into an
error when deserializing the saved file". This check names the type and the import that
registers it instead.

Nothing is imported here: a hostile archive may name any module, and importing one runs its
code. The user names the modules to import (`--import MODULE` on the command line, or an
`import` before `asyncgraph.load`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any


def check_pytree_types(graph: dict[str, Any], fail: Callable[[str], Exception]) -> None:
    """Raise `fail(message)` for the first container type of the program's input or output
    structure that this process has not registered with torch's pytree."""
    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE

    for where, type_name in _spec_types(graph):
        if type_name not in SERIALIZED_TYPE_TO_PYTHON_TYPE:
            module = type_name.rpartition(".")[0] or type_name
            raise fail(
                f"the program's {where} are a {type_name}, a pytree type this process has not "
                f"registered; import the module that registers it before loading "
                f"(`--import {module}` on the command line, `import {module}` in Python)"
            )


def _spec_types(graph: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(`inputs` or `outputs`, a type name) for each container of each module call's
    signature; specs that do not parse are left to torch, which reports them."""
    calls = graph.get("graph_module", {}).get("module_call_graph", [])
    for call in calls if isinstance(calls, list) else []:
        signature = call.get("signature") if isinstance(call, dict) else None
        if not isinstance(signature, dict):
            continue
        for key, where in (("in_spec", "inputs"), ("out_spec", "outputs")):
            try:
                spec = json.loads(signature.get(key) or "null")
            except (TypeError, ValueError):
                continue
            if isinstance(spec, list) and len(spec) == 2:
                for type_name in _types(spec[1]):
                    yield where, type_name


def _types(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("type"), str):
            yield item["type"]
        children = item.get("children_spec")
        if isinstance(children, list):
            stack.extend(children)
