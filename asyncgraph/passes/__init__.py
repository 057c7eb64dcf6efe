"""Load-time graph passes: the graph that runs is not always the graph that was imported.

- `recompose`: decomposed attention patterns back into one scaled_dot_product_attention.
- `identity`: dropouts that return their input (eval mode, or p=0) leave the graph.
- `linear`: a 2-D CPU linear becomes addmm of its weight's transpose, which folding then
  takes out of the graph (the call at::linear makes, without its per-call overhead).
- `folding`: nodes that read only weights leave the graph; their values are computed once per
  weights version (at construction and on swap_weights) instead of on every call.
- `deadcode`: pure nodes whose values nothing reads leave the graph (segments are planned
  without them: the exporters drop them with the weights only they read).
- `rewrite`: the shared step that rebuilds a valid, densely numbered Graph after a pass.

Each pass takes a Graph and returns a new one; the Executor applies them in order when it is
built, so no pass costs anything per execution.
"""
