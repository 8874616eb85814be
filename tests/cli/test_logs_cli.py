"""`hf-dist-recipes logs summarize`: JSON and text output, files written, bad input as one line and exit 2."""

from __future__ import annotations

import json
import sys

import pytest

from hf_dist_recipes.cli.main import main


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("cli_logs")
    for r in range(3):
        w = SummaryWriter(str(root / "logs" / f"rank{r}"))
        w.add_text("run", f"host=h{r} rank={r}")
        for s in range(1, 31):
            w.add_scalar("rank/step_time_s", 3.0 if (r == 2 and s >= 10) else 1.0 + 0.01 * r, s)
            w.add_scalar("train/learning_rate", 0.1, s)
            w.add_scalar("rank/loss", 2.0 - s / 100 + r / 1000, s)
        w.close()
    return root / "logs"


def test_json_names_the_straggler_and_writes_the_outputs(capsys, logdir, tmp_path):
    code = main(["logs", "summarize", str(logdir), "--out", str(tmp_path / "out"), "--json", "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["ranks"] == 3 and data["files"] == 3
    assert [(s["rank"], s["host"], s["from_step"]) for s in data["stragglers"]] == [(2, "h2", 10)]
    # Slowdown vs the median step time of the three ranks (1.01 at the steps where rank 2 takes 3.0).
    assert data["stragglers"][0]["slower_by"] == pytest.approx(3.0 / 1.01 - 1, rel=1e-6)
    assert data["divergences"] == [] and data["warnings"] == []
    assert data["tags"]["rank/loss"]["steps"] == 30
    assert (tmp_path / "out" / "report.md").is_file() and (tmp_path / "out" / "step_time_heatmap.png").is_file()
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 2 | h2 | 197% | 10 |" in report
    assert list((tmp_path / "out" / "aggregate").glob("events.out.tfevents.*"))


def test_text_output_and_default_out(capsys, logdir):
    code = main(["logs", "summarize", str(logdir), "--no-report"])
    out = capsys.readouterr().out
    assert code == 0
    assert "rank 2 on h2: 197% slower from step 10" in out and "divergence: none" in out
    assert list((logdir / "summary" / "aggregate").glob("events.out.tfevents.*"))
    # The summary folder sits under LOGDIR: summarizing again must not read it as a rank.
    assert main(["logs", "summarize", str(logdir), "--no-report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == 3


@pytest.mark.parametrize("extra, message", [([], "is not a directory"), (["--tp", "0"], "--tp must be >= 1")])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, extra, message):
    code = main(["logs", "summarize", str(tmp_path / "missing"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_dir_without_ranks_is_one_line_exit_2(capsys, tmp_path):
    code = main(["logs", "summarize", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "no event files in rank<N>" in err and err.count("\n") == 1


def test_without_the_report_extra_the_tables_are_written_and_the_extra_named(capsys, logdir, tmp_path, monkeypatch):
    # matplotlib is installed here (the dev lock); a None entry in sys.modules makes its import fail as an absent
    # package does, the state of a training image installed without the [report] extra.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["logs", "summarize", str(logdir), "--out", str(tmp_path / "out"), "--json", "--workers", "1"])
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads(captured.out)
    hint = "pip install 'hf-dist-recipes[report]'"
    assert hint in data["report_plots_missing"] and any(hint in w for w in data["warnings"])
    assert f"warning: report.md has no plots: matplotlib is not installed ({hint}" in captured.err
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 2 | h2 | 197% | 10 |" in report and hint in report
    assert not list((tmp_path / "out").glob("*.png"))
