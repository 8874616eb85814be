"""A checkpoint is complete, or it is not used (`checkpoint.manifest`, `checkpoint.auto_resume`), in one process:
a real RecipeTrainer on the tiny DeepSeek model, no DeepSpeed. The manifest every checkpoint gets, what makes one
incomplete, `auto_resume` passing over a half-written newest checkpoint and finishing bit for bit as the uninterrupted
run, an explicit path winning, and the rotation of complete checkpoints only. The ZeRO-3 / TP / EP layouts' manifests
(every rank's files listed): tests/distributed/test_checkpoint_lifecycle.py."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.checkpoint.auto_resume import AUTO_RESUME_ENV, plan_resume, resolve_auto_resume
from hf_dist_recipes.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointLayout,
    Manifest,
    check_checkpoint,
    checkpoint_files,
    newest_complete_checkpoint,
    rotate_complete_checkpoints,
    share,
    verify_digests,
    write_manifest,
)
from hf_dist_recipes.cli.main import main
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.damage import small_disk, zero_the_middle
from tests.support.models import SMALL

STEPS, SAVE_STEPS = 6, 2


def _trainer(out: Path, **overrides) -> RecipeTrainer:
    # use_cpu=True: bitwise equality needs the CPU's fp32 kernels, on a GPU host too.
    args = RecipeTrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
                                   learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=SAVE_STEPS,
                                   disable_tqdm=True, report_to="none", seed=7, use_cpu=True,
                                   **overrides)  # fmt: skip
    return RecipeTrainer(model_init=lambda: build_tiny_deepseek(**SMALL), args=args,
                         train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000))  # fmt: skip


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run: checkpoints 2, 4, 6, its losses and final weights."""
    out = tmp_path_factory.mktemp("full")
    trainer = _trainer(out)
    trainer.train()
    return {"out": out, "losses": _losses(trainer), "weights": trainer.model.state_dict()}


def test_every_checkpoint_gets_a_manifest_of_its_files(full):
    for step in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS):
        ckpt = full["out"] / f"checkpoint-{step}"
        manifest = Manifest.from_json((ckpt / MANIFEST_NAME).read_text())
        assert manifest.step == step and manifest.layout == CheckpointLayout(world_size=1)
        # Every file, the rank's counters (written before the manifest) and the optimizer included, with its size.
        assert manifest.files == checkpoint_files(ckpt)
        assert {"optimizer.pt", "trainer_state.json", "rank_metrics/rank0.json"} <= manifest.files.keys()
        assert check_checkpoint(ckpt) == [] and verify_digests(ckpt) == []
        # Each file's sha256, as hashlib reads the bytes on disk (what `sha256sum` prints).
        assert manifest.digests == {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in manifest.files}


@pytest.fixture
def ckpt(full, tmp_path) -> Path:
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(full["out"] / "checkpoint-4", copy)
    return copy


def test_a_missing_manifest_is_named(ckpt):
    (ckpt / MANIFEST_NAME).unlink()
    assert check_checkpoint(ckpt) == [f"no {MANIFEST_NAME} (its save did not finish)"]


