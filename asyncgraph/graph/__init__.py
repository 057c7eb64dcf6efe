"""The program: what asyncgraph runs, and how it gets one.

- `ir`: Graph, Node, Value, Ref, Signature. Nodes in topological order, values with dense ids,
  validated at construction, so nothing later has to guess whether a graph is well formed.
- `importers`: ExportedProgram, `.pt2`, fx GraphModule -> Program (a Graph and its weights);
  in-place programs are functionalized first.
- `builder`: GraphBuilder, graphs of Python and async callables written by hand.
- `effects`: the order of side effects on one object or state, as ordering edges.
- `initial`: a graph's value slots filled with its inputs, weights and effect token.
- `archive`: the checks a `.pt2` passes before torch.export.load reads it, because that loader
  trusts its input and can run code from it.

Nothing here runs a graph: the runtime does (asyncgraph.runtime).
"""
