"""Hang-proof NCCL environment defaults, applied only where the user (or the launcher) has not set them.

PyTorch reads these variables once, when ProcessGroupNCCL is created, so they must be in the environment before the
process group exists: `RecipeTrainingArguments.__post_init__` applies them before `TrainingArguments.__post_init__`
(on GPU hosts accelerate's `PartialState` creates the group there). The Dockerfile written by `pin` bakes
`NCCL_ENV_DEFAULTS` into the image. Names and defaults read from torch 2.13's
`include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`, `FlightRecorder.hpp` and `Utils.hpp` (`getCvar*`
reads a list of names, the first the current one; a later, older name is still read, with a deprecation warning).
Only current names are set: an older one set beside it made every rank print torch's "Environment variable
TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE instead" (`make demo`, issue 30). The older
names still count as the user's choice (`ALIASES`).

- `TORCH_NCCL_ASYNC_ERROR_HANDLING=3` (old name `NCCL_ASYNC_ERROR_HANDLING`): a collective that fails or times out
  tears the process down instead of leaving it blocked. 3 ("SkipCleanUp": tear down without `ncclCommAbort`) is
  torch 2.13's own default; 1 also calls `ncclCommAbort` first, which the torch header names as a call that can
  itself hang ("a last resort in case ncclCommAbort itself is hanging"). Setting the default explicitly changes
  nothing on the pinned torch; it makes the value visible in the report and the same on a stack whose default
  differs. Note that torchrun (and so `accelerate launch`) already exports 1 to its workers when unset; that
  value then counts as the user's and is kept.
- The flight recorder: `TORCH_FR_BUFFER_SIZE` (older name `TORCH_NCCL_TRACE_BUFFER_SIZE`; ring of the last
  collectives, 2000 entries, torch 2.13's default; 0 turns it off), `TORCH_NCCL_DUMP_ON_TIMEOUT=1` with
  `TORCH_NCCL_ENABLE_MONITORING=1` (the header: the dump needs both), and the dump file prefix
  `TORCH_FR_DUMP_TEMP_FILE` (older name `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`; torch appends the rank; default
  `/tmp/nccl_trace_rank_`, lost with the node) pointed into the run directory,
  `<run_dir>/flight_recorder/`, where every rank also writes its own dump and stacks when a job hangs
  (`comm.flight_recorder`); `hf-dist-recipes logs hang <run_dir>` reads them. ProcessGroupNCCL keeps its own
  copy of the size, read from `TORCH_NCCL_TRACE_BUFFER_SIZE` alone (its list in ProcessGroupNCCL.hpp; no warning)
  with the recorder's default 2000 ("duplicated in ProcessGroupNCCL.cpp", FlightRecorder.hpp), so leaving that
  name unset keeps both at the 2000 set here.

Every other backend (Gloo) gets the recorder's buffer size only (`FLIGHT_RECORDER_ENV_DEFAULTS`): torch 2.13
records Gloo's collectives too, in a recorder of its own that reads the same two names once, when first used
(default 2000, the value set here; explicit so that it shows in the run's summary and holds on a torch whose default
differs). Its cost, measured on 2 CPU ranks: benchmarks/results/2026-12-04-flight-recorder-cpu.md. Nothing dumps it
on its own: `comm.flight_recorder` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from hf_dist_recipes.comm.flight_recorder import FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_PREFIX

logger = logging.getLogger(__name__)


FLIGHT_RECORDER_BUFFER_SIZE = "2000"  # entries (torch 2.13's default); its cost: the module docstring
# The recorder's defaults for any backend, under the current name only (the older one warns on every rank).
FLIGHT_RECORDER_ENV_DEFAULTS: dict[str, str] = {"TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_BUFFER_SIZE}

# The defaults that do not depend on the run; the image written by `pin` sets these.
NCCL_ENV_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    **FLIGHT_RECORDER_ENV_DEFAULTS,
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}

# Each default (its current name) with every name torch reads for the same setting, current first: one of them
# set means the user chose.
ALIASES: dict[str, tuple[str, ...]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("TORCH_NCCL_DUMP_ON_TIMEOUT",),
    "TORCH_NCCL_ENABLE_MONITORING": ("TORCH_NCCL_ENABLE_MONITORING",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
}


def flight_recorder_prefix(run_dir: str) -> str:
    """The dump file prefix inside `run_dir`; torch appends the global rank (`.../rank_0`, `.../rank_1`)."""
    return os.path.join(os.path.abspath(run_dir), FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_PREFIX)


def nccl_env_defaults(run_dir: str) -> dict[str, str]:
    """`NCCL_ENV_DEFAULTS` plus the flight recorder's dump prefix under `run_dir`."""
    return {**NCCL_ENV_DEFAULTS, "TORCH_FR_DUMP_TEMP_FILE": flight_recorder_prefix(run_dir)}


def apply_nccl_env_defaults(run_dir: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each default of `nccl_env_defaults(run_dir)` whose setting no name in `environ` (default `os.environ`)
    already carries; return what was set (empty when the user set everything). A setting torch reads under two
    names is set under the current one, and only when neither is set. Creates the dump directory when its prefix is
    applied. Logs the applied values once, on global rank 0 (`RANK`)."""
    applied = _apply(nccl_env_defaults(run_dir), os.environ if environ is None else environ, "NCCL")
    if "TORCH_FR_DUMP_TEMP_FILE" in applied:
        os.makedirs(os.path.dirname(applied["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    return applied


def apply_flight_recorder_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """For a backend other than NCCL (Gloo): set the recorder's buffer size (`FLIGHT_RECORDER_ENV_DEFAULTS`) unless
    the user set it under either name; return what was set. The dumps need no variable (`comm.flight_recorder`)."""
    return _apply(FLIGHT_RECORDER_ENV_DEFAULTS, os.environ if environ is None else environ, "flight recorder")


def _apply(defaults: dict[str, str], env: MutableMapping[str, str], what: str) -> dict[str, str]:
    applied = {name: value for name, value in defaults.items() if not any(alias in env for alias in ALIASES[name])}
    env.update(applied)
    if applied and env.get("RANK", "0") == "0":
        logger.info(
            "%s defaults applied (unset before): %s",
            what,
            ", ".join(f"{name}={value}" for name, value in applied.items()),
        )
    return applied
