"""Preflight checks 5 ("training") and 6 ("failure_paths"): short real training runs under the user's launch.

Runs inside `accelerate launch` on every rank, so the runs get the launch's DeepSpeed config (ZeRO stage, AutoTP
and AutoEP degrees, precision) exactly as the user's job will: the arguments are `RecipeTrainingArguments`, the
trainer `RecipeTrainer`, nothing is re-implemented here. `run_training_checks` is the one entry point; every rank
returns the same list of `CheckResult`s (each rank's measurements are gathered and every rank decides from the
same data), one row per finding.

The model: `model_config` built whole on every rank by its class (not under `zero.Init`), so that what each rank
built is compared across ranks by the rank-agreement check (under `zero.Init` rank 0's init is broadcast and there
is nothing to compare); the engine then partitions and slices it as the plan says. The data: the demo's
(`hf_dist_recipes.demo.data.stdlib_dataset`), the standard library's Python source as byte blocks of SEQ_LEN, which
a small model learns within a few steps. Peak learning rate LEARNING_RATE (3e-3; what the tiny models of the tests
train at), micro batch MICRO_BATCH (4): both unless the DeepSpeed JSON fixes them; the schedule, clipping and
every other setting are the recipe's defaults or the JSON's values.

Check 5, "training": one run of `steps` optimizer steps (default 20, at least MIN_STEPS), logging every step into
`<output_dir>/tensorboard` (per rank; check 7 reads it) and saving a checkpoint at step `steps // 2`. Rows:
- loss: the mean logged loss of the last quarter of the steps is below the mean of the first quarter (byte-level
  Python source: a model that trains at all lowers it within 20 steps; measured on 2 CPU ranks, tiny DeepSeek-V3:
  4.58 -> 3.37, from ln 128 = 4.85 at the first step). Every logged loss must be finite.
- clipping: the clip value the live engine applies (`engine.gradient_clipping()`, and under ZeRO the value its
  optimizer holds, `clip_grad`) is > 0 and is the configured one: the JSON's `gradient_clipping` when a number,
  else `max_grad_norm` (1.0). Without DeepSpeed the Trainer clips at `max_grad_norm`. The pre-clip norms above
  the clip value are counted (the clip engaged), as information.
- schedule: the learning rate each step applied (read from the optimizer before the step) against the recipe's
  curve computed here independently (`hf_dist_recipes.schedules.warmup_cosine.WarmupCosineRestarts` from the arguments'
  warm-up, cycles, floor and re-warm-up), relative tolerance 1e-6; a skipped step does not advance the curve. A
  DeepSpeed `scheduler` section replaces the recipe's schedule and is named in the fix.
- agreement: the rank-agreement check's findings (`RecipeTrainer.rank_agreement`, run with `seed_check="warn"` and
  a check every step, so a disagreement is reported, naming the rank and the step, instead of stopping the run):
  seeds, data sampler seed and first-step sample order, the weights each rank built, and at every step the global
  step and learning rate (all ranks) and, inside a TP group, the loss, batch and dropout stream.

Check 6, "failure_paths", one run resuming the training run from its checkpoint at step k = `steps // 2`:
- resume: the resumed run's first step, k + 1, must have the uninterrupted run's loss, learning rate and batch. The
  loss is compared within RESUME_LOSS_RTOL (relative 1e-4): it is a forward pass over the restored weights on the
  restored batch, so it is the same computation (measured: 0 difference on CPU, as in
  tests/distributed/test_checkpoint_lifecycle.py); the margin covers GPU kernels that reduce in another order, and
  is far below what a wrong state moves (one optimizer step changes the loss by about 1e-2 relative here).
- nan: at step k + 2 of the same run, the last rank's loss is made NaN (a forward hook on the model: the loss the
  model returns, as a real overflow would). Every rank must have skipped exactly that step (engine
  `was_step_applied()` False there only; the full weights, gathered under ZeRO, bit-identical across it and changed
  by step k + 3), counted one skip (`trainer.gradient_health`), and logged a `nonfinite_event` naming the step and
  the rank whose loss it was. Under TP the NaN also reaches that rank's TP partners' gradients (TP's backward
  all-reduces activation gradients in the group): they may be flagged too, no rank outside the group.
When the training run failed, both rows are errors ("not run").

Output folders under `output_dir`: `training/` (the main run and its checkpoint), `tensorboard/` (its per-rank
TensorBoard runs), `failure_paths/` (the resumed run, its own logs). Any of them already holding files (an earlier
preflight, or a real job's output) stops the checks before they run, with a ValueError on every rank: nothing is
deleted.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import os
import warnings
from collections.abc import Callable
from numbers import Number
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_dist_recipes import _compat
from hf_dist_recipes.parallel.batch import tensor_parallel_size
from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult

logger = logging.getLogger(__name__)

TRAINING, FAILURE_PATHS = "training", "failure_paths"
DEFAULT_STEPS = 20
MIN_STEPS = 8  # quarters of at least 2 steps, and a checkpoint in the middle
SEQ_LEN = 32  # tokens (bytes) per sample
MICRO_BATCH = 4
LEARNING_RATE = 3e-3
SCHEDULE_RTOL = 1e-6
RESUME_LOSS_RTOL = 1e-4
MAX_PARAMS = 50_000_000  # the runs build the model whole on every rank, on whatever device: tiny models only

Progress = Callable[[str], None]


def run_training_checks(
    model_config,
    *,
    steps: int = DEFAULT_STEPS,
    output_dir: str | os.PathLike,
    seed: int | None = None,
    on_progress: Progress | None = None,
    peer_timeout: float | None = None,
    step_timeout: float | None = None,
) -> list[CheckResult]:
    """Checks 5 and 6 on every rank of the running launch; the same list of results on every rank.

    `model_config`: a transformers config of a small causal LM (the preflight's tiny model of the user's family);
    `steps`: optimizer steps of the training run (default 20, at least MIN_STEPS); `output_dir`: where the runs
    write (see the module docstring); `seed`: this rank's seed (default: RecipeTrainingArguments' 42); a rank given
    another seed than the others is reported, not stopped. `on_progress`: called on every rank with one line per
    stage. A run that raises on every rank alike (a config the engine refuses) becomes an error row naming it.
    `peer_timeout`, `step_timeout` (seconds): the runs' hang bounds (`RecipeTrainingArguments` fields of the same
    names; default theirs, 120 s and 600 s): a rank that dies or hangs during a run ends every rank within them.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < MIN_STEPS:
        raise ValueError(f"steps must be a whole number >= {MIN_STEPS}, got {steps!r}; e.g. --steps {DEFAULT_STEPS}")
    params = _count_params(model_config)
    if params > MAX_PARAMS:
        raise ValueError(
            f"the training checks build the model whole on every rank; {params:,} parameters is more "
            f"than {MAX_PARAMS:,}: give a tiny config of the same family (the preflight's default)"
        )
    say = on_progress or (lambda line: None)
    root = Path(output_dir)
    _check_unused(root)
    save_at = steps // 2
    timeouts = {k: v for k, v in (("peer_timeout", peer_timeout), ("step_timeout", step_timeout)) if v is not None}
    warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed", category=FutureWarning)

    say(f"training: {steps} steps with the launch's plan")
    main = _gather(
        _run(
            model_config,
            root / "training",
            steps=steps,
            seed=seed,
            logging_dir=root / "tensorboard",
            save_at=save_at,
            timeouts=timeouts,
        )
    )
    results = training_results(main, steps)
    nan_step = save_at + 2
    say(f"failure paths: resume from the checkpoint at step {save_at}, then a NaN on the last rank at step {nan_step}")
    if any(r.get("error") for r in main):  # decided from gathered data: every rank skips it alike
        resumed = [{"error": "not run: the training run, which writes the checkpoint, failed"}] * len(main)
    else:
        # One run for both failure paths: the resumed run's step save_at + 1 is compared with the uninterrupted
        # run's, then its step save_at + 2 gets the NaN (one engine build fewer: about 6 s on 2 CPU ranks).
        resumed = _gather(
            _run(
                model_config,
                root / "failure_paths",
                steps=steps,
                seed=seed,
                resume=root / "training" / f"checkpoint-{save_at}",
                nan_step=nan_step,
                stop_after=nan_step + 1,
                digests=True,
                timeouts=timeouts,
            )
        )
    results.append(resume_result(main, resumed, save_at))
    results.append(nan_result(resumed, nan_step))
    return results


