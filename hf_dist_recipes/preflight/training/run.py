"""One preflight run inside the launch: `RecipeTrainingArguments` from the recipe's defaults, the preflight's short-run
values and the launch's DeepSpeed JSON, the model built whole on this rank, `PreflightTrainer`, and this rank's
`RunFacts` (or the error it raised). Model, data and values: the package docstring."""

from __future__ import annotations

import contextlib
import gc
import logging
from numbers import Number
from pathlib import Path

from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView
from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.preflight.training.facts import AgreementMismatch, ExpectedSettings, NonFiniteSkip, RunFacts

logger = logging.getLogger(__name__)

SEQ_LEN = 32  # tokens (bytes) per sample
MICRO_BATCH = 4
LEARNING_RATE = 3e-3


def run_once(
    model_config,
    output_dir: Path,
    *,
    steps: int,
    seed: int | None,
    tp: int | None = None,
    logging_dir: Path | None = None,
    save_at: int | None = None,
    nan_step: int | None = None,
    digests: bool = False,
    resume: Path | None = None,
    stop_after: int | None = None,
    timeouts: dict | None = None,
) -> RunFacts:
    """One RecipeTrainer run of `steps` steps writing to `output_dir`; this rank's facts, or `RunFacts.failed`
    when it raised (the traceback goes to the log). `tp`: the launch's TP degree (None: the DeepSpeed JSON the
    launcher handed this rank says it); `save_at`: a checkpoint at that step; `nan_step`: the last rank's loss made
    NaN at that step; `digests`: the weights' digest at every step; `resume`: a checkpoint to resume from;
    `stop_after`: the last step; `timeouts`: `peer_timeout` / `step_timeout` for the arguments."""
    from hf_dist_recipes.arguments import RecipeTrainingArguments
    from hf_dist_recipes.preflight.training.trainer import NanLoss, PreflightTrainer, StepRecorder

    trainer = None
    try:
        ds = compat_accelerate.launcher_deepspeed_config() or {}
        args = RecipeTrainingArguments(**argument_values(ds, output_dir, steps, seed, logging_dir), **(timeouts or {}))
        with args.main_process_first(desc="preflight data"):
            data = dataset(model_config.vocab_size, steps, args)
        model = build_model(model_config)
        nan = None if nan_step is None else NanLoss(model, args.world_size - 1, nan_step)
        # Given to the constructor, the recorder runs before the callbacks RecipeTrainer adds: without DeepSpeed it
        # sees a skipped step still marked skipped (the gradient-health callback clears the mark at step end).
        record = StepRecorder(digests, save_at, stop_after)
        trainer = PreflightTrainer(model=model, args=args, train_dataset=data, callbacks=[record])
        record.trainer = trainer
        if nan is not None:
            nan.trainer = trainer
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        history = trainer.state.log_history
        health = trainer.gradient_health
        # Event texts stay out of log_history; the rank summary callback keeps those this rank's logs carried.
        summary = trainer.recipe_callbacks.summary
        return RunFacts(
            rank=args.process_index,
            world_size=args.world_size,
            steps=record.steps,
            loss={e["step"]: e["loss"] for e in history if "loss" in e},
            grad_norm={e["step"]: e["grad_norm"] for e in history if "grad_norm" in e},
            batches=trainer.batches,
            events={e["step"]: e["text"] for e in summary.events if e["key"] == "nonfinite_event"},
            skipped_steps=health.skipped_steps,
            skips=[NonFiniteSkip(r.step, tuple(r.ranks), tuple(r.loss_ranks)) for r in health.reports],
            mismatches=[
                AgreementMismatch(step, m.what, tuple(m.ranks), m.message(step), m.fix)
                for step, m in trainer.rank_agreement.mismatches
            ],
            rank_check=dict(trainer.rank_agreement.begin_report),
            expected=expected_settings(trainer, ds, tp),
        )
    except Exception as err:  # noqa: BLE001 - a run that fails is the finding; the next run still goes
        logger.exception("preflight run in %s failed", output_dir)  # the traceback, for the launch log
        return RunFacts.failed(f"{type(err).__name__}: {err}")
    finally:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.accelerator.free_memory()
        del trainer
        gc.collect()


