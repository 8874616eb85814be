"""Reading a JSON object from a user's file with errors that name the file, the problem and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_text_file(path: str | os.PathLike, what: str, hint: str) -> str:
    """The UTF-8 text of the user's file `path`, or ValueError "<what> <path> ..." in one line: missing (followed by
    `hint`), a directory, unreadable, or not UTF-8 text."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {p} is a directory, not a file; {hint}")
    if not p.is_file():
        raise ValueError(f"{what} {p} does not exist; {hint}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {p} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"{what} {p} cannot be read: {err.strerror}") from None


def read_json_object(path: str | os.PathLike, what: str, hint: str) -> dict:
    """The JSON object in `path`, or ValueError "<what> <path> ..." (missing: followed by `hint`; a directory,
    unreadable or not UTF-8 (see `read_text_file`); empty; bad JSON with its line; not an object)."""
    p = Path(path)
    text = read_text_file(p, what, hint)
    if not text.strip():
        raise ValueError(f"{what} {p} is empty; it must hold a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {p} is not valid JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {p} must hold a JSON object, not {type(data).__name__}")
    return data


def load_deepspeed_json(path: str | os.PathLike) -> dict:
    """Read a DeepSpeed JSON file, or raise ValueError naming the file and the problem."""
    return read_json_object(path, "DeepSpeed config", "check deepspeed_config_file / --deepspeed")


def read_deepspeed_argument(value: str) -> dict:
    """`TrainingArguments(deepspeed=value)` read as the stock post-init reads it (accelerate's `HfDeepSpeedConfig`: a
    file, else a JSON or base64 string) and with its errors, the file named or the fix added: a file's bad JSON is
    the same JSONDecodeError, anything else accelerate's ValueError."""
    from accelerate.utils import HfDeepSpeedConfig

    try:
        return HfDeepSpeedConfig(value).config
    except json.JSONDecodeError as err:
        raise json.JSONDecodeError(f"DeepSpeed config {value} is not valid JSON: {err.msg}", err.doc, err.pos) from None
    except ValueError as err:
        raise ValueError(f"{err} (no such file; check deepspeed_config_file / --deepspeed)") from None
