"""Helpers the tests import (`from tests.support.launch import accelerate_launch`), one module per concept:
`paths` (the repository), `launch` (real multi-process runs), `hosts` (what this machine has, and the skips that
follow), `models` (the tiny model the one-process and worker runs train). Fixtures and pytest hooks stay in
tests/conftest.py. Spelled `tests.support` so that workers launched as subprocesses (PYTHONPATH = the repository)
import them the same way as pytest (`pythonpath = ["."]` in pyproject.toml). Importing this package imports nothing
heavy: workers import `tests.support.models` without torch or pytest."""