def test_a_missing_or_truncated_file_is_named(ckpt):
    (ckpt / "rng_state.pth").unlink()
    size = (ckpt / "optimizer.pt").stat().st_size
    with open(ckpt / "optimizer.pt", "r+b") as f:
        f.truncate(size // 2)
    assert check_checkpoint(ckpt) == [
        f"optimizer.pt has {size // 2} bytes, the manifest says {size}",
        "rng_state.pth missing",
    ]


def _break(ckpt: Path, how: str) -> None:
    if how == "truncated":
        with open(ckpt / "optimizer.pt", "r+b") as f:
            f.truncate(100)
    elif how == "zeroed":
        zero_the_middle(ckpt / "optimizer.pt")
    else:
        (ckpt / MANIFEST_NAME).unlink()


PROBLEMS = {
    "truncated": "optimizer.pt has 100 bytes",
    "zeroed": "optimizer.pt is not what was saved: its sha256 differs from the manifest's",
    "no manifest": f"no {MANIFEST_NAME}",
}


def test_same_size_corruption_is_named_by_its_digest_and_the_cli_says_so(ckpt, capsys):
    assert check_checkpoint(ckpt) == [] and verify_digests(ckpt) == []
    zero_the_middle(ckpt / "optimizer.pt")
    assert check_checkpoint(ckpt) == []  # the sizes cannot see it
    (problem,) = verify_digests(ckpt)
    assert problem.startswith(PROBLEMS["zeroed"])
    # Each rank re-reads its share only; together they find it once.
    assert [p for rank in range(3) for p in verify_digests(ckpt, rank, 3)] == [problem]
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    assert PROBLEMS["zeroed"] in capsys.readouterr().out
    (ckpt / "rng_state.pth").unlink()  # gone between the sizes' check and the hashing: named, not raised
    assert [p.split(":")[0] for p in verify_digests(ckpt)] == [
        "optimizer.pt is not what was saved",
        "rng_state.pth unreadable",
    ]
    assert main(["checkpoint", "verify", str(ckpt.parent / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_checkpoint_verify_takes_an_output_folder_as_auto_resume_does(full, tmp_path, capsys):
    for step in (2, 4):
        shutil.copytree(full["out"] / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    assert main(["checkpoint", "verify", str(tmp_path), "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    files = Manifest.from_json((tmp_path / "checkpoint-4" / MANIFEST_NAME).read_text()).files
    assert clean["checkpoint"] == str(tmp_path / "checkpoint-4") and clean["skipped"] == []
    assert (clean["files"], clean["bytes"]) == (len(files), sum(files.values()))
    zero_the_middle(tmp_path / "checkpoint-4" / "optimizer.pt")
    assert main(["checkpoint", "verify", str(tmp_path), "--json"]) == 0  # checkpoint-2 still resumes
    found = json.loads(capsys.readouterr().out)
    assert found["checkpoint"] == str(tmp_path / "checkpoint-2")
    assert [s["checkpoint"] for s in found["skipped"]] == [str(tmp_path / "checkpoint-4")]


def test_a_format_1_manifest_of_sizes_only_is_still_read(ckpt):
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    del data["digests"]
    data["format"] = 1
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))
    zero_the_middle(ckpt / "optimizer.pt")
    assert check_checkpoint(ckpt) == [] and verify_digests(ckpt) == []  # no digests: checked by sizes, as before
    (ckpt / "rng_state.pth").unlink()
    assert check_checkpoint(ckpt) == ["rng_state.pth missing"]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_each_file_is_hashed_by_one_rank_and_the_shares_are_balanced(world):
    files = {f"f{i}": size for i, size in enumerate([900, 700, 650, 400, 300, 300, 120, 80, 10, 0])}
    shares = [share(files, rank, world) for rank in range(world)]
    assert sorted(n for s in shares for n in s) == sorted(files)
    loads = [sum(files[n] for n in s) for s in shares]
    # Greedy largest-first: the most loaded rank got its last file while it had the least, so it exceeds the least
    # loaded one by at most that file, and never by more than the largest file.
    assert max(loads) - min(loads) <= max(files.values())
    assert shares == [share(dict(reversed(files.items())), rank, world) for rank in range(world)]  # order-free


@pytest.mark.parametrize("how", ["truncated", "zeroed", "no manifest"])
def test_auto_resume_passes_over_an_incomplete_checkpoint_and_finishes_as_the_uninterrupted_run(
    full, tmp_path, how, caplog
):
    out = tmp_path / "run"
    for step in (2, 4):  # a job that died after writing (part of) checkpoint-4
        shutil.copytree(full["out"] / f"checkpoint-{step}", out / f"checkpoint-{step}")
    _break(out / "checkpoint-4", how)
    trainer = _trainer(out, auto_resume=True, save_total_limit=2)
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes.trainer"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.name == "hf_dist_recipes.trainer"]
    lines = [m for m in said if "the recipe's defaults in place of" not in m]  # the start-up line aside
    problem = PROBLEMS[how]
    assert len(lines) == 2
    assert lines[0].startswith(f"{out / 'checkpoint-4'} is incomplete, not resumed from: {problem}")
    assert lines[1] == f"auto_resume: resuming from {out / 'checkpoint-2'}"
    # Steps 3-6 trained again from checkpoint-2: the same numbers, bit for bit (one process, fp32 on the CPU).
    losses = _losses(trainer)
    assert [losses[s] for s in range(3, STEPS + 1)] == [full["losses"][s] for s in range(3, STEPS + 1)]
    weights = trainer.model.state_dict()
    assert weights.keys() == full["weights"].keys()
    assert all(torch.equal(weights[k], full["weights"][k]) for k in weights)
    # save_total_limit=2 counted complete checkpoints (4 rewritten whole, then 6): 2 went, and the stock rotation
    # was off only while the Trainer saved.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert all(check_checkpoint(p) == [] for p in out.glob("checkpoint-*"))
    assert trainer.args.save_total_limit == 2


def test_auto_resume_starts_fresh_without_a_complete_checkpoint_and_says_so(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    plan = plan_resume(None, True, str(tmp_path))
    assert plan.checkpoint is None
    assert plan.lines == [
        f"{tmp_path / 'checkpoint-2'} is incomplete, not resumed from: no {MANIFEST_NAME} (its save did not finish)",
        f"auto_resume: no complete checkpoint in {tmp_path}, starting fresh",
    ]
    assert plan_resume(None, True, str(tmp_path / "nothing")).checkpoint is None


def _fake(output_dir: Path, step: int, complete: bool = True) -> str:
    ckpt = output_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_bytes(b"x" * step)
    if complete:
        write_manifest(ckpt, step, CheckpointLayout(world_size=2, tp=2))
    return str(ckpt)


def test_an_explicit_path_wins_and_true_takes_the_newest_complete_checkpoint(tmp_path):
    two, four, six = _fake(tmp_path, 2), _fake(tmp_path, 4), _fake(tmp_path, 6, complete=False)
    assert plan_resume(two, True, str(tmp_path)).checkpoint == two  # also over auto_resume
    assert plan_resume(six, False, str(tmp_path)).checkpoint == six  # as given, complete or not
    assert plan_resume(Path(two), True, str(tmp_path)).checkpoint == two
    assert plan_resume(None, False, str(tmp_path)).checkpoint is None  # the stock default: fresh
    stock_last = plan_resume(True, False, str(tmp_path))
    assert (
        stock_last.checkpoint == four and stock_last.lines[-1] == f"resume_from_checkpoint=True: resuming from {four}"
    )
    assert newest_complete_checkpoint(tmp_path).skipped[0].checkpoint == six
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory .*pass a checkpoint's path"):
        plan_resume(True, False, str(tmp_path / "empty"))


def test_rotation_keeps_the_newest_complete_checkpoint_and_does_not_count_incomplete_ones(tmp_path):
    two, four = _fake(tmp_path, 2), _fake(tmp_path, 4)
    six = _fake(tmp_path, 6, complete=False)  # a save in progress, or what a crash left
    # save_total_limit=1: the stock rotation would keep checkpoint-6 alone; the newest complete one stays.
    assert rotate_complete_checkpoints(tmp_path, 1) == [two]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    eight, ten = _fake(tmp_path, 8), _fake(tmp_path, 10)
    # Two complete ones kept, the best (4) among them; the incomplete one neither counted nor deleted.
    assert rotate_complete_checkpoints(tmp_path, 2, best=four) == [eight]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-6"]
    assert rotate_complete_checkpoints(tmp_path, None) == [] and Path(six).is_dir() and Path(ten).is_dir()


def test_auto_resume_is_off_by_default_and_the_environment_turns_it_on(monkeypatch, tmp_path):
    assert resolve_auto_resume(False, {}) is False and resolve_auto_resume(True, {AUTO_RESUME_ENV: "0"}) is True
    assert resolve_auto_resume(False, {AUTO_RESUME_ENV: "1"}) is True
    with pytest.raises(ValueError, match=f"{AUTO_RESUME_ENV}='maybe': set it to 1"):
        resolve_auto_resume(False, {AUTO_RESUME_ENV: "maybe"})
    monkeypatch.setenv(AUTO_RESUME_ENV, "1")
    assert RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none").auto_resume is True


def test_a_save_the_disk_cannot_hold_is_not_begun_and_says_the_bytes(tmp_path, caplog):
    """A real 1.2 MiB tmpfs: checkpoint-2 (about 0.6 MiB) fits, checkpoint-4 would not. Stock, the save would begin
    and die in torch's `unexpected pos ...`; here the Trainer raises OSError(ENOSPC) before writing, naming the
    folder, the bytes free and the bytes needed (checkpoint-2's, from its manifest), and checkpoint-2 stays whole."""
    with small_disk(tmp_path / "disk", "1200k") as disk:
        trainer = _trainer(disk / "run")
        with pytest.raises(OSError) as raised:
            trainer.train()
        two = disk / "run" / "checkpoint-2"
        took = sum(Manifest.from_json((two / MANIFEST_NAME).read_text()).files.values())
        assert raised.value.errno == errno.ENOSPC and trainer.state.global_step == 4
        message = str(raised.value)
        assert f"{disk / 'run' / 'checkpoint-4'}: not enough disk space for a checkpoint" in message
        assert f"takes {took:,} bytes (" in message and "(as checkpoint-2 took)" in message
        free = int(re.search(r"([\d,]+) bytes \([^)]*\) free", message)[1].replace(",", ""))
        assert free < took and "save_total_limit" in message
        assert not (disk / "run" / "checkpoint-4").exists() and check_checkpoint(two) == []
        assert verify_digests(two) == []


def test_a_failed_write_on_a_full_disk_is_explained_with_its_type_and_message_kept(tmp_path):
    import torch

    from hf_dist_recipes.checkpoint.disk_space import explain

    # torch's full-disk error, for real: a RuntimeError that names no disk.
    with small_disk(tmp_path / "disk", "64k") as disk:
        with pytest.raises(RuntimeError) as raised:
            torch.save({"w": torch.zeros(64 * 1024)}, disk / "optimizer.pt")
        assert "unexpected pos" in str(raised.value) and "space" not in str(raised.value)
        said = explain(raised.value, disk, 256 * 1024, "estimated from the model")
        assert said.startswith(f"{disk}: not enough disk space for a checkpoint: ") and "takes 262,144 bytes" in said
        assert raised.value.__notes__ == [said] and "unexpected pos" in str(raised.value)
    # The kernel's own: a write to /dev/full fails with ENOSPC whatever the space.
    with pytest.raises(OSError) as raised:
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 4096)
    assert raised.value.errno == errno.ENOSPC and explain(raised.value, tmp_path, 0, "x") is not None
    assert explain(ValueError("a bug"), tmp_path, 0, "x") is None  # not the disk: said nothing
