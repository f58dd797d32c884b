"""The project's benchmarks and measurement scripts (each runs as `python3 bench/NAME.py`); a package so
that the serving benchmark's modules (bench/stack/) import each other and bench/serve_measure.py by name.

How a script finds its neighbours: run as `python3 bench/NAME.py`, Python puts bench/ first on sys.path,
so `import common` finds bench/common.py; a script the tests also import as `bench.NAME` picks the
relative import there (`if __package__: from . import common`). Only two kinds of sys.path lines remain:
the project root put first where a script run as a file imports the package `bench` (bench/stack.py,
bench/pair.py, bench/gpu/serve_config_check.py: bench/ itself holds a bench.py that would shadow it), and
this checkout's src/ put first where a script imports vllm_overlay (it runs this tree's code, whichever
copy is installed, or on a GPU host where none is)."""