OUTPUT_FOLDERS = ("training", "tensorboard", "failure_paths")


def _check_unused(root: Path) -> None:
    """ValueError on every rank when any rank finds the runs' folders already written (a run would refuse to mix
    its TensorBoard curves into an earlier launch's, or resume from another run's checkpoint). Decided from
    gathered data: on nodes with their own disks the ranks may see different files."""
    found = sorted(
        str(root / name) for name in OUTPUT_FOLDERS if (root / name).is_dir() and any((root / name).iterdir())
    )
    everywhere = sorted({path for paths in _gather(found) for path in paths})
    if everywhere:
        raise ValueError(
            f"{', '.join(everywhere)} already written by an earlier run; give the preflight a new "
            "--output-dir (it never deletes anything)"
        )


# ---------------------------------------------------------------------------------------------------------------
# The runs


class _Record(TrainerCallback):
    """Per optimizer step, from the live objects: the learning rate the step applies, whether the engine applied
    it, the clip values, and (with `digests`) a SHA-256 of the full weights. Also stops / saves on request."""

    def __init__(self, digests: bool, save_at: int | None, stop_after: int | None):
        self.trainer = None  # set once the trainer exists
        self.digests, self.save_at, self.stop_after = digests, save_at, stop_after
        self.steps: dict[int, dict] = {}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.steps[state.global_step + 1] = {"lr": float(optimizer.param_groups[0]["lr"])}

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kwargs):
        step = self.steps.setdefault(state.global_step, {})
        engine = _engine(self.trainer)
        if engine is not None:
            step["applied"] = bool(engine.was_step_applied())
            step["clip"] = float(engine.gradient_clipping())
            inner = getattr(engine, "optimizer", None)
            clip = getattr(inner, "clip_grad", None)
            step["zero_clip"] = None if clip is None else float(clip)
        else:
            step["applied"] = not bool(getattr(optimizer, "step_was_skipped", False))
            step["clip"] = float(args.max_grad_norm)
        if self.digests:
            step["weights"] = _weights_digest(model)
        if state.global_step == self.save_at:
            control.should_save = True
        if state.global_step == self.stop_after:
            control.should_training_stop = True


