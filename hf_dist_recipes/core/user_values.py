"""How checks on user-given values name the setting, so one rule serves a Python argument and a command-line flag.

A rule lives in the module of its concept (`seeding.validate_seed`, `schedules.validate_warmup_steps`, ...) and
takes the setting's `name` as the caller knows it: `seed` for `RecipeTrainingArguments(seed=...)`, `--seed` for
`hf-dist-recipes demo --seed`. Its message then shows a valid value the way that user writes it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def setting(name: str, value: object) -> str:
    """`name` set to `value` as the user writes it: `--seq-len 128` for a flag (a name starting with "--"),
    `seq_len=128` for a Python argument."""
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


def positive_int(value: object, name: str, example: int, *, minimum: int = 1, unit: str = "", note: str = "") -> int:
    """Return `value` when it is an integer >= `minimum` (default 1), else raise ValueError naming `name`, the
    bound, and `example` as a valid value. `unit` (e.g. "optimizer steps") is added to the message, `note` (e.g.
    "0: off") follows the example in brackets."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f"a whole number of {unit}" if unit else "an integer"
        note = f" ({note})" if note else ""
        raise ValueError(f"{name} must be {what} >= {minimum}, got {value!r}; e.g. {setting(name, example)}{note}")
    return value


def writable_dir(path: str | os.PathLike, name: str, example: str) -> Path:
    """The absolute `path` of a directory this process can create or write into, checked without leaving a trace
    (a dry run creates nothing). ValueError naming `name` otherwise: a file in the way, no write permission on the
    nearest existing parent, or a parent that refuses new entries whatever the permissions say (/proc, /sys, a
    read-only mount: root passes os.access there). The one check of every command that writes."""
    target = Path(path).expanduser().resolve()
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name} {path}: {existing} is a file, not a directory; e.g. {setting(name, example)}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: {existing} is not writable by this user; e.g. {setting(name, example)}")
    try:  # what the write will meet: create and remove an entry where the first directory would be made
        os.rmdir(tempfile.mkdtemp(prefix=".hf-dist-recipes-probe-", dir=existing))
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ValueError(
            f"{name} {path}: cannot create anything in {existing} ({reason}); e.g. {setting(name, example)}"
        ) from None
    return target
