"""Reading a JSON object from a user's file with errors that name the file, the problem and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_json_object(path: str | os.PathLike, what: str, hint: str) -> dict:
    """The JSON object in `path`, or ValueError "<what> <path> ..." (missing: followed by `hint`; bad JSON with its
    line; not an object)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {p} does not exist; {hint}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {p} is not valid JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {p} must hold a JSON object, not {type(data).__name__}")
    return data


def load_deepspeed_json(path: str | os.PathLike) -> dict:
    """Read a DeepSpeed JSON file, or raise ValueError naming the file and the problem."""
    return read_json_object(path, "DeepSpeed config", "check deepspeed_config_file / --deepspeed")
