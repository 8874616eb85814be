"""The demo's data as `datasets.Dataset`s of byte blocks (token ids are byte values 0-255: no tokenizer).

Two sources, one path through `datasets`:
- `stdlib_dataset`: the Python standard library's own `*.py` files, present on every machine that runs Python;
- `text_files_dataset`: the user's local text (`.txt`, any non-JSON suffix: one row per line) or JSON Lines
  (`.json` / `.jsonl`: one record per line, the text in `text_field`) files.

Both read the files with `datasets.load_dataset("text" | "json", data_files=...)` and pack them with
`Dataset.map`; datasets caches each stage under a fingerprint of its inputs (the files' paths and modification
times, the packing function and its arguments), so a second run with the same files and `seq_len` loads the blocks
from the cache instead of rebuilding them, and an edited file is read again. The cache is datasets' own
(`HF_DATASETS_CACHE`, default `~/.cache/huggingface/datasets`) unless `cache_dir` is given: it outlives the run's
output directory, which is the point of caching by fingerprint. Nothing is fetched over the network:
`HF_HUB_OFFLINE=1` / `HF_DATASETS_OFFLINE=1` work.

Rows are `{"input_ids": LongTensor[seq_len], "labels": same}` (the model shifts the labels), in file order; rows of
the source are joined with a newline before cutting, and the bytes that do not fill a last block are dropped.

What the console says: datasets' own progress bars are off while the demo builds (`quiet_datasets`): for local
files they read "Downloading data: 74/74 files" (datasets' word for resolving data files, local ones included),
"Generating train split" and "byte blocks of 128", once per process that builds. `describe_blocks` says instead, in
one line, what was read, how many blocks came of it, and whether they were built or loaded from the cache.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from hf_dist_recipes.core.user_values import positive_int

JSON_SUFFIXES = (".json", ".jsonl")
SEPARATOR = b"\n"  # between rows of the source: lines of a text file, records of a JSON Lines file, whole files
# A causal LM learns from next-token targets: a block of n tokens gives n - 1 of them (transformers' loss shifts the
# labels by one). One token gives none, and the loss is 0/0 = NaN (measured: DeepseekV3ForCausalLM, seq_len 1).
MIN_SEQ_LEN = 2


def validate_seq_len(value: object, name: str = "seq_len") -> int:
    """Return `value`, or raise ValueError unless it is at least MIN_SEQ_LEN tokens (bytes). `name`: the setting as
    the user wrote it (`seq_len`, or the demo's `--seq-len`)."""
    return positive_int(value, name, 128, minimum=MIN_SEQ_LEN, unit="tokens")


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The `*.py` files directly under the standard library directory (`root`, default: this interpreter's),
    sorted by name so that every rank and every run sees the same order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if not files:
        raise ValueError(f"no *.py files under {base}; pass root= pointing at a directory of Python sources")
    return files


def files_up_to(paths: Sequence[Path], max_bytes: int) -> list[Path]:
    """The shortest prefix of `paths` whose sizes add up to `max_bytes` (all of them if they do not)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chosen, total = [], 0
    for path in paths:
        chosen.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return chosen


def pack_bytes(batch: dict[str, list], seq_len: int, text_field: str) -> dict[str, np.ndarray]:
    """`Dataset.map(batched=True)` function: the batch's texts as UTF-8, joined by SEPARATOR, cut into blocks of
    `seq_len` bytes; the remainder of each batch is dropped (as in transformers' run_clm example). Missing texts
    (JSON null) are skipped."""
    data = SEPARATOR.join(text.encode("utf-8") for text in batch[text_field] if text is not None)
    n_blocks = len(data) // seq_len
    blocks = np.frombuffer(data, dtype=np.uint8, count=n_blocks * seq_len).reshape(n_blocks, seq_len)
    return {"input_ids": blocks, "labels": blocks}


def byte_blocks(
    texts, seq_len: int = 128, text_field: str = "text", max_blocks: int | None = None, source: str = "the data"
):
    """`texts` (a `datasets.Dataset` with a string column `text_field`) as blocks of `seq_len` bytes, at most
    `max_blocks` of them, formatted as torch tensors. `source` names the data in error messages."""
    import datasets

    validate_seq_len(seq_len)
    if text_field not in texts.column_names:
        raise ValueError(
            f"{source} has no field {text_field!r} (fields: {', '.join(texts.column_names) or 'none'}); "
            f"pass --text-field with the field that holds the text"
        )
    feature = texts.features[text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(
            f"field {text_field!r} of {source} holds {feature}, not text; pass --text-field with the "
            f"field that holds the text"
        )
    byte = datasets.Value("uint8")  # 1 byte per token on disk; the torch format hands them out as int64
    blocks = texts.map(
        pack_bytes,
        batched=True,
        fn_kwargs={"seq_len": seq_len, "text_field": text_field},
        remove_columns=texts.column_names,
        features=datasets.Features({"input_ids": datasets.List(byte), "labels": datasets.List(byte)}),
        desc=f"byte blocks of {seq_len}",
    )
    if len(blocks) == 0:
        raise ValueError(f"{source} gives no block of seq_len={seq_len} bytes; use more text or a shorter --seq-len")
    if max_blocks is not None and max_blocks < len(blocks):
        blocks = blocks.select(range(max_blocks))
    return blocks.with_format("torch")


def stdlib_dataset(
    seq_len: int = 128,
    max_bytes: int = 2_000_000,
    root: str | Path | None = None,
    cache_dir: str | os.PathLike | None = None,
):
    """The demo dataset: standard-library source (`root`, default this interpreter's) as `max_bytes // seq_len`
    byte blocks (about 15,600 blocks of 128 at the defaults). Each file is one row; `cache_dir` defaults to
    datasets' cache."""
    import datasets

    files = files_up_to(stdlib_source_files(root), max_bytes)
    # Each file whole (sample_by="document"); "replace" because a source file is not obliged to be UTF-8.
    texts = datasets.load_dataset(
        "text",
        data_files=[str(p) for p in files],
        split="train",
        sample_by="document",
        encoding_errors="replace",
        cache_dir=_path_or_none(cache_dir),
    )
    source = f"the standard library ({files[0].parent})"
    return byte_blocks(texts, seq_len, max_blocks=max_bytes // seq_len, source=source)


class TokenBlocks(torch.utils.data.Dataset):
    """Blocks of token ids held as one (blocks, seq_len) int64 tensor `tokens`; `labels` equal `input_ids`. For
    code that slices the blocks or folds the byte values into a smaller vocabulary (tests, benchmarks)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        block = self.tokens[idx]
        return {"input_ids": block, "labels": block}


def token_blocks(data, vocab_size: int | None = None) -> TokenBlocks:
    """The blocks of a byte-block `datasets.Dataset` (`stdlib_dataset`, `text_files_dataset`) as `TokenBlocks`,
    the byte values taken modulo `vocab_size` when given (a model with fewer than 256 tokens)."""
    tokens = data.with_format("torch")[:]["input_ids"].long()  # one (blocks, seq_len) tensor
    return TokenBlocks(tokens % vocab_size if vocab_size else tokens)


def check_data_files(paths: Sequence[str | os.PathLike]) -> tuple[str, list[str]]:
    """(datasets builder name, absolute paths) for the user's files, or ValueError naming the problem: no file,
    a missing file, only empty files, or JSON and text files mixed. Cheap: nothing is read."""
    if not paths:
        raise ValueError("no data files given; pass --data-files PATH [PATH ...]")
    resolved = []
    for path in paths:
        p = Path(path).expanduser().resolve()
        if not p.is_file():
            raise ValueError(
                f"data file {path} does not exist (or is not a file); pass existing files with "
                "--data-files PATH [PATH ...]"
            )
        resolved.append(p)
    kinds = {"json" if p.suffix.lower() in JSON_SUFFIXES else "text" for p in resolved}
    if len(kinds) > 1:
        suffixes = ", ".join(sorted({p.suffix or "(none)" for p in resolved}))
        raise ValueError(
            f"data files mix JSON Lines and text ({suffixes}); pass files of one kind: all "
            f"{'/'.join(JSON_SUFFIXES)}, or all text"
        )
    if all(p.stat().st_size == 0 for p in resolved):
        raise ValueError(
            f"data file{'s are' if len(resolved) > 1 else ' is'} empty: {', '.join(map(str, paths))}; "
            f"pass files that hold text"
        )
    return kinds.pop(), [str(p) for p in resolved]


def text_files_dataset(
    paths: Sequence[str | os.PathLike],
    seq_len: int = 128,
    text_field: str = "text",
    cache_dir: str | os.PathLike | None = None,
):
    """The user's local files as byte blocks of `seq_len`: text files line by line, JSON Lines files by the
    string field `text_field` (default "text"). ValueError, naming the fix, for files that give no training data."""
    import datasets

    builder, files = check_data_files(paths)
    source = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more file(s)"
    try:
        texts = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=_path_or_none(cache_dir))
    except datasets.exceptions.DatasetGenerationError as err:
        cause = err.__cause__ or err
        if isinstance(cause, UnicodeDecodeError):
            raise ValueError(
                f"{source} is not UTF-8 text ({cause.reason} at byte {cause.start}); save it as UTF-8"
            ) from err
        raise ValueError(
            f"could not read {source} as {'JSON Lines' if builder == 'json' else 'text'}: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        ) from err
    if len(texts) == 0:
        raise ValueError(f"{source} holds no text; pass files with some")
    return byte_blocks(texts, seq_len, text_field=text_field, source=source)


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """datasets' progress bars off inside the block, as they were after it."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def describe_blocks(
    blocks,
    seq_len: int,
    files: Sequence[str | os.PathLike],
    source: str,
    started: float,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """One line for the console: `blocks` (a byte-block dataset) of `seq_len` bytes from `files` (`source` says
    whose), built since `started` (time.time()) or loaded from the cache (`cache_dir`, default datasets' own), which
    its cache files' times tell."""
    import datasets

    cache = [f["filename"] for f in blocks.cache_files]
    where = os.fspath(cache_dir) if cache_dir is not None else datasets.config.HF_DATASETS_CACHE
    # A file's time comes from the kernel's coarse clock, up to a tick (<= 10 ms) behind time.time(), never ahead:
    # a file from an earlier run is always older than `started`, and a build (tens of ms at least) writes later.
    if not cache:
        how = "built in memory"
    elif any(os.path.getmtime(f) >= started for f in cache):
        how = f"built and cached in {where}"
    else:
        how = f"loaded from the cache in {where}"
    count = f"{len(files)} local file{'s' if len(files) != 1 else ''}"
    return f"data: {len(blocks):,} blocks of {seq_len} bytes from {count} ({source}), {how}; nothing downloaded"


def _path_or_none(path: str | os.PathLike | None) -> str | None:
    return None if path is None else os.fspath(path)
