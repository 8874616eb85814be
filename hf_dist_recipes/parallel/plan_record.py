"""The plan a DeepSpeed JSON was generated for, written into the JSON itself, so the running job can honour it.

`config generate` adds a section `"hf_dist_recipes"` to the DeepSpeed JSON (DeepSpeed 0.19.8 and accelerate 1.16
ignore unknown top-level keys; `config validate` parses every generated file with DeepSpeed's own config class):
`planning.deepspeed_config.plan_record` writes it, with the keys of `RECORDED` under `PLAN_KEY`; this module is the
rank's side, reading it back and holding the model to it.
It records what the memory estimate assumed: the layout (with `sp`, the sequence-parallel degree, when above 1:
`recorded_sp`), micro batch, sequence length, precision, activation
checkpointing and, when the plan has them, the chunked loss's `loss_chunk_tokens` and the tiled MLPs'
`tiled_mlp_shards`. `RecipeTrainingArguments` reads it
from the launcher's config: a plan that assumed activation checkpointing turns `activation_checkpointing` on unless
the arguments say otherwise (a recorded `loss_chunk_tokens` turns on the chunked loss, `parallel.chunked_loss`), and
`RecipeTrainer` stops, naming the fix, when the model will not recompute although the plan's memory figures assumed
it: without recomputation the estimate no longer holds (DeepSeek-V3 on 8 nodes with EP 32 and optimizer offload:
about 223 GiB per GPU instead of 45 by the same estimate), so a warning was followed by an out-of-memory error once
the whole model had loaded. The argument `allow_no_recompute=True` turns the stop back into a warning; the message
gives both figures, which `config generate` recorded (`device_gib`, `device_gib_no_recompute`: a rank imports no
estimator), and goes without them for a record that has none.

The micro batch and gradient accumulation the estimate assumed are recorded too, while the JSON itself says
`"auto"` for both (the Trainer fills them from `per_device_train_batch_size` and `gradient_accumulation_steps`, so
the JSON and the script never disagree). A run whose micro batch exceeds the plan's keeps more activations than the
estimate counted: rank 0 warns once at start-up, naming both values and the fix (`micro_batch_problem`; a plan
generated without `--model` was sized for no model and assumed no micro batch). More accumulation than planned is
not reported: the estimate does not depend on it (ZeRO sums every micro step into the one fp32 gradient partition a
rank holds anyway), so it only lengthens the step, which is what the user asked for.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

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
# Recorded only when set, so that a file generated without it stays as it was (the shipped configs).
RECORDED_WHEN_SET = ("loss_chunk_tokens", "tiled_mlp_shards")
# Degrees recorded only above 1, for the same reason: `sp`, the Ulysses sequence-parallel degree (absent: 1).
RECORDED_ABOVE_ONE = ("sp",)


def recorded_plan(config: dict | None) -> dict:
    """The recorded plan values of a DeepSpeed config dict ({} for configs written by anything else)."""
    section = (config or {}).get(PLAN_KEY)
    if not isinstance(section, dict) or not isinstance(section.get("generated_for"), dict):
        return {}
    return section["generated_for"]


def recorded_sp(record: dict) -> int:
    """The sequence-parallel degree a recorded plan (`recorded_plan`) was generated for: its `sp`, 1 where the record
    has none (every plan without SP, and configs written before SP was planned)."""
    sp = record.get("sp", 1)
    return sp if isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1 else 1


def can_recompute(model) -> bool:
    """Whether `model` can turn recomputation on: transformers' class flag `supports_gradient_checkpointing` where the
    model has one (every `PreTrainedModel`; `activation_checkpointing_enable` raises without it), else whether it has
    one of the enable methods the Trainer calls (`activation_checkpointing_enable`, `gradient_checkpointing_enable`)."""
    supported = getattr(model, "supports_gradient_checkpointing", None)
    if supported is not None:
        return bool(supported)
    return hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")


def recomputes(model) -> bool:
    """Whether recomputation is on in `model` now (transformers' `is_activation_checkpointing`)."""
    return bool(getattr(model, "is_activation_checkpointing", False))


def activation_checkpointing_problem(record: dict, model, activation_checkpointing: bool | None = None) -> str | None:
    """Why `model` will not recompute although the plan recorded in the launch config assumed it, with the fix; None
    when the plan did not assume it or the model recomputes. `activation_checkpointing`: the arguments' value, for a
    check before training (the Trainer then turns recomputation on when it is True and the model can); None judges
    the model as it is (at the start of training, after the Trainer had its turn)."""
    if not record.get("activation_checkpointing") or recomputes(model):
        return None
    name = type(model).__name__
    if activation_checkpointing and can_recompute(model):
        return None
    if activation_checkpointing is False:
        why = f"activation_checkpointing=False, so {name} stores every activation"
        fix = (
            "leave activation_checkpointing unset (the plan's value) or set it to True, or regenerate the config "
            "without --activation-checkpointing"
        )
    elif not can_recompute(model):
        why = f"{name} cannot recompute activations (its class has no activation-checkpointing support)"
        fix = (
            "use a model class that supports it (transformers' supports_gradient_checkpointing), or regenerate the "
            "config without --activation-checkpointing so that its plan and memory estimate assume none"
        )
    else:
        why = f"recomputation is not on in {name} at the start of training"
        fix = "set activation_checkpointing=True, or call model.activation_checkpointing_enable() before training"
    planned, without = record.get("device_gib"), record.get("device_gib_no_recompute")
    cost = (
        f" (about {without:,.0f} GiB per GPU instead of {planned:,.0f} by the recipe's estimate)"
        if isinstance(planned, (int, float)) and isinstance(without, (int, float))
        else ""  # a record of an older config generate, or of a plan made without --model: no figures
    )
    return (
        f"the launch config was generated for a plan with activation checkpointing (seq_len {record.get('seq_len')}, "
        f"micro batch {record.get('micro_batch')}), but {why}: expect far more GPU memory than estimated{cost}, or "
        f"an out-of-memory error. Fix: {fix}; or pass allow_no_recompute=True to train without recomputation anyway"
    )


def micro_batch_problem(record: dict, micro_batch: int, grad_accum: int) -> str | None:
    """Why a run at `micro_batch` (the arguments' `per_device_train_batch_size`; `grad_accum` their
    `gradient_accumulation_steps`) needs more activation memory than the recorded plan's estimate counted, with the
    fix, in one line; None when `micro_batch` is within the plan's, or the record names no model: a plan generated
    without `--model` was sized for none (its micro batch is the flag's default, no assumption; the shipped configs
    the demo launches at micro batch 8 are such). Without the estimate's figures: rank 0 alone says it, and
    `introspect` under ZeRO-3 builds the model in `zero.Init`, whose collectives would wait for the other ranks."""
    planned = record.get("micro_batch")
    if not record.get("model") or not isinstance(planned, int) or isinstance(planned, bool):
        return None
    if micro_batch <= planned:
        return None
    return (
        f"per_device_train_batch_size {micro_batch} exceeds the micro batch {planned} the launch config's plan assumed "
        f"(x accumulation {record.get('grad_accum', '?')}): activations take more memory than its estimate "
        f"counted, an out-of-memory error is possible. Fix: regenerate it with config generate "
        f"--micro-batch {micro_batch} --grad-accum {grad_accum} and the other flags of its YAML header's command "
        f"(the fit is checked again), or set "
        f"per_device_train_batch_size <= {planned} and raise gradient_accumulation_steps for the same global batch"
    )


def sequence_parallel_problem(record: dict, running_sp: int) -> str | None:
    """Why a job running Ulysses SP `running_sp` (accelerate's `ParallelismConfig`, from the YAML's
    `parallelism_config` block) breaks the recorded plan's SP (`recorded_sp`), in one line with the fix; None when
    they agree or the config records no plan. Fewer SP ranks than planned leave each rank more tokens than the memory
    estimate counted (an out-of-memory error); more change the global batch the plan was sized for."""
    if not record:
        return None
    planned = recorded_sp(record)
    if planned == running_sp:
        return None
    seq = record.get("seq_len")
    share = f" ({seq // planned} tokens per rank)" if isinstance(seq, int) and seq % planned == 0 else ""
    return (
        f"the launch config's DeepSpeed JSON was generated for sequence parallelism {planned}{share}, but this job "
        f"runs SP {running_sp}: launch with the accelerate YAML config generate wrote beside the JSON (its "
        f"parallelism_config block sets SP in every rank), or regenerate the files with --sp {running_sp}"
    )


class PlanConformanceCallback(TrainerCallback):
    """Stops (ValueError) or, with `allow=True` (`allow_no_recompute`), warns when the model about to be trained breaks
    an assumption of the plan recorded in the launch config (activation checkpointing); warns on rank 0 when the
    arguments' micro batch exceeds the plan's (`check_batch`, in `batch_warning`, not in `warnings`). `RecipeTrainer`
    calls `check_before_training` in its constructor, before any engine is built; `on_train_begin` checks the model
    again after the Trainer had its turn (a model built by `model_init`, a wrapper that ignored the request). Warnings
    go to the log and to `self.warnings` (for tests and reports)."""

    def __init__(self, record: dict, allow: bool = False):
        self.record = record
        self.allow = allow
        self.warnings: list[str] = []
        # Rank 0's start-up warning that the micro batch exceeds the plan's (`micro_batch_problem`); None otherwise.
        self.batch_warning: str | None = None

    def _report(self, message: str | None) -> None:
        if message is None:
            return
        if not self.allow:
            raise ValueError(message)
        if not self.warnings:  # once: the constructor's and the start of training's say the same
            self.warnings.append(message)
            logger.warning(message)

    def check_before_training(self, model, args) -> None:
        """Judge `model` with the arguments' `activation_checkpointing`. Allowed, a model that cannot recompute has
        the plan's `activation_checkpointing` (not one the user set) turned off, so that the Trainer trains it
        without recomputation instead of stopping in `activation_checkpointing_enable`."""
        self.check_batch(args)
        message = activation_checkpointing_problem(self.record, model, bool(args.activation_checkpointing))
        self._report(message)
        if message and getattr(args, "activation_checkpointing_from_plan", False) and not can_recompute(model):
            args.activation_checkpointing = args.gradient_checkpointing = False

    def check_batch(self, args) -> None:
        """Rank 0 warns once, at start-up, when the arguments' micro batch exceeds the plan's (`micro_batch_problem`);
        a warning, not a stop: the estimate has headroom, and the user may know the memory is there."""
        micro = getattr(args, "per_device_train_batch_size", None)
        if self.batch_warning is not None or getattr(args, "process_index", 0) != 0 or not isinstance(micro, int):
            return
        self.batch_warning = micro_batch_problem(self.record, micro, getattr(args, "gradient_accumulation_steps", 1))
        if self.batch_warning:
            logger.warning(self.batch_warning)

    def check_sequence_parallel(self, running_sp: int) -> None:
        """Stop (ValueError) when the job runs fewer SP ranks than the plan's memory estimate divided the sequence
        over; rank 0 warns when it runs more (`sequence_parallel_problem`)."""
        message = sequence_parallel_problem(self.record, running_sp)
        if message is None:
            return
        if running_sp < recorded_sp(self.record):
            raise ValueError(message)
        if message not in self.warnings:
            self.warnings.append(message)
            logger.warning(message)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._report(activation_checkpointing_problem(self.record, model))
