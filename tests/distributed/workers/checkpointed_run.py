"""What the checkpointing workers (lifecycle, relayout, survival) train with, in one place: the same arguments, so
that a loss compared between two of their launches differs only by what the test varies (the layout, a resume, a
signal), and a change to the set-up reaches all three."""

from __future__ import annotations

from hf_dist_recipes import RecipeTrainingArguments

MICRO_BATCH = 4


def checkpointed_run_args(output_dir: str, steps: int, save_steps: int, **extra) -> RecipeTrainingArguments:
    """`steps` optimizer steps at micro batch MICRO_BATCH, learning rate 3e-3 after 2 warm-up steps, every step
    logged, a checkpoint every `save_steps`; `extra`: the worker's own arguments (they may override these)."""
    values = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=MICRO_BATCH,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    return RecipeTrainingArguments(**{**values, **extra})
