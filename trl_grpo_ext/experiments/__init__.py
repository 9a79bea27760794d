"""Multi-run tools: sweeps and their launchers, comparison reports, seed comparisons."""
