"""CRC-32C (Castagnoli), as TFRecord files use it, masked the TensorFlow way; one message or many at once.

No C implementation is installed with our dependencies (tensorboard's is pure Python, and importing it costs ~0.3 s
of tensorflow-stub start-up), and a byte-at-a-time loop in Python runs at ~5 MB/s. So:
- `crc32c(data)`: the table loop in Python, for the few short inputs (8-byte record lengths);
- `crc32c_rows(rows)`: many messages of equal length at once, one numpy step per byte column (slicing-by-4: four
  table lookups per 4 bytes), ~100-200 MB/s for a few thousand rows: what the event writer needs, where every record
  of one layout has the same length.
A TFRecord stores `masked(crc32c(x))`: rotated right by 15 bits plus a constant, so that a CRC of data holding CRCs
stays well mixed.
"""

from __future__ import annotations

import numpy as np

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
    """CRC-32C of `data` (continuing from `crc`, 0 to start). Pure Python: for short inputs only."""
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
    """CRC-32C of each row of a 2-D uint8 array (N messages of L bytes each): N uint32."""
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
