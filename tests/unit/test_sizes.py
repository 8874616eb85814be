"""The one size grammar (`core.sizes`) and every setting that reads it: the trainer's arguments, `checkpoint
export --max-shard-size`, `commbench --sizes` / `--link-size`; and `format_size`, the way back. Expected bytes and
texts are worked out by hand in each line."""

from __future__ import annotations

import pytest

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.cli.main import main as cli_main
from hf_dist_recipes.comm.commbench import BenchSettings
from hf_dist_recipes.core.sizes import format_size, parse_size, parse_sizes


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1048576", 1048576),
        ("16B", 16),
        ("5GB", 5 * 10**9),  # decimal, as transformers' max_shard_size
        ("500MB", 500 * 10**6),
        ("64KB", 64_000),
        ("2GiB", 2 * 2**30),  # binary
        ("500mib", 500 * 2**20),
        ("64KiB", 65_536),
        ("1K", 1024),  # a bare unit is binary, as nccl-tests' -b/-e
        ("1k", 1024),
        ("64M", 64 * 2**20),
        ("2G", 2 * 2**30),
        (" 8 K ", 8192),
        ("1.5GB", 1_500_000_000),
        ("0.29GB", 290_000_000),  # exact: 0.29 * 1e9 in floats is 289999999.99999994
        (4096, 4096),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_the_units_transformers_knows_mean_what_it_means():
    from transformers.utils.hub import convert_file_size_to_int

    for text in ("5GB", "2GiB", "500MB", "500MiB", "64KB", "64KiB"):
        assert parse_size(text) == convert_file_size_to_int(text)


@pytest.mark.parametrize("bad", ["", "0", "0.1B", "-1GB", "5TB", "five", "1X", "K", "1e6", "1K1", "True"])
def test_a_bad_size_names_its_setting_and_the_forms(bad):
    with pytest.raises(ValueError, match=r"^max_shard: .* is not a size in bytes; give a positive size such as 5GB"):
        parse_size(bad, "max_shard")


def test_lists_sort_dedup_and_refuse_empty():
    assert parse_sizes("16M,1K,1M,1K") == (1024, 2**20, 16 * 2**20)
    assert parse_sizes("1KB,1KiB") == (1000, 1024)
    with pytest.raises(ValueError, match="--sizes is empty; give comma-separated sizes"):
        parse_sizes(" , ", "--sizes")
    with pytest.raises(ValueError, match="--sizes: '1X' is not a size in bytes"):
        parse_sizes("1K,1X", "--sizes")


def test_trainer_arguments_read_the_grammar(tmp_path):
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path), max_unpartitioned_model_size="2GiB", save_shard_size="64M", report_to="none"
    )
    assert args.max_unpartitioned_model_bytes == 2 * 1024**3
    assert args.save_shard_bytes == 64 * 1024**2
    args = RecipeTrainingArguments(output_dir=str(tmp_path), max_unpartitioned_model_size="2GB", report_to="none")
    assert args.max_unpartitioned_model_bytes == 2_000_000_000


@pytest.mark.parametrize("name", ["max_unpartitioned_model_size", "save_shard_size"])
def test_a_bad_argument_size_names_the_argument(tmp_path, name):
    with pytest.raises(ValueError, match=rf"^{name}: '2 gigs' is not a size in bytes"):
        RecipeTrainingArguments(output_dir=str(tmp_path), report_to="none", **{name: "2 gigs"})


def test_commbench_reads_the_same_grammar(capsys):
    # The defaults: 1K..16M are binary (nccl-tests' sizes), 4M per ring-link send.
    assert BenchSettings().sizes == (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)
    assert BenchSettings().link_bytes == 4 * 2**20
    # The CLI refuses a bad --link-size before launching anything, naming the flag (exit 2, one line).
    code = cli_main(["commbench", "--num-processes", "2", "--sizes", "1KB,2GiB", "--link-size", "2 gigs"])
    err = capsys.readouterr().err
    assert code == 2 and "--link-size: '2 gigs' is not a size in bytes" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "n, options, text",
    [
        (3 * 2**30 // 2, {}, "1.5 GiB"),  # from one GiB up: GiB
        (4_000_000, {}, "3.8 MiB"),  # 4,000,000 / 1,048,576 = 3.81
        (512 * 2**20, {"digits": 0}, "512 MiB"),
        (1_234_500_000_000, {"decimal": True}, "1,234.5 GB"),  # decimal: the shard sizes' units
        (12_340_000, {"decimal": True}, "12.3 MB"),
        (64 * 2**20, {"short": True}, "64M"),  # the short form, as --sizes takes it and nccl-tests prints it
        (2**30, {"short": True}, "1G"),
        (3 * 2**19, {"short": True}, "1536K"),  # 1.5 MiB: a whole number of KiB only
        (512, {"short": True}, "512B"),
        (1536 + 100, {"short": True}, "1.6K"),  # 1636 / 1024 = 1.598
    ],
)
def test_format_size(n, options, text):
    assert format_size(n, **options) == text


def test_the_short_form_reads_back():
    for n in (1024, 4096, 64 * 2**20, 2**30, 3 * 2**19, 100):
        assert parse_size(format_size(n, short=True)) == n