class _NanLoss:
    """A forward hook making the model's own loss NaN on `rank` at optimizer step `step` (1-based), training only."""

    def __init__(self, model, rank: int, step: int):
        self.rank, self.step, self.trainer = rank, step, None
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        trainer = self.trainer
        if (
            trainer is not None
            and module.training
            and trainer.args.process_index == self.rank
            and trainer.state.global_step + 1 == self.step
            and getattr(output, "loss", None) is not None
        ):
            output.loss = output.loss * math.nan
        return output


def _run(
    model_config,
    output_dir: Path,
    *,
    steps: int,
    seed: int | None,
    logging_dir: Path | None = None,
    save_at: int | None = None,
    nan_step: int | None = None,
    digests: bool = False,
    resume: Path | None = None,
    stop_after: int | None = None,
    timeouts: dict | None = None,
) -> dict:
    """One RecipeTrainer run; this rank's measurements, or {"error": ...} when it raised."""
    from hf_dist_recipes.arguments import RecipeTrainingArguments
    from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback
    from hf_dist_recipes.trainer import RecipeTrainer

    trainer = None
    try:
        ds = _compat.launcher_deepspeed_config() or {}
        args = RecipeTrainingArguments(**_argument_values(ds, output_dir, steps, seed, logging_dir), **(timeouts or {}))
        with args.main_process_first(desc="preflight data"):
            data = _dataset(model_config.vocab_size, steps, args)
        batches: dict[int, str] = {}

        class PreflightTrainer(RecipeTrainer):
            def training_step(self, model, inputs, num_items_in_batch=None):
                ids = inputs["input_ids"].detach().cpu().numpy().tobytes()
                batches[self.state.global_step + 1] = hashlib.sha256(ids).hexdigest()[:16]
                return super().training_step(model, inputs, num_items_in_batch)

        model = _build_model(model_config)
        nan = None if nan_step is None else _NanLoss(model, args.world_size - 1, nan_step)
        # Given to the constructor, the recorder runs before the callbacks RecipeTrainer adds: without DeepSpeed it
        # sees a skipped step still marked skipped (the gradient-health callback clears the mark at step end).
        record = _Record(digests, save_at, stop_after)
        trainer = PreflightTrainer(model=model, args=args, train_dataset=data, callbacks=[record])
        record.trainer = trainer
        if nan is not None:
            nan.trainer = trainer
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        history = trainer.state.log_history
        health = trainer.gradient_health
        # Event texts stay out of log_history; the rank summary callback keeps those this rank's logs carried.
        summary = next(c for c in trainer.callback_handler.callbacks if isinstance(c, RankSummaryCallback))
        return {
            "rank": args.process_index,
            "world_size": args.world_size,
            "steps": record.steps,
            "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
            "grad_norm": {e["step"]: e["grad_norm"] for e in history if "grad_norm" in e},
            "events": {e["step"]: e["text"] for e in summary.events if e["key"] == "nonfinite_event"},
            "batches": batches,
            "skipped_steps": health.skipped_steps,
            "skipped_at": health.skipped_at,
            "mismatches": [
                (step, m.what, list(m.ranks), m.message(step), m.fix) for step, m in trainer.rank_agreement.mismatches
            ],
            "rank_check": dict(trainer.rank_agreement.begin_report),
            "expected": _expected_settings(trainer, ds),
        }
    except Exception as err:  # noqa: BLE001 - a run that fails is the finding; the next run still goes
        logger.exception("preflight run in %s failed", output_dir)  # the traceback, for the launch log
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.accelerator.free_memory()
        del trainer
        gc.collect()


