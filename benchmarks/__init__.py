"""Engine benchmarks: `python -m benchmarks.<name>` (docs/benchmarks.md). They may import
loadtest/ (a client) and the runtime; neither imports them."""
