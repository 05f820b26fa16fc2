"""Side-by-side measurements; each module is runnable with `python -m benchmarks.<name>`."""
