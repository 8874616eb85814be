"""RecipeTrainer: `transformers.Trainer` with the practices wired in through its public hooks.

Drop-in: the constructor takes the Trainer's arguments in the Trainer's order; a plain `TrainingArguments` is
upgraded to `RecipeTrainingArguments`, a subclass `C` of it (`Seq2SeqTrainingArguments`, trl's `SFTConfig`) to a
`Recipe<C>` that is both (see `RecipeTrainingArguments.from_training_arguments`). Everything is in
`RecipeTrainerMixin`, so any Trainer class takes it: `recipe(SFTTrainer)` (`hf_dist_recipes.trainer_classes`).

What it adds:
- practice 4: `seed_everything(args.seed)` before anything else, so `model_init` builds identical weights on every
  rank; the rank's `SeedReport` is kept as `trainer.seed_report` and logged; `RankAgreementCallback`
  (`reproducibility.rank_agreement`, `trainer.rank_agreement`) checks across ranks at train begin and every
  `rank_check_steps` that the ranks agree on what they must (seeds, data order, built weights, step, learning rate,
  TP-group loss) and sets the dropout streams by role (`per_rank_dropout`);
- practice 5: `GradientHealthCallback` (`hf_dist_recipes.stability.gradient_health`, `trainer.gradient_health`) finds a
  non-finite loss or gradient on any rank with one all-reduce per step and skips that optimizer step on every
  rank or halts with a report (`nonfinite_policy`), and names loss and grad-norm spikes; it sees each training
  loss through `compute_loss` and the clip call's pre-clip norm through `_clip_grad_norm` (`_compat`);
- practice 2: after the process group exists, its backend is checked (Gloo on a CUDA host is an error);
- practice 1: then every rank's environment fingerprint (Python, torch build, CUDA, NCCL, driver, the HF stack) is
  all-gathered and the constructor stops on every rank, naming the rank and host that differ, when they do not
  agree (`hf_dist_recipes.environment.fingerprint.check_ranks_agree`);
- practice 6: `create_scheduler` builds the warm-up + cosine-with-restarts schedule (with `min_lr_ratio` and
  `restart_warmup_steps`), also when DeepSpeed owns the optimizer (the engine then steps it);
- practice 7: TensorBoard from every rank (`<logging_dir>/rank<N>`) and a per-rank JSON summary at the end;
  a MoE model also logs its tokens per expert and per EP rank (`hf_dist_recipes.moe.expert_load`);
- practice 3: the DeepSpeed batch-size trap under tensor parallelism is handled by the arguments;
- checkpoints in every layout: `save_model` writes a `from_pretrained` checkpoint from ZeRO-3, AutoTP and AutoEP
  (`hf_dist_recipes.checkpoint`), every rank writing its share of the files; a `save_steps` checkpoint holds what
  resume needs (the engine's files) and the weights only with `hf_weights_in_checkpoints`; the collective timeout
  allows a save its time, `evaluate()`/`predict()` work before `train()` under DeepSpeed, and a resume
  continues the per-rank counters;
- a Gloo process group is destroyed at exit (`backend.destroy_gloo_group_at_exit`);
- under ZeRO-3, a model built whole on every rank (before the arguments, or by calling its class) above
  `max_unpartitioned_model_size` stops the constructor with the fix (`parallel.construction`); so does a model
  that will not recompute although the launch config's plan assumed activation checkpointing (a warning under
  `allow_no_recompute`; `hf_dist_recipes.parallel.plan_record`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
from collections.abc import Mapping

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from hf_dist_recipes import _compat
from hf_dist_recipes._compat import forget_zero_hpz_group
from hf_dist_recipes.argument_classes import recipe_arguments_class
from hf_dist_recipes.arguments import RECIPE_SCHEDULER, RecipeTrainingArguments
from hf_dist_recipes.callbacks import REPLACES, recipe_callbacks
from hf_dist_recipes.checkpoint.export import save_hf_checkpoint
from hf_dist_recipes.checkpoint.gather import reference_model
from hf_dist_recipes.checkpoint.writer import save_config_files
from hf_dist_recipes.comm.backend import check_process_group_backend, destroy_gloo_group_at_exit
from hf_dist_recipes.comm.watchdog import HangWatchdogCallback
from hf_dist_recipes.environment.fingerprint import check_ranks_agree
from hf_dist_recipes.monitoring.console import use_recipe_console
from hf_dist_recipes.monitoring.pending import PendingLogs
from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.monitoring.tensorboard import PerRankTensorBoardCallback
from hf_dist_recipes.parallel.batch import tensor_parallel_size
from hf_dist_recipes.parallel.checkpoint_bytes import SaveBytes, save_bytes, save_timeout_s
from hf_dist_recipes.parallel.construction import check_partitioned
from hf_dist_recipes.parallel.plan_record import PlanConformanceCallback
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback
from hf_dist_recipes.reproducibility.seeding import seed_everything
from hf_dist_recipes.schedules.warmup_cosine import (
    DEFAULT_NUM_CYCLES,
    WarmupCosineRestarts,
    warmup_cosine_restarts_scheduler,
)
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback


class RecipeTrainerMixin(_compat.TrainerPrivateOverrides):
    """The recipe for any `Trainer` subclass, placed before it: `class MyTrainer(RecipeTrainerMixin, SFTTrainer)`,
    or `recipe(SFTTrainer)` (`hf_dist_recipes.trainer_classes`). Every method here calls `super()`, so the
    Trainer's own `__init__`, `log`, `compute_loss`, ... run inside ours. The constructor takes that Trainer's
    arguments (positional or by name) and upgrades `args` before it sees them
    (`RecipeTrainingArguments.from_training_arguments`)."""

    # The arguments class the Trainer needs (trl's trainers rebuild any other into theirs, losing ours).
    recipe_arguments_base: type[TrainingArguments] = TrainingArguments

    def __init_subclass__(cls, **kwargs):
        """A class whose constructor is the mixin's gets one with the Trainer's signature, for `inspect` and help."""
        super().__init_subclass__(**kwargs)
        inits = [klass for klass in cls.__mro__[1:] if "__init__" in vars(klass)]
        if "__init__" in vars(cls) or inits[0] is not RecipeTrainerMixin:
            return
        signature = _trainer_signature(cls)

        def __init__(self, *positional, **named):
            super(cls, self).__init__(*positional, **named)

        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        __init__.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = RecipeTrainerMixin.__init__.__doc__
        cls.__init__ = __init__

    def __init__(self, *positional, **named):
        """The Trainer's constructor, with `args` upgraded to the recipe's (None: `tmp_trainer` as output_dir)."""
        bound = _trainer_signature(type(self)).bind_partial(*positional, **named)
        args = bound.arguments.get("args")
        if args is None:
            args = recipe_arguments_class(self.recipe_arguments_base, RecipeTrainingArguments)(output_dir="tmp_trainer")
        args = RecipeTrainingArguments.from_training_arguments(args, self.recipe_arguments_base)
        bound.arguments["args"] = args
        # Before super().__init__: it calls model_init, whose weights must come from the seeded state.
        self.seed_report = seed_everything(args.seed, deterministic=args.full_determinism)
        self.rank_metrics = RankMetrics()
        super().__init__(*bound.args, **bound.kwargs)
        use_recipe_console(self)  # loss, lr, grad norm, skips, spikes; the rest in TensorBoard
        # use_cpu (asked for, or set by the arguments where torch sees no GPU) is a CPU run: Gloo is right there.
        check_process_group_backend(
            allow_gloo_on_cuda=args.allow_gloo_on_cuda, cuda_devices=0 if args.use_cpu else None
        )
        destroy_gloo_group_at_exit()
        # Every rank's versions, build, NCCL and driver agree, or every rank stops here, naming who differs.
        check_ranks_agree()
        if (
            self.is_deepspeed_enabled
            and self.model is not None
            and self.accelerator.state.deepspeed_plugin.hf_ds_config.is_zero3()
        ):
            check_partitioned(self.model, limit_bytes=args.max_unpartitioned_model_bytes, world_size=args.world_size)
        callbacks = recipe_callbacks(
            args,
            self.model,
            rank_metrics=self.rank_metrics,
            seed_report=self.seed_report,
            tp_size=tensor_parallel_size(
                self.accelerator.state.deepspeed_plugin.hf_ds_config.config if self.is_deepspeed_enabled else {}
            ),
            registered=self.callback_handler.callbacks,
        )
        self.plan_conformance = _one(callbacks, PlanConformanceCallback)
        # Before any engine: a model that will not recompute under a plan that assumed it stops here with the fix.
        self.plan_conformance.check_before_training(self.model, args)
        self.rank_agreement = _one(callbacks, RankAgreementCallback)
        for ours, stock in REPLACES.items():
            if any(isinstance(c, ours) for c in callbacks):
                self.remove_callback(stock)
        for callback in callbacks:  # after the Trainer's own, in recipe_callbacks' order (hf_dist_recipes.callbacks)
            self.add_callback(callback)
        # The DeepSpeed config as the arguments made it, before an evaluation can finalize it for inference.
        self._deepspeed_config_at_init = (
            copy.deepcopy(self.accelerator.state.deepspeed_plugin.hf_ds_config.config)
            if self.is_deepspeed_enabled
            else None
        )

    def call_model_init(self, trial=None):
        """`Trainer.call_model_init`, which also rebuilds under ZeRO++ hpZ (`_compat.forget_zero_hpz_group`)."""
        forget_zero_hpz_group()
        return super().call_model_init(trial)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`, which under DeepSpeed also works after `evaluate()` or `predict()`.

        transformers 5.24 (PR huggingface/transformers#44889, open; #30205 for ZeRO-2): an evaluation before
        training builds an inference-only engine and keeps it as `model_wrapped`; `train()` then destroys it
        (`accelerator.free_memory()`), sees a model that looks wrapped, skips preparing it and stops in
        `accelerator.backward` ('NoneType' object has no attribute 'backward'). The evaluation also finalized the
        DeepSpeed config for zero steps and dropped its `optimizer` block. Here the stale engine is forgotten and
        the config restored, so training builds its engine as if nothing had run before (equal losses:
        tests/distributed/test_checkpoint_lifecycle.py)."""
        if self.is_deepspeed_enabled and self.model_wrapped is not self.model:
            self._restore_deepspeed_config()
            self.model_wrapped, self.deepspeed = self.model, None
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if checkpoint:  # the per-rank counters continue where the checkpoint left them
            self.rank_metrics.load(checkpoint, self.args.process_index)
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        except BaseException:
            # on_train_end is not called after an exception: write out what each rank logged before it.
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, PerRankTensorBoardCallback):
                    callback.close()
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, HangWatchdogCallback):  # a lost peer: name it (ends the process)
                    callback.explain_failure(sys.exc_info()[1])
            raise

    def evaluate(self, *args, **kwargs):
        with self._evaluation_engine_without_model_parallelism():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._evaluation_engine_without_model_parallelism():
            return super().predict(*args, **kwargs)

    @contextlib.contextmanager
    def _evaluation_engine_without_model_parallelism(self):
        """Before training, DeepSpeed builds an evaluation engine, and AutoTP/AutoEP would rewrite the model in
        place for it (DeepSpeed 0.19.8 cannot rewrite it a second time: "AutoEP: no MoE layers detected" when
        train() builds its engine). That engine is built as plain ZeRO-3 instead; the training engine applies
        TP and EP to the untouched model. The evaluation's numbers are the same: TP/EP only split the work."""
        if not self.is_deepspeed_enabled or self.deepspeed is not None:
            yield
            return
        config = self.accelerator.state.deepspeed_plugin.hf_ds_config.config
        for key in ("tensor_parallel", "expert_parallel"):
            config.pop(key, None)
        try:
            yield
        finally:
            self._restore_deepspeed_config()

    def _restore_deepspeed_config(self) -> None:
        config = self.accelerator.state.deepspeed_plugin.hf_ds_config.config  # shared with accelerate: in place
        config.clear()
        config.update(copy.deepcopy(self._deepspeed_config_at_init))

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The recipe's `WarmupCosineRestarts` for `lr_scheduler_type="cosine_with_restarts"`, else the stock one.

        Under DeepSpeed with an `optimizer` section, transformers hands the engine a callable that calls this on a
        copy of the trainer with the engine's optimizer (`deepspeed_optim_sched`); without one, the Trainer calls
        it after the engine is built. Both come here, so the engine applies this schedule in both cases
        (tests/distributed/test_schedule_deepspeed.py). A `scheduler` section in the DeepSpeed config replaces it,
        as in transformers."""
        if self.lr_scheduler is not None or self.args.lr_scheduler_type != RECIPE_SCHEDULER:
            return super().create_scheduler(num_training_steps, optimizer)
        # The parent builds the stock schedule and marks it created; ours then takes its place on the optimizer.
        # The arguments keep only `num_cycles` in lr_scheduler_kwargs, the one key the stock function accepts.
        super().create_scheduler(num_training_steps, optimizer)
        kwargs = dict(self.args.lr_scheduler_kwargs or {})
        schedule = WarmupCosineRestarts(
            warmup_steps=self.args.get_warmup_steps(num_training_steps),
            total_steps=num_training_steps,
            num_cycles=kwargs.get("num_cycles", DEFAULT_NUM_CYCLES),
            min_lr_ratio=self.args.min_lr_ratio,
            restart_warmup_steps=self.args.restart_warmup_steps,
        )
        self.lr_scheduler = warmup_cosine_restarts_scheduler(optimizer or self.optimizer, schedule)
        return self.lr_scheduler

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under DeepSpeed, a `from_pretrained`-loadable checkpoint from any mix of ZeRO-3, AutoTP and AutoEP,
        streamed a layer at a time into sharded safetensors that every rank writes its share of
        (`hf_dist_recipes.checkpoint.export`). The stock path gathers the whole model on rank 0 and, under AutoEP,
        stops (DeepSpeed 0.19.8 refuses the consolidation).

        Inside a `checkpoint-N` (the Trainer's `save_steps` save) the weights are written only with
        `hf_weights_in_checkpoints=True`: resume reads the engine's files, which every rank writes in parallel
        after this; the config and training arguments are still written (`checkpoint export` reads the config).
        The collective timeout allows the save its time (`HangWatchdogCallback.begin_save`, bound from
        `parallel.checkpoint_bytes`) until the checkpoint is complete."""
        model = self.accelerator.unwrap_model(self.model_wrapped)
        if not self.is_deepspeed_enabled or not isinstance(model, PreTrainedModel):  # e.g. PEFT: the stock path
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        in_checkpoint = _internal_call and os.path.basename(os.path.normpath(output_dir)).startswith(
            f"{PREFIX_CHECKPOINT_DIR}-"
        )
        hf_copy = not in_checkpoint or self.args.hf_weights_in_checkpoints
        watchdog = next((c for c in self.callback_handler.callbacks if isinstance(c, HangWatchdogCallback)), None)
        if watchdog is not None:
            b = self._save_bytes(model)
            bytes_per_rank = b.checkpoint_per_rank(hf_copy) if in_checkpoint else b.hf_per_rank
            watchdog.begin_save(save_timeout_s(bytes_per_rank, watchdog.current_timeout()))
        try:
            if hf_copy:
                save_hf_checkpoint(model, output_dir, max_shard_bytes=self.args.save_shard_bytes)
            elif self.args.should_save:
                save_config_files(model.config, output_dir, getattr(model, "generation_config", None))
        finally:
            if watchdog is not None and not in_checkpoint:  # a checkpoint's bound ends in on_save
                watchdog.end_save()
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_bytes(self, model) -> SaveBytes:
        """Bytes of one save of this job (`parallel.checkpoint_bytes`), from the model class's parameter count."""
        if getattr(self, "_save_bytes_cache", None) is None:
            total = sum(p.numel() for p in reference_model(model).parameters())
            dtype = next(model.parameters()).dtype
            precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
            self._save_bytes_cache = save_bytes(
                total, self.args.world_size, precision=precision, max_shard_bytes=self.args.save_shard_bytes
            )
        return self._save_bytes_cache

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The stock log, with the numbers our callbacks prepared for it added first (tokens per expert, the
        skipped-step and spike counts, the periodic rank check), so that `log_history` and every `report_to`
        integration get them, not only the callbacks after ours. Only numbers a resumed run logs again alike: each
        rank's own measurements, the train-begin rank checks and event texts join the log in the callbacks'
        `on_log`, after `log_history` took its copy, for the per-rank TensorBoard run (`monitoring/pending.py`)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PendingLogs):
                logs.update(callback.pop_pending())
        super().log(logs, start_time)
        # After the log that showed it: else the Trainer's running loss stays NaN for the rest of the run.
        _compat.reset_nonfinite_running_loss(self)

    @property
    def gradient_health(self) -> GradientHealthCallback:
        """The gradient-health callback in use (a resume replaces it with one restored from the checkpoint)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, GradientHealthCallback):
                return callback
        return GradientHealthCallback(nonfinite_policy="off")  # removed by the user: nothing to feed

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The stock loss; while training, handed to the gradient-health check, which multiplies a non-finite
        loss by NaN so that no engine can apply its gradients (`hf_dist_recipes.stability.gradient_health`)."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training:
            return result
        health = self.gradient_health
        if return_outputs:
            return health.watch_loss(result[0]), result[1]
        return health.watch_loss(result)

    def observe_grad_norm(self, norm) -> None:
        """The pre-clip global gradient norm of this optimizer step (from the Trainer's clip call, through
        `_compat.TrainerPrivateOverrides`), handed to the gradient-health spike detector."""
        self.gradient_health.observe_grad_norm(norm)

    def training_step(self, model, inputs, num_items_in_batch=None):
        tokens = _count_tokens(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.rank_metrics.add_micro_step(loss, tokens)
        self.rank_agreement.observe(loss, inputs)
        return loss


def _one(callbacks: list, kind: type):
    return next(c for c in callbacks if isinstance(c, kind))


def _count_tokens(inputs) -> int:
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


def _trainer_signature(cls: type) -> inspect.Signature:
    """The signature of the first `__init__` after the mixin that names `args` (a subclass whose `__init__` only
    forwards `*args, **kwargs` hands them on to it), without `self`."""
    mro = cls.__mro__
    for klass in mro[mro.index(RecipeTrainerMixin) + 1 :]:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        signature = inspect.signature(init)
        named = signature.parameters.get("args")
        if named is not None and named.kind in (named.POSITIONAL_OR_KEYWORD, named.KEYWORD_ONLY):
            return signature.replace(parameters=list(signature.parameters.values())[1:])
    raise ValueError(f"{cls.__name__}: no __init__ after RecipeTrainerMixin takes `args`; put it before a Trainer")


class RecipeTrainer(RecipeTrainerMixin, Trainer):
    """`transformers.Trainer` with the recipe (`RecipeTrainerMixin`); `recipe(Trainer)` is this class."""
