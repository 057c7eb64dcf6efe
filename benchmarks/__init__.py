"""asyncgraph's benchmark suite: asyncgraph and its peers, side by side, in one process.

Run it with `asyncgraph bench` (all scenarios), `asyncgraph bench --scenario chain --quick`,
`asyncgraph bench --json` or `asyncgraph bench --check` (exit 1 when a target is missed), from
a source checkout. One module per scenario (chain, transformer, wide, concurrent, memory,
steady_state), the harness in harness.py, the peers in peers.py, and nativert_compare.py for a
separate environment with torch 2.9-2.11.
"""
