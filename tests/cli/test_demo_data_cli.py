"""`hf-dist-recipes demo --data-files`: bad files are one line and exit status 2 before any launch; good ones
travel to the per-rank script as absolute paths; nothing needs the network."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from hf_dist_recipes.cli.main import main
from hf_dist_recipes.demo.settings import add_training_flags, settings_from
from tests.support.paths import REPO


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "files, argv, message",
    [
        ({}, ["missing.txt"], "data file missing.txt does not exist"),
        (
            {"a.jsonl": '{"body": "hi there"}\n'},
            ["a.jsonl", "--text-field", "text"],
            "has no field 'text' (fields: body)",
        ),
        ({"a.txt": "some text\n", "b.jsonl": '{"text": "x"}\n'}, ["a.txt", "b.jsonl"], "mix JSON Lines and text"),
        ({"empty.txt": ""}, ["empty.txt"], "is empty"),
        ({"short.txt": "tiny\n"}, ["short.txt"], "gives no block of seq_len=128 bytes"),
    ],
)
def test_bad_data_files_are_one_line_and_status_2(capsys, tmp_path, monkeypatch, files, argv, message):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, out, err = _run(capsys, ["demo", "--dry-run", "--data-files", *argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_data_files_travel_to_the_ranks_as_absolute_paths(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"body": f"line {i} " * 20}) + "\n" for i in range(5)))
    code, out, _ = _run(capsys, ["demo", "--dry-run", "--json", "--data-files", "notes.jsonl", "--text-field", "body"])
    assert code == 0
    plan = json.loads(out)
    assert plan["settings"]["data_files"] == [str(tmp_path / "notes.jsonl")]
    # The per-rank script parses the launch command's flags back into the same settings.
    train_argv = plan["command"][plan["command"].index("hf_dist_recipes.demo.train") + 1 :]
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    ranks = settings_from(parser.parse_args(train_argv))
    assert ranks.data_files == (str(tmp_path / "notes.jsonl"),) and ranks.text_field == "body"
    # without --data-files nothing extra travels: the ranks train on the standard library
    code, out, _ = _run(capsys, ["demo", "--dry-run", "--json"])
    assert "--data-files" not in json.loads(out)["command"]


def test_offline_real_process_with_its_own_datasets_cache(tmp_path):
    (tmp_path / "book.txt").write_text("It was a dark and stormy night.\n" * 20)
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "hf_dist_recipes.cli.main", "demo", "--dry-run", "--data-files"]
    ok = subprocess.run(
        cmd + [str(tmp_path / "book.txt")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"data    {tmp_path / 'book.txt'}" in ok.stdout
    assert list((tmp_path / "cache").rglob("cache-*.arrow"))  # the packed blocks, in HF_DATASETS_CACHE
    bad = subprocess.run(
        cmd + [str(tmp_path / "nofield.jsonl")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"hf-dist-recipes demo: error: {tmp_path / 'nofield.jsonl'} has no field 'text' (fields: body); "
        "pass --text-field with the field that holds the text"
    ]
