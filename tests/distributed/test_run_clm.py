"""A run_clm.py-shaped script with one import changed (tests/scripts/run_clm.py) under `accelerate launch` with
the shipped 2-process ZeRO-3 CPU config (issue 19 part 4): a tiny Llama from `--model_type llama
--config_overrides`, a tokenizer trained with `tokenizers` and text files from the standard library
(tests/scripts/clm_data.py). Two launches shared by every test: one uninterrupted run of STEPS steps that saves
checkpoint-RESUME_AT, and one resumed from that checkpoint with `--resume_from_checkpoint`. Recipe arguments are
given on the command line and their effect is read back from the run's outputs."""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from itertools import chain
from pathlib import Path

import pytest
import torch

from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

SCRIPT = str(REPO / "tests" / "scripts" / "run_clm.py")
YAML = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
STEPS, RESUME_AT = 16, 8
PEAK_LR, MIN_LR_RATIO, CYCLES = 3e-3, 0.1, 3  # 3 cycles: the recipe's default num_cycles
BLOCK, EVAL_SAMPLES, SHARD = 64, 32, "200KB"
# hidden 64, 2 layers, vocab 512 = clm_data.VOCAB_SIZE. head_dim is given: LlamaConfig() fixes it at 128 (its
# 4096 / 32) when built, and update_from_string does not derive it again from the overridden hidden_size and heads.
OVERRIDES = (
    "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,"
    "head_dim=16,vocab_size=512,max_position_embeddings=128"
)


