"""One size grammar for every size a user writes: `save_shard_size`, `max_unpartitioned_model_size`,
`checkpoint export --max-shard-size`, `commbench --sizes` / `--link-size`.

- a byte count: "1048576"; `B` for bytes: "16B";
- KB, MB, GB: decimal, 10^3, 10^6, 10^9 bytes, as transformers' `max_shard_size` reads them
  (`transformers.utils.hub.convert_file_size_to_int`: "5GB" is 5 x 10^9);
- KiB, MiB, GiB: binary, 2^10, 2^20, 2^30 bytes; a bare K, M, G is binary too, as nccl-tests' `-b`/`-e` read it
  ("64M" is 64 x 2^20);
- any case, spaces around; a decimal fraction ("1.5GB") is rounded down to whole bytes; the result must be > 0.

Anything else raises ValueError naming the setting the text came from and the accepted forms.

The other way, `format_size` writes a byte count for people, in the same units: "3.8 MiB", "1,234.5 GB", or the
grammar's short form "64M" that nccl-tests and `commbench --sizes` use. `KIB`..`GIB` and `KB`..`GB` are the units
for arithmetic elsewhere."""

from __future__ import annotations

import re
from fractions import Fraction

KB, MB, GB = 10**3, 10**6, 10**9
KIB, MIB, GIB = 2**10, 2**20, 2**30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG](?:i?B)?|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": KB, "MB": MB, "GB": GB, "K": KIB, "KIB": KIB, "M": MIB, "MIB": MIB, "G": GIB, "GIB": GIB}
FORMS = (
    "give a positive size such as 5GB (5 x 10^9 bytes), 5GiB or 5G (5 x 2^30), 500MB, 64KiB or 64K (64 x 1024), "
    "or a byte count such as 1048576"
)


def parse_size(text: str | int, setting: str = "size") -> int:
    """Bytes of `text` (see the module docstring); `setting` names where it came from in the error."""
    m = _SIZE.match(str(text))
    value = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]) if m else 0
    if value <= 0:
        raise ValueError(f"{setting}: {text!r} is not a size in bytes; {FORMS}")
    return value


def parse_sizes(text: str, setting: str = "sizes") -> tuple[int, ...]:
    """The sorted distinct sizes in bytes of a comma-separated list such as "1K,1M,64M"."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{setting} is empty; give comma-separated sizes, e.g. {setting} 1K,1M,64M")
    return tuple(sorted({parse_size(p, setting) for p in parts}))


def format_size(n: float, *, decimal: bool = False, digits: int = 1, short: bool = False) -> str:
    """`n` bytes for a message: in GiB from one GiB up, else in MiB ("1.5 GiB", "3.8 MiB"); `decimal`: GB / MB,
    the units of shard sizes ("1,234.5 GB", "12.3 MB"); `digits` after the point. `short`: the grammar's short
    form, which `parse_size` reads back and nccl-tests labels sizes with: "64M", "1K", "512B" for a whole number of
    binary units, else kibibytes with one decimal ("1.5K")."""
    if short:
        for unit, scale in (("G", GIB), ("M", MIB), ("K", KIB)):
            if n >= scale and n % scale == 0:
                return f"{n // scale}{unit}"
        return f"{n}B" if n < KIB else f"{n / KIB:.1f}K"
    (big, big_scale), (small, small_scale) = (("GB", GB), ("MB", MB)) if decimal else (("GiB", GIB), ("MiB", MIB))
    unit, scale = (big, big_scale) if n >= big_scale else (small, small_scale)
    return f"{n / scale:,.{digits}f} {unit}"