def _argument_values(ds: dict, output_dir: Path, steps: int, seed: int | None, logging_dir: Path | None) -> dict:
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
    micro, accum, clip = (
        ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
    )
    lr = ((ds.get("optimizer") or {}).get("params") or {}).get("lr")
    if _number(micro):
        values["per_device_train_batch_size"] = int(micro)
    if _number(accum):
        values["gradient_accumulation_steps"] = int(accum)
    if _number(clip):
        values["max_grad_norm"] = float(clip)
        values["allow_unclipped_gradients"] = float(clip) == 0  # reported as an error by the clipping row
    if _number(lr):
        values["learning_rate"] = float(lr)
    return values


def _number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def _dataset(vocab_size: int, steps: int, args):
    """The demo's byte blocks, enough for `steps` steps of every data-parallel rank, folded into the vocabulary."""
    from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

    blocks = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    return token_blocks(stdlib_dataset(seq_len=SEQ_LEN, max_bytes=max(200_000, 2 * SEQ_LEN * blocks)), vocab_size)


def _build_model(config):
    """The model built whole on this rank from the seeded RNG (see the module docstring)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"transformers has no causal LM for model_type {config.model_type!r}; give --model a "
            "config of a causal LM family (e.g. a template: tiny-llama, tiny-deepseek-v3)"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def _count_params(config) -> int:
    from hf_dist_recipes.parallel.models import introspect

    try:
        return introspect(config).total_params
    except Exception:  # noqa: BLE001 - a family introspect does not know: built anyway, the run will tell
        return 0


def _engine(trainer):
    """The live DeepSpeed engine, or None without DeepSpeed."""
    wrapped = getattr(trainer, "model_wrapped", None)
    return wrapped if hasattr(wrapped, "gradient_clipping") and hasattr(wrapped, "was_step_applied") else None


def _weights_digest(model) -> str:
    """SHA-256 of this rank's full weights (ZeRO-3 partitions gathered; under TP/EP this rank's shard)."""
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    digest = hashlib.sha256()
    with gathered:
        for p in params:
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _expected_settings(trainer, ds: dict) -> dict:
    """What the engine should use, from the arguments and the JSON (not from the engine)."""
    args = trainer.args
    kwargs = dict(args.lr_scheduler_kwargs or {})
    return {
        "clip": float(args.max_grad_norm),
        "peak_lr": float(args.learning_rate),
        "scheduler_type": getattr(args.lr_scheduler_type, "value", str(args.lr_scheduler_type)),
        "warmup_steps": args.get_warmup_steps(args.max_steps),
        "total_steps": args.max_steps,
        "num_cycles": kwargs.get("num_cycles"),
        "min_lr_ratio": args.min_lr_ratio,
        "restart_warmup_steps": args.restart_warmup_steps,
        "ds_scheduler": "scheduler" in ds,
        "tp_size": tensor_parallel_size(ds),
        "deepspeed": trainer.is_deepspeed_enabled,
    }


def _gather(facts: dict) -> list[dict]:
    """Every rank's facts, in rank order (one all_gather_object; the list of one without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [facts]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, facts)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Decisions: pure functions of the gathered facts (one dict per rank, in rank order), the same on every rank


