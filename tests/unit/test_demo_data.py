"""The demo's data through datasets: byte blocks of the standard library's source or of the user's own files,
cached by fingerprint. Expected blocks are the files' bytes, cut by hand below."""

import os
import time

import datasets
import pytest
import torch

from hf_dist_recipes.demo.data import (
    check_data_files,
    describe_blocks,
    quiet_datasets,
    stdlib_dataset,
    text_files_dataset,
)


def _bytes(row) -> bytes:
    return bytes(row["input_ids"].tolist())


def test_stdlib_blocks_are_the_source_bytes_and_the_second_build_is_the_cache(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")  # 6 bytes
    (root / "b.py").write_text("y = 22\n")  # 7 bytes
    cache = tmp_path / "cache"
    first = stdlib_dataset(seq_len=4, max_bytes=1000, root=root, cache_dir=cache)
    assert isinstance(first, datasets.Dataset)
    # files in name order, joined by a newline: "x = 1\n" + "\n" + "y = 22\n" = 14 bytes -> 3 blocks of 4
    assert [_bytes(r) for r in first] == [b"x = ", b"1\n\ny", b" = 2"]
    assert first[0]["input_ids"].dtype == torch.int64  # what the embedding takes
    assert (first[0]["input_ids"] == first[0]["labels"]).all()

    arrow_files = [f["filename"] for f in first.cache_files]
    stamps = {f: os.stat(f).st_mtime_ns for f in arrow_files}
    again = stdlib_dataset(seq_len=4, max_bytes=1000, root=root, cache_dir=cache)
    assert again._fingerprint == first._fingerprint
    assert [f["filename"] for f in again.cache_files] == arrow_files  # loaded, not rebuilt
    assert {f: os.stat(f).st_mtime_ns for f in arrow_files} == stamps

    # another block length is another fingerprint; an edited file is read again, not served stale from the cache
    assert stdlib_dataset(seq_len=5, max_bytes=1000, root=root, cache_dir=cache)._fingerprint != first._fingerprint
    (root / "a.py").write_text("z = 3\n")
    os.utime(root / "a.py", ns=(1_000_000_000, 1_000_000_000))
    assert _bytes(stdlib_dataset(seq_len=4, max_bytes=1000, root=root, cache_dir=cache)[0]) == b"z = "


def test_the_data_step_is_one_line_of_ours_and_none_of_datasets(tmp_path, capfd):
    """Issue 30: on a fresh machine datasets' bars said "Downloading data: 74/74 files" (local files),
    "Generating train split" and "byte blocks of 128" from the demo's data step. Inside `quiet_datasets` they say
    nothing; `describe_blocks` says what happened: built on the first call, loaded from the cache on the second."""
    root = tmp_path / "lib"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    (root / "b.py").write_text("y = 22\n")
    stdlib_dataset(seq_len=4, max_bytes=1000, root=root, cache_dir=tmp_path / "loud")  # the control: bars shown
    assert "Generating train split" in capfd.readouterr().err
    cache = tmp_path / "cache"
    for how in ("built and cached in", "loaded from the cache in"):
        started = time.time()
        with quiet_datasets():
            blocks = stdlib_dataset(seq_len=4, max_bytes=1000, root=root, cache_dir=cache)
        line = describe_blocks(blocks, 4, sorted(root.iterdir()), "the test's", started, cache_dir=cache)
        assert line == f"data: 3 blocks of 4 bytes from 2 local files (the test's), {how} {cache}; nothing downloaded"
    assert capfd.readouterr() == ("", "")
    assert datasets.is_progress_bar_enabled()  # as it was before


def test_stdlib_max_bytes_caps_the_blocks(tmp_path):
    data = stdlib_dataset(seq_len=32, max_bytes=100_000, cache_dir=tmp_path)
    assert len(data) == 100_000 // 32
    assert all(0 <= int(v) < 256 for v in data[len(data) - 1]["input_ids"])


def test_text_files_line_by_line(tmp_path):
    (tmp_path / "one.txt").write_text("ab\ncd\n")
    (tmp_path / "two.txt").write_text("efgh\n")
    data = text_files_dataset([tmp_path / "one.txt", tmp_path / "two.txt"], seq_len=4, cache_dir=tmp_path / "c")
    # lines ab, cd, efgh joined by newlines: "ab\ncd\nefgh" (10 bytes) -> 2 blocks, 2 bytes dropped
    assert [_bytes(r) for r in data] == [b"ab\nc", b"d\nef"]


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"content": "hello", "id": 1}\n{"content": "w\\u00f6rld", "id": 2}\n')
    data = text_files_dataset([path], seq_len=5, text_field="content", cache_dir=tmp_path / "c")
    # "hello\nwörld": ö is 2 bytes in UTF-8, 12 bytes in all -> 2 blocks of 5
    assert [_bytes(r) for r in data] == [b"hello", "\nw\u00f6r".encode()]


@pytest.mark.parametrize(
    "name, content, field, message",
    [
        ("no_field.jsonl", '{"body": "hello world"}\n', "text", "has no field 'text' (fields: body)"),
        ("numbers.jsonl", '{"text": 3}\n', "text", "holds Value('int64'), not text"),
        ("broken.jsonl", '{"text": "x"\n', "text", "could not read"),
        ("empty.txt", "", "text", "is empty"),
        ("blank.txt", "\n\n", "text", "gives no block of seq_len=8"),
        ("latin1.txt", b"caf\xe9 au lait\n", "text", "is not UTF-8 text"),
    ],
)
def test_bad_user_data_is_one_value_error(tmp_path, name, content, field, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match="^[^\n]*$") as err:
        text_files_dataset([path], seq_len=8, text_field=field, cache_dir=tmp_path / "c")
    assert message in str(err.value)


def test_file_checks_before_reading(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="does not exist"):
        check_data_files([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match=r"mix JSON Lines and text \(.jsonl, .txt\)"):
        check_data_files([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    with pytest.raises(ValueError, match="no data files"):
        check_data_files([])
    assert check_data_files([tmp_path / "b.jsonl"]) == ("json", [str(tmp_path / "b.jsonl")])
    assert check_data_files([tmp_path / "a.txt"])[0] == "text"


def test_token_blocks_fold_the_byte_values_and_keep_the_order():
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    data = stdlib_dataset(seq_len=16, max_bytes=4096)
    folded = token_blocks(data, 100)
    assert folded.tokens.shape == (256, 16) and folded.tokens.dtype == torch.int64
    assert torch.equal(folded[3]["input_ids"], data[3]["input_ids"] % 100)
    assert int(folded.tokens.max()) < 100 <= int(token_blocks(data).tokens.max())
