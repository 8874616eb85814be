"""CRC-32C: the C library (google-crc32c, when installed) and the hand-written fallback (a Python table loop, numpy
rows) give the same values, on RFC 3720's check values (independent numbers) and on random rows either side of the
length where `crc32c_rows` switches to the C library."""

from __future__ import annotations

import numpy as np
import pytest

from hf_dist_recipes.core import crc32c as mod

# RFC 3720 (iSCSI), B.4: CRC-32C examples; "123456789": the CRC catalogue's check value.
KNOWN = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize(("data", "expected"), KNOWN)
def test_the_fallback_gives_the_known_values(data, expected):
    assert mod.crc32c_python(data) == expected
    assert mod.crc32c_python(data[5:], mod.crc32c_python(data[:5])) == expected  # continued
    assert mod.crc32c_rows_numpy(np.frombuffer(data, np.uint8).reshape(1, -1)).tolist() == [expected]


@pytest.mark.parametrize(("data", "expected"), KNOWN)
def test_the_c_library_gives_the_known_values(data, expected):
    google_crc32c = pytest.importorskip("google_crc32c")
    assert google_crc32c.implementation == "c"
    assert mod.BACKEND == "google-crc32c"
    assert mod.crc32c(data) == expected
    assert mod.crc32c(data[5:], mod.crc32c(data[:5])) == expected


@pytest.mark.parametrize("length", [1, 8, 41, mod.C_ROWS_FROM - 1, mod.C_ROWS_FROM, 300])
def test_both_paths_agree_on_rows(length):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc32c

    rows = np.random.default_rng(length).integers(0, 256, (37, length), dtype=np.uint8)
    expected = [mod.crc32c_python(r.tobytes()) for r in rows]
    assert mod.crc32c_rows_numpy(rows).tolist() == expected
    assert mod.crc32c_rows(rows).tolist() == expected  # the C library from C_ROWS_FROM bytes, when installed
    assert [mod.crc32c(r.tobytes()) for r in rows] == expected
    assert mod.masked(mod.crc32c_rows(rows)).tolist() == [tb_masked_crc32c(r.tobytes()) for r in rows]