def argument_values(ds: dict, output_dir: Path, steps: int, seed: int | None, logging_dir: Path | None) -> dict:
    """The arguments of a preflight run: the recipe's defaults, the preflight's short-run values, and the DeepSpeed
    JSON's numbers where it fixes them (transformers refuses arguments that contradict them)."""
    values = dict(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=MICRO_BATCH,
        learning_rate=LEARNING_RATE,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed_check="warn",
        rank_check_steps=1,
    )
    if seed is not None:
        values["seed"] = seed
    if logging_dir is not None:
        values["logging_dir"] = str(logging_dir)
    view, clip = DeepSpeedView.read(ds), ds.get("gradient_clipping")
    lr = ((ds.get("optimizer") or {}).get("params") or {}).get("lr")
    # A generated JSON says "auto" (the Trainer's value) and records the micro batch its plan was sized for: train at
    # that one, so the preflight neither exceeds the plan (the recipe's start-up warning would then be ours) nor
    # tests a smaller batch than the job's.
    planned = recorded_plan(ds).get("micro_batch")
    if view.micro_batch is not None:
        values["per_device_train_batch_size"] = view.micro_batch
    elif _number(planned) and planned >= 1:
        values["per_device_train_batch_size"] = int(planned)
    if view.grad_accum is not None:
        values["gradient_accumulation_steps"] = view.grad_accum
    if _number(clip):
        values["max_grad_norm"] = float(clip)
        values["allow_unclipped_gradients"] = float(clip) == 0  # reported as an error by the clipping row
    if _number(lr):
        values["learning_rate"] = float(lr)
    return values


def _number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def dataset(vocab_size: int, steps: int, args):
    """The demo's byte blocks, enough for `steps` steps of every data-parallel rank, folded into the vocabulary."""
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    blocks = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    return token_blocks(stdlib_dataset(seq_len=SEQ_LEN, max_bytes=max(200_000, 2 * SEQ_LEN * blocks)), vocab_size)


def build_model(config):
    """The model built whole on this rank from the seeded RNG (not under `zero.Init`: the package docstring)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"transformers has no causal LM for model_type {config.model_type!r}; give --model a "
            "config of a causal LM family (e.g. a template: tiny-llama, tiny-deepseek-v3)"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def count_params(config) -> int:
    """Parameters of `config`'s causal LM, built on PyTorch's meta device (no memory; what `planning.models.introspect`
    counts, without a rank importing the planner); 0 for a config `build_model` refuses: the run will tell."""
    import torch

    try:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(config).parameters())
    except Exception:  # noqa: BLE001 - no causal LM for this config: built anyway, the run will tell
        return 0


def expected_settings(trainer, ds: dict, tp: int | None) -> ExpectedSettings:
    """What the engine should use, from the arguments and the JSON (not from the engine); `tp` as in `run_once`."""
    args = trainer.args
    kwargs = dict(args.lr_scheduler_kwargs or {})
    return ExpectedSettings(
        clip=float(args.max_grad_norm),
        peak_lr=float(args.learning_rate),
        scheduler_type=getattr(args.lr_scheduler_type, "value", str(args.lr_scheduler_type)),
        warmup_steps=args.get_warmup_steps(args.max_steps),
        total_steps=args.max_steps,
        num_cycles=kwargs.get("num_cycles"),
        min_lr_ratio=args.min_lr_ratio,
        restart_warmup_steps=args.restart_warmup_steps,
        ds_scheduler="scheduler" in ds,
        tp=DeepSpeedView.read(ds).tp if tp is None else tp,
        deepspeed=trainer.is_deepspeed_enabled,
    )
