"""Run on every rank by tests/distributed/test_env_fingerprint.py under `accelerate launch` (2 CPU ranks, ZeRO-3).

    env_fingerprint_worker.py OUTPUT_DIR STEPS [--odd-rank R]

`--odd-rank R`: before anything else, rank R puts a folder holding `datasets-9.9.9.dist-info/METADATA` first on
sys.path, so importlib.metadata (what pip and the fingerprint read) reports datasets 9.9.9 on that rank only -- a
node with another datasets installed, without touching the real package. Then RecipeTrainer on a tiny model for
STEPS steps; a callback writes OUTPUT_DIR/steps/rank<N>-step<K> at the end of each step, so the test sees whether
any step ran. Writes OUTPUT_DIR/fingerprint/rank<N>.json after training.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def _fake_datasets_version(version: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="fake-dist-"))
    info = root / f"datasets-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: datasets\nVersion: {version}\n")
    sys.path.insert(0, str(root))


if "--odd-rank" in sys.argv and os.environ.get("RANK") == sys.argv[sys.argv.index("--odd-rank") + 1]:
    _fake_datasets_version("9.9.9")

import argparse  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments  # noqa: E402
from hf_dist_recipes.demo.data import TokenBlocks  # noqa: E402
from hf_dist_recipes.demo.model import tiny_deepseek_config  # noqa: E402
from hf_dist_recipes.environment.fingerprint import environment_fingerprint  # noqa: E402


class StepMarks(TrainerCallback):
    def __init__(self, folder: Path):
        self.folder = folder

    def on_step_end(self, args, state, control, **kwargs):
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{args.process_index}-step{state.global_step}").write_text("")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--odd-rank", type=int, default=None)
    opts = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    config = tiny_deepseek_config(hidden_size=32, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config)
    data = TokenBlocks(torch.randint(0, config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(0)))
    out = Path(opts.output_dir)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=data, callbacks=[StepMarks(out / "steps")])
    trainer.train()
    target = out / "fingerprint"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(
        json.dumps({"fingerprint": environment_fingerprint(), "steps": trainer.state.global_step})
    )


if __name__ == "__main__":
    main()
