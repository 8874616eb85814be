"""Training script of the demo, run on every rank by `accelerate launch` (see `hf_dist_recipes.demo.launch`).

    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml -m hf_dist_recipes.demo.train \
        --output-dir runs/demo

Builds the tiny DeepSeek-V3-style model from a config (random init, no download), trains it byte-level on the
standard library's source (or on `--data-files`) with RecipeTrainer, and saves the final model to `<output-dir>/final`.
Each rank writes TensorBoard logs to `<output-dir>/tensorboard/rank<N>` and a summary to
`<output-dir>/rank_summaries/rank<N>.json`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.comm import backend
from hf_dist_recipes.demo.data import (
    describe_blocks,
    files_up_to,
    quiet_datasets,
    stdlib_dataset,
    stdlib_source_files,
    text_files_dataset,
)
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.demo.settings import DemoSettings, add_training_flags, settings_from
from hf_dist_recipes.trainer import RecipeTrainer


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
        # The GPU config leaves precision to the Trainer ("auto"): bf16 where the GPUs have it (not V100/T4).
        bf16=backend.cuda_device_count() > 0 and torch.cuda.is_bf16_supported(),
        dataloader_drop_last=True,
        disable_tqdm=False,
    )


def train_dataset(s: DemoSettings):
    """The byte blocks to train on: `s.data_files` when given, else the standard library's source."""
    if s.data_files:
        return text_files_dataset(s.data_files, seq_len=s.seq_len, text_field=s.text_field)
    return stdlib_dataset(seq_len=s.seq_len, max_bytes=s.max_bytes)


def data_source(s: DemoSettings) -> tuple[list, str]:
    """(the files the blocks come from, whose they are), for the console's data line."""
    if s.data_files:
        return list(s.data_files), "yours"
    files = files_up_to(stdlib_source_files(), s.max_bytes)
    return files, f"the standard library, {files[0].parent}"


def run(s: DemoSettings) -> RecipeTrainer:
    args = training_arguments(s)
    # The local main process builds (or finds) the cached blocks first; the other ranks then load its cache files
    # instead of packing the same data at the same time. The console gets one line about it, from rank 0.
    started = time.time()
    with args.main_process_first(desc="byte blocks"), quiet_datasets():
        data = train_dataset(s)
    if args.process_index == 0:
        print(describe_blocks(data, s.seq_len, *data_source(s), started), flush=True)
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, train_dataset=data)
    trainer.train()
    if s.save_final:
        trainer.save_model(os.path.join(s.output_dir, "final"))
    return trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_flags(parser)
    # The launch plan passes every setting; run by hand, --max-bytes follows this launch's world size.
    run(settings_from(parser.parse_args(argv), processes=int(os.environ.get("WORLD_SIZE", "1"))))


if __name__ == "__main__":
    main()
