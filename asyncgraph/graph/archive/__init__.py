"""check_pt2_archive: inspect a .pt2 file before torch.export.load touches it.

torch.export.load trusts its input. It unpickles weights marked `use_pickle` with
`weights_only=False`, falls back to `weights_only=False` for sample inputs, unpickles opaque
and TorchScript objects, loads AOTInductor shared libraries, `sympify`s (evaluates) symbolic
expressions from the graph JSON, compiles the JSON's `guards_code` with `exec` when
`ep.module()` is called, and resolves any `torch.*` attribute path named as a node's target
(`torch.load`, `torch.ops.load_library`), which the executor would then call.

This package reads the archive without running anything from it and refuses, with a message
naming the member and what is wrong:
- a file that is not a zip, is truncated, or has a corrupt member;
- members outside the known layout (compiled code, TorchScript or opaque objects, legacy
  formats), and paths that escape the archive root;
- a pickle (pickled weight, sample inputs) that uses anything but the opcodes and globals that
  torch's weights_only unpickler accepts, or that is not in torch.save's zip format;
- graph JSON that does not parse, has the wrong schema version, names a node target that is
  not an operator, carries a symbolic expression or guard that is not a plain arithmetic
  expression over symbols and inputs' sizes;
- a weight the signature names but the archive lacks, a payload file that is missing or
  smaller than its tensor, and impossible shapes (negative sizes, zero-byte files claiming
  elements);
- a program whose inputs or outputs nest in a pytree type this process has not registered
  (torch would fail with a 30-line warning): the error names the type and the module to import.

One concept per module:
- check.py: the entry point, which runs the checks below in order;
- layout.py: the zip layout: member paths, CRC, required and refused members;
- models.py: one model's JSON, weights and constants configs, payload sizes, sample inputs;
- graph_json.py: the node targets, symbolic expressions and guards of a graph JSON;
- operators.py: which node targets resolve to operators the executor may call;
- pytree_types.py: whether this process knows the container types of the program's inputs and
  outputs (a library's output class is registered when its module is imported);
- expressions.py: the allowlists of symbolic expressions and guards;
- pickle_scan.py: which pickles may be loaded (torch.save zips, weights_only globals);
- compiled_marker.py: how a compiled package is recognized and the hint to trust it;
- member_rules.py: the hook through which a package kind built on the .pt2 layout registers
  the members it adds. A compiled package (asyncgraph/compiled/) holds AOTInductor shared
  libraries, native code that runs when loaded: they are refused unless the caller trusts
  them (`trust_compiled=True`), and then checked by the rules compiled/package_members.py
  registers, which graph/ does not know.
"""

from asyncgraph.graph.archive.check import check_pt2_archive, existing_file
from asyncgraph.graph.archive.compiled_marker import (
    COMPILED_MANIFEST,
    TRUST_HINT,
    is_compiled_package,
)
from asyncgraph.graph.archive.pickle_scan import check_weights_only_pickle

__all__ = [
    "COMPILED_MANIFEST",
    "TRUST_HINT",
    "check_pt2_archive",
    "check_weights_only_pickle",
    "existing_file",
    "is_compiled_package",
]
