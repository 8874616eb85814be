"""`hf-dist-recipes doctor --report`: the block to paste into an issue, from this machine's own probe. Expected values
come from the interpreter and the installed metadata, not from the doctor."""

from __future__ import annotations

import platform
from importlib.metadata import version

import torch

from hf_dist_recipes.cli.main import main


def test_the_report_names_this_machines_stack_and_what_applies(capsys):
    code = main(["doctor", "--report"])
    out = capsys.readouterr().out
    lines = dict(line[2:].split(": ", 1) for line in out.splitlines() if line.startswith("- "))
    assert lines["Python version"] == platform.python_version()
    assert lines["torch version"] == torch.__version__
    for package in ("deepspeed", "transformers", "accelerate"):
        assert lines[f"{package} version"] == version(package)
    assert lines["NVIDIA driver"] == "none" or torch.cuda.is_available()
    gpus = torch.cuda.device_count()
    assert lines["GPUs"] == "none visible" if gpus == 0 else lines["GPUs"].startswith(f"{gpus} x ")
    # The same run's table: every rule row it shows is in the block, by id, and the exit status is the table's.
    assert main(["doctor"]) == code
    table = capsys.readouterr().out
    rules = sorted(line.split("rule ", 1)[1].split()[0] for line in table.splitlines() if " rule " in line[:20])
    assert sorted(x for x in lines["Known issues that apply"].split(", ") if x != "none") == rules
    assert lines["Checks not passed"].endswith(f"(doctor exit {code})")


def test_known_issues_that_apply_show_as_notices_not_ok(capsys):
    main(["doctor", "--json"])
    import json

    checks = json.loads(capsys.readouterr().out)["checks"]
    info_rules = [c["name"] for c in checks if c["name"].startswith("rule ") and c["status"] == "ok"]
    main(["doctor"])
    table = capsys.readouterr().out
    for name in info_rules:
        (row,) = [line for line in table.splitlines() if line[11:].startswith(name)]
        assert row.split()[0] == "notice", row
    assert f"{len(info_rules)} notice(s)" in table.splitlines()[-1]
    assert not [line for line in table.splitlines() if line.split()[:2] == ["ok", "rule"]]
