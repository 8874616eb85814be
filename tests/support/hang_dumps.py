"""The hang dumps of real 2-rank Gloo jobs, made once per pytest session (one launch: the worker forks every
scenario's ranks at once) and shared by tests/unit/test_hang_report.py and tests/cli/test_logs_hang_cli.py."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.launch import launched_ranks_env, python_for
from tests.support.paths import REPO

WORKER = REPO / "tests" / "distributed" / "workers" / "hang_scenarios_worker.py"
TIMEOUT_S = 420  # the worker ends each rank within 240 s; loaded 2-core machines start torch slowly
_made: dict[str, object] = {}


def hang_dumps() -> Path:
    """The folder holding one `<scenario>/flight_recorder/` per scenario of the worker; a launch that fails raises
    AssertionError with its output."""
    if "dir" not in _made:
        out = Path(tempfile.mkdtemp(prefix="hang_dumps_"))
        atexit.register(shutil.rmtree, out, True)
        # RANK=0 on the launcher: tests.support.launch_count counts it as the one launch it is (forked ranks
        # show their parent's starting environment).
        # The worker forked warm in a session that launches (launched_ranks_env: the rank servers' import-time
        # environment), so its torch is imported already; the scenarios' ranks are its own forks either way.
        env = dict(launched_ranks_env(os.environ), RANK="0", TORCH_FR_BUFFER_SIZE="2000")
        proc = subprocess.run(
            [*python_for(env), str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        _made["dir"], _made["output"] = out, proc.stdout + proc.stderr
        _made["ok"] = proc.returncode == 0
    assert _made["ok"], f"the hang scenarios' launch failed:\n{_made['output']}"
    return _made["dir"]  # type: ignore[return-value]


def marker_line(name: str) -> int:
    """The line of the worker that carries `# HANG-MARK <name>` (found in its source, not in the dumps)."""
    lines = WORKER.read_text().splitlines()
    hits = [i for i, line in enumerate(lines, 1) if re.search(rf"# HANG-MARK {re.escape(name)}$", line)]
    assert len(hits) == 1, f"marker {name!r}: {hits}"
    return hits[0]
