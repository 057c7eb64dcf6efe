"""No module of the checked packages reads another asyncgraph module's private names.

A `_`-prefixed name is its module's own: whoever needs it from elsewhere needs a public name
(issue 53: grpc_server.py and model_control.py imported app.py's `_maybe_offload`, `_Served`
and `_describe`). Read from the source's syntax, every module of `CHECKED`:

- `from asyncgraph.x import _name` (and `from asyncgraph.x._mod import ...`);
- `alias._name`, where `alias` was bound to an asyncgraph module by an import
  (`from asyncgraph.serve import metrics as m` ... `m._private`).

Dunder names (`__version__`) are public. A private name of an object (`server._served`) is
not seen here; review catches those.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncgraph

PACKAGE = Path(asyncgraph.__file__).parent

#: The packages checked (the serving stack and what sits on it).
CHECKED = ("serve", "ray", "cli", "runtime", "cuda")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_asyncgraph_module(dotted: str) -> bool:
    """Whether `dotted` names a module (or package) of asyncgraph, not an attribute."""
    parts = dotted.split(".")
    if parts[0] != "asyncgraph":
        return False
    path = PACKAGE.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """The names an import binds to an asyncgraph module: alias -> the module's dotted name."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("asyncgraph.") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _is_asyncgraph_module(dotted):
                    aliases[alias.asname or alias.name] = dotted
    return aliases


def _private_uses(source: str, where: str) -> Iterator[str]:
    """Each read of another asyncgraph module's private name in `source` (the module at
    `where`, which the findings name)."""
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("asyncgraph"):
                continue
            hidden = [p for p in node.module.split(".") if _private(p)]
            names = [a.name for a in node.names if _private(a.name)]
            for name in hidden + names:
                yield f"{where}:{node.lineno}: from {node.module} import ... {name}"
    aliases = _module_aliases(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute) and _private(node.attr)
            and isinstance(node.value, ast.Name) and node.value.id in aliases
        ):
            yield f"{where}:{node.lineno}: {aliases[node.value.id]}.{node.attr}"


def _modules() -> list[Path]:
    return sorted(p for name in CHECKED for p in (PACKAGE / name).rglob("*.py"))


def test_the_checked_packages_have_modules() -> None:
    """The scan reads something: a moved package would otherwise pass it vacuously."""
    for name in CHECKED:
        assert list((PACKAGE / name).rglob("*.py")), f"asyncgraph/{name}/ has no modules"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reads_another_modules_private_names(path: Path) -> None:
    uses = list(_private_uses(path.read_text(), str(path.relative_to(PACKAGE.parent))))
    assert not uses, (
        "private names of other asyncgraph modules (give them a public name where they "
        "belong):\n" + "\n".join(uses)
    )


def test_the_scan_sees_both_forms() -> None:
    """The scan's own check: an import of a private name and a private attribute of an
    imported module are both found; a dunder and a non-asyncgraph private name are not."""
    source = (
        "from asyncgraph import __version__\n"
        "from torch.utils import _pytree\n"
        "from asyncgraph.serve.app import _describe, create_app\n"
        "from asyncgraph.serve import metrics as m\n"
        "m._hidden\n"
        "m.public\n"
    )
    assert list(_private_uses(source, "probe.py")) == [
        "probe.py:3: from asyncgraph.serve.app import ... _describe",
        "probe.py:5: asyncgraph.serve.metrics._hidden",
    ]