def _failed(name: str, what: str, ranks: list[dict], fix: str) -> CheckResult | None:
    bad = [i for i, r in enumerate(ranks) if r.get("error")]
    if not bad:
        return None
    first = ranks[bad[0]]["error"]
    return CheckResult(
        name,
        ERROR,
        f"{what}: the run failed on rank(s) {', '.join(map(str, bad))}: {first}",
        fix,
        tuple(bad),
        {"errors": {str(i): ranks[i]["error"] for i in bad}},
    )


def training_results(ranks: list[dict], steps: int) -> list[CheckResult]:
    failed = _failed(
        TRAINING,
        "training",
        ranks,
        "the real job would fail the same way under this launch config: "
        "fix what the error names (the launch log has the traceback)",
    )
    if failed:
        return [failed]
    return [loss_result(ranks[0], steps), clip_result(ranks), schedule_result(ranks), agreement_result(ranks)]


def quarter_means(losses: list[float]) -> tuple[float, float]:
    """(mean of the first quarter, mean of the last quarter) of `losses`, each quarter at least one value."""
    q = max(1, len(losses) // 4)
    return sum(losses[:q]) / q, sum(losses[-q:]) / q


def loss_result(rank0: dict, steps: int) -> CheckResult:
    losses = [rank0["loss"][s] for s in sorted(rank0["loss"])]
    data = {"losses": losses, "steps": steps}
    if len(losses) < 4 or not all(math.isfinite(x) for x in losses):
        bad = [s for s in sorted(rank0["loss"]) if not math.isfinite(rank0["loss"][s])]
        return CheckResult(
            TRAINING,
            ERROR,
            f"loss: {len(losses)} losses logged over {steps} steps; non-finite at step(s) {bad}",
            "a loss that is NaN or Inf from the start points at precision or "
            "the model config: try bf16=False, a smaller learning rate, or the shipped CPU config",
            data=data,
        )
    first, last = quarter_means(losses)
    data.update(first_quarter=first, last_quarter=last, drop=first - last, relative_drop=(first - last) / first)
    detail = (
        f"loss: mean of the last quarter {last:.4f} < first quarter {first:.4f} "
        f"({100 * (first - last) / first:.1f}% lower over {steps} steps)"
    )
    if last < first:
        return CheckResult(TRAINING, OK, detail, data=data)
    return CheckResult(
        TRAINING,
        ERROR,
        detail.replace(" < ", " is not below "),
        "the model does not learn under this plan: compare with the shipped CPU config "
        "(accelerate_configs/cpu_zero3_2proc.yaml); check the learning rate and the optimizer in "
        "the DeepSpeed JSON",
        data=data,
    )


def clip_result(ranks: list[dict]) -> CheckResult:
    expected = ranks[0]["expected"]["clip"]
    seen = {}  # rank -> sorted set of clip values it applied (engine and ZeRO optimizer)
    for i, r in enumerate(ranks):
        values = set()
        for step in r["steps"].values():
            values.update(v for k, v in step.items() if k in ("clip", "zero_clip") and v is not None)
        seen[i] = sorted(values)
    norms = [n for n in ranks[0]["grad_norm"].values() if math.isfinite(n)]
    engaged = sum(n > expected for n in norms) if expected > 0 else 0
    data = {
        "expected": expected,
        "applied": {str(i): v for i, v in seen.items()},
        "pre_clip_norms": norms,
        "steps_above_clip": engaged,
        "source": "engine" if ranks[0]["expected"]["deepspeed"] else "Trainer",
    }
    if expected <= 0:
        return CheckResult(
            TRAINING,
            ERROR,
            "clipping: off (gradient_clipping 0)",
            'set gradient_clipping to 1.0 (or "auto") in the DeepSpeed JSON',
            data=data,
        )
    odd = tuple(i for i, v in seen.items() if v != [expected])
    if odd:
        shown = "; ".join(f"rank {i}: {seen[i]}" for i in odd)
        return CheckResult(
            TRAINING,
            ERROR,
            f"clipping: the engine applies another value than {expected:g} ({shown})",
            'set gradient_clipping to "auto" in the DeepSpeed JSON so the engine uses max_grad_norm',
            odd,
            data,
        )
    return CheckResult(
        TRAINING,
        OK,
        f"clipping: the {data['source']} clips at {expected:g} on every rank; pre-clip "
        f"norm above it at {engaged} of {len(norms)} steps",
        data=data,
    )


def expected_learning_rates(expected: dict, applied: list[bool]) -> list[float]:
    """The learning rate of each step under the recipe's schedule, computed from the settings alone: step s applies
    the multiplier of the number of steps applied before it (the engine does not advance a skipped step)."""
    from hf_dist_recipes.schedules.warmup_cosine import WarmupCosineRestarts

    schedule = WarmupCosineRestarts(
        warmup_steps=expected["warmup_steps"],
        total_steps=expected["total_steps"],
        num_cycles=expected["num_cycles"],
        min_lr_ratio=expected["min_lr_ratio"],
        restart_warmup_steps=expected["restart_warmup_steps"],
    )
    out, done = [], 0
    for ok in applied:
        out.append(expected["peak_lr"] * schedule.multiplier(done))
        done += bool(ok)
    return out


def schedule_result(ranks: list[dict]) -> CheckResult:
    expected = ranks[0]["expected"]
    steps = sorted(ranks[0]["steps"])
    seen = [ranks[0]["steps"][s]["lr"] for s in steps]
    want = expected_learning_rates(expected, [ranks[0]["steps"][s].get("applied", True) for s in steps])
    data = {
        "learning_rates": seen,
        "expected": want,
        "warmup_steps": expected["warmup_steps"],
        "num_cycles": expected["num_cycles"],
        "min_lr_ratio": expected["min_lr_ratio"],
    }
    bad = [
        s
        for s, got, exp in zip(steps, seen, want, strict=True)
        if not math.isclose(got, exp, rel_tol=SCHEDULE_RTOL, abs_tol=1e-12)
    ]
    data["mismatched_steps"] = bad
    if expected["scheduler_type"] != "cosine_with_restarts" and not bad:
        return CheckResult(
            TRAINING,
            WARNING,
            f"schedule: {expected['scheduler_type']}, not the recipe's",
            "use lr_scheduler_type='cosine_with_restarts' (the default)",
            data=data,
        )
    if bad:
        s = bad[0]
        fix = (
            "remove the `scheduler` section from the DeepSpeed JSON: it replaces the recipe's schedule"
            if expected["ds_scheduler"]
            else "the engine does not follow RecipeTrainer.create_scheduler: check the DeepSpeed JSON and the versions "
            "(hf-dist-recipes doctor)"
        )
        return CheckResult(
            TRAINING,
            ERROR,
            f"schedule: step {s} applied lr {seen[steps.index(s)]:.6g}, the recipe's "
            f"warm-up + cosine with restarts gives {want[steps.index(s)]:.6g} ({len(bad)} of "
            f"{len(steps)} steps differ)",
            fix,
            data=data,
        )
    return CheckResult(
        TRAINING,
        OK,
        f"schedule: the {len(steps)} learning rates applied follow the recipe's warm-up "
        f"({expected['warmup_steps']} step(s)) + cosine with {expected['num_cycles']} cycle(s), "
        f"peak {expected['peak_lr']:g}",
        data=data,
    )


def agreement_result(ranks: list[dict]) -> CheckResult:
    mismatches = ranks[0]["mismatches"]  # decided from gathered data: the same on every rank
    data = {
        "rank_check": ranks[0]["rank_check"],
        "mismatches": [{"step": s, "what": w, "ranks": r, "message": m} for s, w, r, m, _ in mismatches],
    }
    if not mismatches:
        weights = ranks[0]["rank_check"].get("rank_check/weights_ok")
        how = "weights as built" if weights == 1.0 else "weights (broadcast at build)"
        return CheckResult(
            TRAINING,
            OK,
            f"agreement: seeds, data order, {how}, and at every step the step and "
            "learning rate (and loss, batch, dropout inside TP groups) agree across the ranks",
            data=data,
        )
    odd = tuple(sorted({r for _, _, rs, _, _ in mismatches for r in rs}))
    first = mismatches[0]
    fixes = list(dict.fromkeys(f for *_, f in mismatches))
    more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    return CheckResult(TRAINING, ERROR, f"agreement: {first[3]}{more}", "; ".join(fixes), odd, data)


def nan_result(ranks: list[dict], step: int) -> CheckResult:
    failed = _failed(
        FAILURE_PATHS,
        "nan",
        ranks,
        "the non-finite skip must work under this config before a long "
        "run: see the error; nonfinite_policy='halt' stops with a checkpoint instead",
    )
    if failed:
        return failed
    world = len(ranks)
    bad_rank = world - 1
    tp = ranks[0]["expected"]["tp_size"]
    group = list(range(bad_rank - bad_rank % tp, bad_rank - bad_rank % tp + tp))  # consecutive, as AutoTP forms them
    problems: dict[int, list[str]] = {}
    per_rank = {}
    for i, r in enumerate(ranks):
        steps = r["steps"]
        issues = []
        applied = [s for s in sorted(steps) if steps[s].get("applied") is False]
        if applied != [step]:
            issues.append(f"steps not applied {applied}, expected [{step}]")
        before, at, after = (steps.get(s, {}).get("weights") for s in (step - 1, step, step + 1))
        if before is None or at != before:
            issues.append(f"weights changed at step {step}")
        if after is None or after == at:
            issues.append(f"weights did not change at step {step + 1}")
        # Under TP the NaN also reaches the gradients of the bad rank's TP partners (TP's backward all-reduces
        # activation gradients inside the group): they may be flagged too, no rank outside the group.
        flagged = r["skipped_at"][0][1] if len(r["skipped_at"]) == 1 and r["skipped_at"][0][0] == step else None
        if r["skipped_steps"] != 1 or flagged is None or bad_rank not in flagged or not set(flagged) <= set(group):
            issues.append(
                f"skip count {r['skipped_steps']}, skipped at {r['skipped_at']} (expected step {step}, "
                f"rank {bad_rank}, only ranks of {group})"
            )
        event = r["events"].get(step, "")
        if not event.startswith(f"step {step}:") or f"loss non-finite on rank(s) {bad_rank}" not in event:
            issues.append(f"no nonfinite_event naming step {step} and the loss of rank {bad_rank} (got {event!r})")
        if issues:
            problems[i] = issues
        per_rank[str(i)] = {
            "not_applied": applied,
            "skipped_steps": r["skipped_steps"],
            "flagged_ranks": flagged,
            "event": event,
        }
    data = {"step": step, "rank": bad_rank, "tp_group": group, "ranks": per_rank}
    if problems:
        shown = "; ".join(f"rank {i}: {', '.join(v)}" for i, v in problems.items())
        return CheckResult(
            FAILURE_PATHS,
            ERROR,
            f"nan: a NaN loss on rank {bad_rank} at step {step} was not skipped cleanly: {shown}",
            "a non-finite step must be refused on every rank: check the "
            "DeepSpeed version (hf-dist-recipes doctor) and that nonfinite_policy is not 'off'",
            tuple(problems),
            data,
        )
    return CheckResult(
        FAILURE_PATHS,
        OK,
        f"nan: a NaN loss on rank {bad_rank} at step {step} was skipped on all "
        f"{world} ranks (weights unchanged across it, 1 skip counted, the event names rank "
        f"{bad_rank})",
        data=data,
    )


def resume_result(main: list[dict], resumed: list[dict], save_at: int) -> CheckResult:
    failed = _failed(
        FAILURE_PATHS,
        "resume",
        resumed,
        "a job that cannot resume loses everything since its start at the first failure: see the error",
    )
    if failed:
        return failed
    step = save_at + 1
    problems: dict[int, list[str]] = {}
    per_rank = {}
    for i, (a, b) in enumerate(zip(main, resumed, strict=True)):
        issues = []
        la, lb = a["loss"].get(step), b["loss"].get(step)
        if min(b["steps"], default=None) != step:
            issues.append(f"the resumed run began at step {min(b['steps'], default=None)}, not {step}")
        if la is None or lb is None or not math.isclose(la, lb, rel_tol=RESUME_LOSS_RTOL):
            issues.append(f"loss {lb} against {la}")
        if b["batches"].get(step) != a["batches"].get(step):
            issues.append("another batch")
        lr_a, lr_b = a["steps"].get(step, {}).get("lr"), b["steps"].get(step, {}).get("lr")
        if lr_a is None or lr_b is None or not math.isclose(lr_a, lr_b, rel_tol=SCHEDULE_RTOL, abs_tol=1e-12):
            issues.append(f"learning rate {lr_b} against {lr_a}")
        if issues:
            problems[i] = issues
        per_rank[str(i)] = {
            "loss": lb,
            "uninterrupted_loss": la,
            "lr": lr_b,
            "same_batch": b["batches"].get(step) == a["batches"].get(step),
        }
    data = {"saved_at": save_at, "step": step, "tolerance": RESUME_LOSS_RTOL, "ranks": per_rank}
    if problems:
        shown = "; ".join(f"rank {i}: {', '.join(v)}" for i, v in problems.items())
        return CheckResult(
            FAILURE_PATHS,
            ERROR,
            f"resume: the run resumed from step {save_at} does not reproduce step {step}: {shown}",
            "under this launch config a restarted job would not continue "
            "where it stopped: the checkpoint does not restore the whole state (weights, optimizer, "
            "scheduler, data position, RNG); look in the launch log for missing or unexpected keys "
            "when the checkpoint was loaded",
            tuple(problems),
            data,
        )
    diff = max(abs(v["loss"] - v["uninterrupted_loss"]) for v in per_rank.values())
    data["max_loss_difference"] = diff
    return CheckResult(
        FAILURE_PATHS,
        OK,
        f"resume: saved at step {save_at}, resumed, step {step} reproduced on every "
        f"rank (same batch and learning rate, loss difference {diff:.2g})",
        data=data,
    )
