"""The plan a DeepSpeed JSON was generated for, written into the JSON itself, so the running job can honour it.

`config generate` adds a section `"hf_dist_recipes"` to the DeepSpeed JSON (DeepSpeed 0.19.8 and accelerate 1.16
ignore unknown top-level keys; `config validate` parses every generated file with DeepSpeed's own config class).
It records what the memory estimate assumed: the layout, micro batch, sequence length, precision and activation
checkpointing. `RecipeTrainingArguments` reads it from the launcher's config: a plan that assumed activation
checkpointing turns `activation_checkpointing` on unless the arguments say otherwise, and `RecipeTrainer` warns at
the start of training when the model does not recompute although the plan's memory figures assumed it.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from hf_dist_recipes.parallel.plan import ParallelPlan

logger = logging.getLogger(__name__)

PLAN_KEY = "hf_dist_recipes"
RECORDED = (
    "nodes",
    "procs_per_node",
    "zero_stage",
    "tp",
    "ep",
    "micro_batch",
    "grad_accum",
    "seq_len",
    "precision",
    "activation_checkpointing",
    "offload_optimizer",
    "offload_params",
)


def plan_record(plan: ParallelPlan, model_name: str | None) -> dict:
    """The section written into a generated DeepSpeed JSON."""
    return {
        "generated_for": {"model": model_name, **{k: getattr(plan, k) for k in RECORDED}},
        "note": "written by hf-dist-recipes config generate; read by RecipeTrainingArguments; DeepSpeed ignores it",
    }


def recorded_plan(config: dict | None) -> dict:
    """The recorded plan values of a DeepSpeed config dict ({} for configs written by anything else)."""
    section = (config or {}).get(PLAN_KEY)
    if not isinstance(section, dict) or not isinstance(section.get("generated_for"), dict):
        return {}
    return section["generated_for"]


def activation_checkpointing_warning(record: dict, model) -> str | None:
    """A warning when the plan assumed activation checkpointing and `model` does not recompute (None otherwise).
    `model`: the module about to be trained (transformers' `is_activation_checkpointing` property)."""
    if not record.get("activation_checkpointing"):
        return None
    if getattr(model, "is_activation_checkpointing", False):
        return None
    return (
        f"the launch config was generated for a plan with activation checkpointing (its memory estimate assumes "
        f"recomputation: seq_len {record.get('seq_len')}, micro batch {record.get('micro_batch')}), but "
        f"{type(model).__name__} stores every activation: expect far more GPU memory than estimated, or an "
        "out-of-memory error. Leave activation_checkpointing unset (the plan's value) or set it to True; or "
        "regenerate the config without --activation-checkpointing"
    )


class PlanConformanceCallback(TrainerCallback):
    """Warns once, at the start of training, when the model about to be trained breaks an assumption of the plan
    recorded in the launch config (today: activation checkpointing). The warning goes to the log and to
    `self.warnings` (for tests and reports)."""

    def __init__(self, record: dict):
        self.record = record
        self.warnings: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        message = activation_checkpointing_warning(self.record, model)
        if message and message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)
