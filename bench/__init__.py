"""The project's benchmarks and measurement scripts (each runs as `python3 bench/NAME.py`); a package so
that the serving benchmark's modules (bench/stack/) import each other and bench/serve_measure.py by name."""