def _command(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The command line of the README's example (run under `accelerate launch --config_file YAML`)."""
    return [
        SCRIPT,
        "--model_type", "llama", "--config_overrides", OVERRIDES, "--tokenizer_name", str(data["tokenizer"]),
        "--train_file", str(data["train"]), "--validation_file", str(data["validation"]),
        "--block_size", str(BLOCK), "--max_eval_samples", str(EVAL_SAMPLES), "--cache_dir", str(out.parent / "cache"),
        "--do_train", "--do_eval", "--output_dir", str(out), "--max_steps", str(STEPS), "--save_steps", str(RESUME_AT),
        "--per_device_train_batch_size", "4", "--learning_rate", str(PEAK_LR), "--logging_steps", "1",
        # recipe arguments, each with an effect read back below
        "--seed_check", "warn", "--max_unpartitioned_model_size", "2GiB", "--save_shard_size", SHARD,
        "--min_lr_ratio", str(MIN_LR_RATIO), "--nonfinite_policy", "halt",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    try:
        from clm_data import write_data
    finally:
        sys.path.pop(0)
    return write_data(tmp_path_factory.mktemp("clm_data"))


def _launch(out: Path, command: list[str]) -> Path:
    """Launch, and keep what the user's terminal showed (stdout, then stderr) in `out`'s parent as console.txt."""
    proc = accelerate_launch(YAML, command)
    check_launch(proc)
    (out.parent / "console.txt").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def full(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("clm_full") / "run"
    return _launch(out, _command(data, out))


@pytest.fixture(scope="module")
def resumed(data, full, tmp_path_factory):
    """Also the console's negative twin: the stack's warnings and the replicas' transformers logs let through (the
    two settings change what is printed, not what is trained)."""
    out = tmp_path_factory.mktemp("clm_resumed") / "run"
    resume = ["--resume_from_checkpoint", str(full / f"checkpoint-{RESUME_AT}")]
    return _launch(
        out, _command(data, out, *resume, "--filter_stack_warnings", "False", "--log_level_replica", "warning")
    )


def _history(out: Path) -> dict[int, dict]:
    """Per optimizer step, the training log of trainer_state.json (logging_steps 1: one per step)."""
    state = json.loads((out / "trainer_state.json").read_text())
    return {h["step"]: h for h in state["log_history"] if "loss" in h}


# A warning line as each source prints it: Python's warnings (path:line: FutureWarning: ..., also after a progress
# bar's carriage return), the logging of DeepSpeed and the script (... - WARNING - ..., [WARNING]), transformers'
# handler ([transformers] ..., warnings and up at its default verbosity) and torch's launcher (glog: W1207
# 11:31:49.197000 <pid> path:line] ...).
WARNING_LINE = re.compile(r"(\S+:\d+: \w*Warning: .*)|(.*\bWARNING\b.*)|^(\[transformers\] .*)$|^W\d{4} \S+ \d+ (.*)$")
VOLATILE = re.compile(r"^\[?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]? ?|^\d\d/\d\d/\d{4} \d\d:\d\d:\d\d - ")


def _warnings(console: str) -> Counter:
    """Each warning line of `console`, its timestamps and pids left out, with the times it was printed. A glog
    banner of asterisks frames a warning and is not one."""
    said = Counter()
    for line in console.replace("\r", "\n").splitlines():
        match = WARNING_LINE.search(line)
        if match:
            text = VOLATILE.sub("", next(g for g in match.groups() if g is not None))
            if text.strip("* "):
                said[text] += 1
    return said


def test_a_users_script_prints_no_stack_warning_twice_and_each_recipe_line_once(full, resumed):
    """Issue 42: the user's script (run_clm's shape) on 2 CPU ranks printed 364 FutureWarning lines in 20 steps
    (torch's deprecation of collectives DeepSpeed calls) and each rank's transformers warnings. The recipe's
    arguments filter the first in every rank and leave the replicas' transformers logs at errors, so no warning is
    printed twice, and the recipe's own lines come once, from rank 0. The resumed launch turns both off
    (`--filter_stack_warnings False --log_level_replica warning`) and prints them again: what the check sees."""
    console = (full.parent / "console.txt").read_text(encoding="utf-8")
    said = _warnings(console)
    assert said, console[-3000:]  # the launcher's OMP_NUM_THREADS line at least: the reading sees warnings
    assert {text: n for text, n in said.items() if n > 1} == {}, console[-3000:]
    for line in ("the recipe's defaults in place of TrainingArguments'", "Per-rank logs (system, experts,"):
        assert console.count(line) == 1, line
    assert "log_level_replica 'warning' -> 'error'" in console
    twin = _warnings((resumed.parent / "console.txt").read_text(encoding="utf-8"))
    repeated = {text: n for text, n in twin.items() if n > 1}
    assert sum(n for text, n in repeated.items() if "FutureWarning: `torch.distributed." in text) >= STEPS - RESUME_AT
    assert any("The tokenizer has new PAD/BOS/EOS tokens" in text for text in repeated), repeated


def test_loss_falls(full):
    losses = [h["loss"] for _, h in sorted(_history(full).items())]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # ln(512) = 6.24 is the loss of a uniform guess over the vocabulary, where a fresh model starts.
    assert abs(losses[0] - math.log(512)) < 0.1
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.4


def test_resumed_run_repeats_the_uninterrupted_steps_exactly(full, resumed):
    a, b = _history(full), _history(resumed)
    after = range(RESUME_AT + 1, STEPS + 1)
    for step in after:  # bit for bit: same data order, RNG and optimizer state from the checkpoint
        assert (b[step]["loss"], b[step]["grad_norm"], b[step]["learning_rate"]) == (
            a[step]["loss"],
            a[step]["grad_norm"],
            a[step]["learning_rate"],
        ), step
    full_eval = json.loads((full / "eval_results.json").read_text())["eval_loss"]
    assert json.loads((resumed / "eval_results.json").read_text())["eval_loss"] == full_eval


def test_final_model_loads_in_a_plain_process_and_gives_the_jobs_eval_loss(full, data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(full).eval()
    tokenizer = AutoTokenizer.from_pretrained(full)  # save_model wrote the tokenizer next to the weights
    # The evaluation blocks rebuilt by hand: every line (with its line break, as load_dataset("text") keeps it)
    # tokenized alone, all concatenated and cut into BLOCK tokens; the validation file is one map batch (< 1,000
    # lines), so only the final remainder is dropped. The first EVAL_SAMPLES blocks (--max_eval_samples).
    lines = data["validation"].read_text(encoding="utf-8").splitlines(keepends=True)
    ids = list(chain.from_iterable(tokenizer(line)["input_ids"] for line in lines))
    blocks = torch.tensor([ids[i : i + BLOCK] for i in range(0, EVAL_SAMPLES * BLOCK, BLOCK)])
    with torch.no_grad():
        # Each block's mean token loss; the Trainer's eval_loss averages its batches weighted by their size, and
        # every block has BLOCK - 1 predicted tokens, so it is the mean over blocks.
        losses = [model(input_ids=b[None], labels=b[None]).loss.item() for b in blocks]
    job = json.loads((full / "eval_results.json").read_text())
    assert job["eval_samples"] == EVAL_SAMPLES
    assert sum(losses) / len(losses) == pytest.approx(job["eval_loss"], rel=1e-5)


def test_recipe_arguments_from_the_command_line_reach_every_rank(full):
    args = torch.load(full / "training_args.bin", weights_only=False)
    assert type(args).__name__ == "RecipeTrainingArguments"
    assert (args.seed_check, args.nonfinite_policy, args.min_lr_ratio) == ("warn", "halt", MIN_LR_RATIO)
    assert args.max_unpartitioned_model_bytes == 2 * 2**30  # GiB: binary
    assert args.save_shard_bytes == 200_000  # KB: decimal, as transformers' max_shard_size


def test_save_shard_size_bounds_every_weight_file(full):
    from safetensors import safe_open

    index = json.loads((full / "model.safetensors.index.json").read_text())["weight_map"]
    per_file: dict[str, int] = {}
    for name in set(index.values()):
        with safe_open(full / name, "pt") as f:
            per_file[name] = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # fp32
    assert all(nbytes <= 200_000 for nbytes in per_file.values())
    # 147,776 fp32 parameters by hand: embeddings and untied head 2 x 512 x 64; per layer q, k, v, o 4 x 64 x 64,
    # gate, up, down 3 x 64 x 128, two norms 2 x 64; the final norm 64.
    params = 2 * 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert sum(per_file.values()) == 4 * params == 591_104
    assert len(per_file) >= math.ceil(4 * params / 200_000)


def test_min_lr_ratio_floors_the_logged_schedule(full):
    """Warm-up of ceil(0.05 x 16) = 1 step, then 3 cosine cycles of 5 steps each from the peak to the floor
    0.1 x peak; the rate logged at step s is the one step s used (scheduler step s - 1)."""

    def hand(t: int) -> float:
        if t < 1:
            return PEAK_LR * t  # warm-up: 0 at the first step
        position = ((t - 1) / (STEPS - 1) * CYCLES) % 1.0
        return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * position)))

    logged = {step: h["learning_rate"] for step, h in _history(full).items()}
    assert logged == pytest.approx({s: hand(s - 1) for s in range(1, STEPS + 1)}, rel=1e-6)
    # Without the floor the lowest rate would be 0.095 x peak (cos(4 pi / 5)); with it, 0.1 + 0.9 x 0.095.
    assert min(logged[s] for s in logged if s > 1) == pytest.approx(PEAK_LR * 0.186, rel=1e-3)
