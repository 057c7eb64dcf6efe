"""The `asyncgraph` console script (typer + rich): `main` builds the app from one module per
command (run and trace, serve, stress, bench, demo; check and profile live in tools)."""
