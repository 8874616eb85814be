"""CRC-32C (Castagnoli), as TFRecord files use it, masked the TensorFlow way; one message or many at once.

A maintained C implementation is used when installed: google-crc32c (the `report` extra, what a machine reading logs
installs; `BACKEND` says which is in use). Without it, the hand-written code below is the fallback; tensorboard's own
CRC is pure Python (and importing it costs ~0.3 s of tensorflow-stub start-up):
- `crc32c(data)`: google-crc32c, else a table loop in Python (~5 MB/s: for short inputs, the 8-byte record lengths);
- `crc32c_rows(rows)`: many messages of equal length at once. numpy, one step per column of 4 bytes (slicing-by-4:
  four table lookups per 4 bytes, ~100-200 MB/s for a few thousand rows), for rows shorter than `C_ROWS_FROM` bytes,
  even with the C library: a call per row costs ~0.3 us of Python, more than numpy's share of a short row (measured in
  benchmarks/results/2026-12-06-event-reader-cpu.md: 100,000 rows of 8 B, numpy 5 ms, C 34 ms; of 200 B, numpy 13
  ms, C 7 ms). Scalar records (the framing's 8-byte lengths, the writer's ~40-byte events) are all short.
A TFRecord stores `masked(crc32c(x))`: rotated right by 15 bits plus a constant, so that a CRC of data holding CRCs
stays well mixed.
"""

from __future__ import annotations

import numpy as np

try:
    import google_crc32c as _google_crc32c

    _C_EXTEND = _google_crc32c.extend if _google_crc32c.implementation == "c" else None
except ImportError:  # the fallback below
    _C_EXTEND = None

BACKEND = "google-crc32c" if _C_EXTEND is not None else "numpy"
C_ROWS_FROM = 128  # bytes a row from which crc32c_rows calls the C library row by row (see the module docstring)

_POLY = 0x82F63B78  # Castagnoli, reflected
_MASK_DELTA = 0xA282EAD8


def _tables() -> np.ndarray:
    """4 x 256 tables: T[0] the byte table; T[k][b] = the CRC of byte b followed by k zero bytes (slicing-by-4)."""
    t = np.zeros((4, 256), np.uint32)
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t[0, b] = c
    for k in range(1, 4):
        t[k] = t[0][t[k - 1] & 0xFF] ^ (t[k - 1] >> 8)
    return t


_T = _tables()
_T0 = _T[0].tolist()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data` (continuing from `crc`, 0 to start): google-crc32c when installed, else `crc32c_python`."""
    if _C_EXTEND is not None:
        return _C_EXTEND(crc, data)
    return crc32c_python(data, crc)


def crc32c_python(data: bytes, crc: int = 0) -> int:
    """CRC-32C of `data` (continuing from `crc`), a table loop in Python: the fallback, for short inputs only."""
    crc ^= 0xFFFFFFFF
    table = _T0
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(crc: int | np.ndarray):
    """TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8, mod 2**32 (ints or uint32 arrays)."""
    if isinstance(crc, np.ndarray):
        crc = crc.astype(np.uint32)
        return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """What a TFRecord stores after its length and after its data."""
    return masked(crc32c(data))


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC-32C of each row of a 2-D uint8 array (N messages of L bytes each): N uint32. Rows of `C_ROWS_FROM` bytes or
    more through google-crc32c when installed, shorter ones (and all without it) through `crc32c_rows_numpy`."""
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"crc32c_rows takes an (N, L) uint8 array, got {rows.dtype} of shape {rows.shape}")
    n, length = rows.shape
    if _C_EXTEND is not None and length >= C_ROWS_FROM:
        data, c = np.ascontiguousarray(rows).tobytes(), _C_EXTEND
        return np.fromiter((c(0, data[i : i + length]) for i in range(0, n * length, length)), np.uint32, n)
    return crc32c_rows_numpy(rows)


def crc32c_rows_numpy(rows: np.ndarray) -> np.ndarray:
    """`crc32c_rows` in numpy (the fallback, and the faster for short rows)."""
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"crc32c_rows takes an (N, L) uint8 array, got {rows.dtype} of shape {rows.shape}")
    n, length = rows.shape
    crc = np.full(n, 0xFFFFFFFF, np.uint32)
    whole = length - length % 4
    t0, t1, t2, t3 = _T
    if whole:
        # Little-endian 32-bit words, one column of words per step; columns contiguous for the lookups.
        words = np.ascontiguousarray(rows[:, :whole]).view("<u4").T.copy()
        ff, s8, s16, s24 = np.uint32(0xFF), np.uint32(8), np.uint32(16), np.uint32(24)
        for w in words:
            x = crc ^ w
            crc = t3[x & ff] ^ t2[(x >> s8) & ff] ^ t1[(x >> s16) & ff] ^ t0[x >> s24]
    for col in np.ascontiguousarray(rows[:, whole:].T):
        crc = t0[(crc ^ col) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)
