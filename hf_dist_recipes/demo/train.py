"""Training script of the demo, run on every rank by `accelerate launch` (see `hf_dist_recipes.demo.launch`).

    accelerate launch --config_file accelerate_configs/demo_cpu_zero3.yaml -m hf_dist_recipes.demo.train \
        --output-dir runs/demo

Builds the tiny DeepSeek-V3-style model from a config (random init, no download), trains it byte-level on the
standard library's source with RecipeTrainer, and saves the final model to `<output-dir>/final`. Each rank writes
TensorBoard logs to `<output-dir>/tensorboard/rank<N>` and a summary to `<output-dir>/rank_summaries/rank<N>.json`.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.trainer import RecipeTrainer


@dataclass(frozen=True)
class DemoSettings:
    """Demo hyper-parameters; the defaults train 200 steps in about a minute on 2 CPU cores."""

    output_dir: str = "runs/demo"
    max_steps: int = 200
    seq_len: int = 128
    micro_batch: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    logging_steps: int = 20
    max_bytes: int = 2_000_000
    seed: int = 42
    backend: str | None = None
    allow_gloo_on_cuda: bool = False
    save_final: bool = True


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by this script and `hf-dist-recipes demo`."""
    d = DemoSettings()
    parser.add_argument("--output-dir", default=d.output_dir, help="where logs, summaries and the model go (%(default)s)")
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per sample (%(default)s)")
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch, help="samples per rank per step (%(default)s)")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate, help="peak learning rate (%(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps (%(default)s)")
    parser.add_argument("--logging-steps", type=int, default=d.logging_steps, help="log every N steps (%(default)s)")
    parser.add_argument("--max-bytes", type=int, default=d.max_bytes, help="bytes of stdlib source to use (%(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for every rank (%(default)s)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="force a backend (default: by host)")
    parser.add_argument("--allow-gloo-on-cuda", action="store_true", help="accept Gloo on a CUDA host")
    parser.add_argument("--no-save", dest="save_final", action="store_false", help="skip saving the final model")


def settings_from(ns: argparse.Namespace) -> DemoSettings:
    return DemoSettings(**{k: getattr(ns, k) for k in DemoSettings.__dataclass_fields__})


def training_arguments(s: DemoSettings) -> RecipeTrainingArguments:
    return RecipeTrainingArguments(
        output_dir=s.output_dir,
        max_steps=s.max_steps,
        per_device_train_batch_size=s.micro_batch,
        learning_rate=s.learning_rate,
        warmup_steps=s.warmup_steps,
        logging_steps=s.logging_steps,
        seed=s.seed,
        ddp_backend=s.backend,
        allow_gloo_on_cuda=s.allow_gloo_on_cuda,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=False,
    )


def run(s: DemoSettings) -> RecipeTrainer:
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(),
        args=training_arguments(s),
        train_dataset=stdlib_dataset(seq_len=s.seq_len, max_bytes=s.max_bytes),
    )
    trainer.train()
    if s.save_final:
        trainer.save_model(os.path.join(s.output_dir, "final"))
    return trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_flags(parser)
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, one warning per call and step: noise, not news.
    warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed", category=FutureWarning)
    run(settings_from(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
