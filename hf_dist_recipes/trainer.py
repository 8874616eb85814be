"""RecipeTrainer: `transformers.Trainer` with the practices wired in through its public hooks.

Drop-in: the constructor takes the Trainer's arguments in the Trainer's order; a plain `TrainingArguments` is
upgraded to `RecipeTrainingArguments`, a subclass `C` of it (`Seq2SeqTrainingArguments`, trl's `SFTConfig`) to a
`Recipe<C>` that is both (`RecipeTrainingArguments.from_training_arguments`). Everything is in `RecipeTrainerMixin`,
so any Trainer class takes it: `recipe(SFTTrainer)` (`hf_dist_recipes.trainer_classes`).

One `RecipeRuntime` per trainer (`hf_dist_recipes.runtime`), built after the stock constructor, is handed to every
`RecipeCallback` the trainer holds or adds (`hand_runtime`); the trainer calls the events no callback hook carries
(each micro-batch's loss, the batch, the pre-clip gradient norm, the bytes of a save, a failure) on its callbacks
by name (`call_recipe_event`) and empties the runtime's log sink into each log. By practice:
- 4: the arguments seeded every process, and the stock constructor seeds again before `model_init`, so every rank
  builds identical weights; `RankAgreementCallback` (`trainer.rank_agreement`) checks that the ranks agree on
  seeds, data order, built weights, step, learning rate and TP-group loss, and sets the dropout streams by role;
- 5: `GradientHealthCallback` (`trainer.gradient_health`) finds a non-finite loss or gradient on any rank with one
  all-reduce per step, skips that step on every rank or halts with a report, and names loss and grad-norm spikes;
  it hears each training loss from `compute_loss` and the pre-clip norm, clipped or not, from `_get_grad_norm`
  (`_compat.transformers`);
- 2 and 1: once the process group exists, its backend is checked (Gloo on a CUDA host is an error), then every
  rank's environment fingerprint is all-gathered and every rank stops, naming who differs, when they disagree
  (`environment.fingerprint.check_ranks_agree`); a Gloo group is destroyed at exit;
- 6: `create_scheduler` builds warm-up + cosine with restarts, also when DeepSpeed owns the optimizer;
- 7: TensorBoard from every rank (`<logging_dir>/rank<N>`) and a per-rank JSON summary; a MoE model also logs its
  tokens per expert and per EP rank, and DeepSeek-V3 routers get their correction bias balanced (`moe/`);
- 3: the DeepSpeed batch-size trap under TP is handled by the arguments; under ZeRO-3 a model built whole above
  `max_unpartitioned_model_size`, or one that will not recompute under a plan that assumed it, stops the
  constructor with the fix (`parallel.construction`, `parallel.plan_record`);
- checkpoints in every layout: `save_model` writes a `from_pretrained` checkpoint from ZeRO-3, AutoTP and AutoEP,
  every rank writing its share (`hf_dist_recipes.checkpoint`); a `save_steps` checkpoint holds what resume needs;
  a save gets its collective timeout; `evaluate()`/`predict()` work before `train()` under DeepSpeed; a resume
  continues the per-rank counters and reads the engine's files memory-mapped (`checkpoint.resume_loading`);
- `loss_chunk_tokens`: the training loss a chunk of tokens at a time (`parallel.chunked_loss`); `tiled_mlp_shards`:
  the gated MLPs a slice of the tokens at a time (`parallel.tiled_mlp`);
- Ulysses sequence parallelism (accelerate's `ParallelismConfig(sp_size)`, from a `config generate --sp` YAML): on CPU
  DeepSpeed's communication is initialised for it, DeepSeek's MLA gets the head sizes Ulysses takes while the engine
  is built, every batch gets `position_ids`, and evaluation (unsharded) can be capped (`parallel.sequence_parallel`).
"""

from __future__ import annotations

import errno
import inspect
import logging
import os

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes._compat.deepspeed import forget_zero_hpz_group
from hf_dist_recipes.argument_classes import describe_recipe_defaults, recipe_arguments_class
from hf_dist_recipes.arguments import RECIPE_SCHEDULER, RecipeTrainingArguments
from hf_dist_recipes.callbacks import RecipeCallbacks, recipe_callbacks
from hf_dist_recipes.checkpoint import disk_space, manifest, relayout, resume_loading
from hf_dist_recipes.checkpoint.auto_resume import plan_resume
from hf_dist_recipes.checkpoint.export import save_hf_checkpoint
from hf_dist_recipes.checkpoint.gather import reference_model
from hf_dist_recipes.checkpoint.preemption import PREEMPTED_EXIT_CODE, end_launch
from hf_dist_recipes.checkpoint.writer import save_config_files
from hf_dist_recipes.comm.backend import check_process_group_backend, destroy_gloo_group_at_exit
from hf_dist_recipes.core.gather import gather_objects
from hf_dist_recipes.environment.fingerprint import check_ranks_agree
from hf_dist_recipes.environment.precision import check_not_fp8
from hf_dist_recipes.moe.expert_balance import BALANCING_OFF, needs_balancing
from hf_dist_recipes.monitoring.console import use_recipe_console, warn_once
from hf_dist_recipes.parallel.checkpoint_bytes import SaveBytes, save_bytes
from hf_dist_recipes.parallel.chunked_loss import ChunkedLoss, chunked_loss_for
from hf_dist_recipes.parallel.construction import check_partitioned
from hf_dist_recipes.parallel.sequence_parallel import (
    UNSHARDED_EVAL,
    UlyssesRegistration,
    eval_length_problem,
    eval_unsharded,
    init_deepspeed_comm,
    sequence_parallel_size,
    ulysses_registration_for,
    with_position_ids,
)
from hf_dist_recipes.parallel.tiled_mlp import tile_for_trainer
from hf_dist_recipes.runtime import RecipeRuntime
from hf_dist_recipes.schedules.scheduler_kwargs import default_num_cycles
from hf_dist_recipes.schedules.warmup_cosine import (
    WarmupCosineRestarts,
    warmup_cosine_restarts_scheduler,
)

logger = logging.getLogger(__name__)


class RecipeTrainerMixin(compat_transformers.TrainerPrivateOverrides):
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
        # The arguments seeded the process when they were created (the upgrade above creates them); the stock
        # __init__ seeds again before model_init (set_seed), so model_init builds the same weights on every rank.
        super().__init__(*bound.args, **bound.kwargs)
        # The one read of the callbacks the stock constructor registered (its own and the user's): the stock
        # console is replaced, a user's expert-load callback is not doubled, and every recipe callback among them
        # gets this run's runtime below (a restored callback aside: `_compat`).
        held = list(self.callback_handler.callbacks)
        use_recipe_console(self, held)  # loss, lr, grad norm, skips, spikes; the rest in TensorBoard
        # The defaults the recipe put in place of the user's class's (a trl user's schedule, the warm-up, ...) and
        # the seeding: said once on every route, with how to keep theirs.
        warn_once(logger, describe_recipe_defaults(args, type(self).__name__, RecipeTrainingArguments))
        # use_cpu (asked for, or set by the arguments where torch sees no GPU) is a CPU run: Gloo is right there.
        check_process_group_backend(
            allow_gloo_on_cuda=args.allow_gloo_on_cuda, cuda_devices=0 if args.use_cpu else None
        )
        destroy_gloo_group_at_exit()
        # Every rank's versions, build, NCCL and driver agree, or every rank stops here, naming who differs.
        check_ranks_agree()
        # The run's facts, feeds and log sink, handed to every recipe callback (hf_dist_recipes.runtime). Its facts
        # hold the DeepSpeed config as the arguments made it, before an evaluation can finalize it for inference.
        check_not_fp8(self.model)  # before any engine: DeepSeek's published FP8 weights, loaded as they are
        self.runtime = RecipeRuntime.for_trainer(self)
        if self.runtime.facts.zero_stage == 3 and self.model is not None:
            check_partitioned(self.model, limit_bytes=args.max_unpartitioned_model_bytes, world_size=args.world_size)
        registered = {type(c) for c in held}
        self.recipe_callbacks: RecipeCallbacks = recipe_callbacks(args, self.model, registered=registered)
        # What a resume from a checkpoint of another layout converted (checkpoint.relayout); None otherwise.
        self.relayout: relayout.Relayout | None = None
        if not args.expert_bias_balancing and needs_balancing(self.model, registered):
            warn_once(logger, BALANCING_OFF)  # the memory estimate's even routing is then nobody's job
        # Before any engine: a model that will not recompute under a plan that assumed it stops here with the fix.
        self.recipe_callbacks.plan_conformance.check_before_training(self.model, args)
        if self.recipe_callbacks.tensorboard is not None:  # the stock one writes rank 0 only, into the same root
            self.remove_callback(TensorBoardCallback)
        # After the Trainer's own, in recipe_callbacks' order (hf_dist_recipes.callbacks); each gets the runtime.
        for callback in self.recipe_callbacks.in_order():
            self.add_callback(callback)
        # A recipe callback the user registered (an ExpertLoadCallback) logs through this run's runtime too.
        self.hand_runtime(held)
        # The chunked loss stands in for the model inside the stock compute_loss; another Trainer's (trl's SFTTrainer
        # reads the logits for its metrics) would get outputs without them.
        after_mixin = super().compute_loss
        self.chunked_loss = chunked_loss_for(
            args,
            self.label_smoother,
            self.compute_loss_func,
            other_compute_loss=None
            if getattr(after_mixin, "__func__", None) is Trainer.compute_loss
            else type(self).__name__,
        )
        self._tile_mlps(self.model)
        # Ulysses SP (`parallel.sequence_parallel`): DeepSpeed's communication where accelerate leaves it out (CPU),
        # positions in every batch, and MLA's head sizes made ones Ulysses takes while the engine is built.
        self.sp_size = sequence_parallel_size(self.accelerator)
        self.recipe_callbacks.plan_conformance.check_sequence_parallel(self.sp_size)
        self.ulysses: UlyssesRegistration | None = None
        if self.sp_size > 1:
            init_deepspeed_comm(self.accelerator)
            self.data_collator = with_position_ids(self.data_collator)
            self.ulysses = ulysses_registration_for(self.model, self.accelerator)
            if self.ulysses is not None:
                self.add_callback(self.ulysses.callback())

    runtime: RecipeRuntime | None = None  # None only inside the stock constructor, before the mixin builds it

    def add_callback(self, callback):
        """`Trainer.add_callback`; a `RecipeCallback` (or its class) added once the runtime exists gets it."""
        super().add_callback(callback)
        self.hand_runtime(self.callback_handler.callbacks[-1:])

    def hand_runtime(self, callbacks) -> None:
        """Hand this run's runtime to each of `callbacks` that takes one (`RecipeCallback.set_runtime`)."""
        if self.runtime is None:
            return
        for callback in callbacks:
            set_runtime = getattr(callback, "set_runtime", None)
            if set_runtime is not None:
                set_runtime(self.runtime)

    def call_recipe_event(self, event: str, **values):
        """Call the `RecipeCallback` event `event` (`hf_dist_recipes.runtime`) on every callback of this trainer that
        has it, in the list's order, with `args, state, control` first, as `CallbackHandler.call_event` calls the
        Trainer's events. A tensor returned by `on_micro_batch_loss` replaces the loss for the next callback;
        returns the loss (None for events without one)."""
        for callback in self.callback_handler.callbacks:
            handler = getattr(callback, event, None)
            if handler is None:
                continue
            result = handler(self.args, self.state, self.control, **values)
            if event == "on_micro_batch_loss" and result is not None:
                values["loss"] = result
        return values.get("loss")

    def call_model_init(self, trial=None):
        """`Trainer.call_model_init`, which also rebuilds under ZeRO++ hpZ
        (`_compat.deepspeed.forget_zero_hpz_group`); the model it builds gets `tiled_mlp_shards` and, under SP, the
        Ulysses registration's care."""
        forget_zero_hpz_group()
        model = super().call_model_init(trial)
        self._tile_mlps(model)
        if getattr(self, "ulysses", None) is not None:  # train()'s new model is the one Ulysses registers next
            self.ulysses.use_model(model)
            self.ulysses.before_prepare()
        return model

    def _tile_mlps(self, model) -> None:
        """`tiled_mlp_shards` applied to `model` (`parallel.tiled_mlp.tile_for_trainer`)."""
        args = self.args
        tile_for_trainer(model, args.tiled_mlp_shards, deepspeed=self.is_deepspeed_enabled, world_size=args.world_size)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`, which under DeepSpeed also works after `evaluate()` or `predict()`: the engine such an
        evaluation built is forgotten and the training config restored (`_compat.transformers.forget_evaluation_engine`,
        with the upstream issue), so training builds its engine as if nothing had run before (equal losses:
        tests/distributed/test_checkpoint_lifecycle.py).

        `resume_from_checkpoint=True` resumes from the newest complete checkpoint (one whose manifest and files
        agree), not a half-written newer one, which is named; so does `None` under `auto_resume`, or starts fresh
        when there is none (`hf_dist_recipes.checkpoint.auto_resume`). A path is used as given."""
        if self.runtime.facts.deepspeed is not None:
            compat_transformers.forget_evaluation_engine(self, self.runtime.facts.deepspeed)
        # A path wins; True and auto_resume take the newest complete checkpoint (`checkpoint.auto_resume`), each rank
        # hashing its share; every rank takes rank 0's choice, so that a file appearing meanwhile cannot split them.
        args = self.args
        plan = gather_objects(plan_resume(resume_from_checkpoint, args.auto_resume, args.output_dir,
                                          self.runtime.facts.rank, args.world_size))[0]  # fmt: skip
        for line in plan.lines:
            warn_once(logger, line)
        checkpoint = plan.checkpoint
        if checkpoint:  # the per-rank counters continue where the checkpoint left them
            self.runtime.rank_metrics.load(checkpoint, self.runtime.facts.rank)
        # Each prepare registers Ulysses afresh (an evaluation's may have come before, or an earlier train())
        if self.ulysses is not None:
            self.ulysses.before_prepare()
        try:
            output = super().train(checkpoint, trial, ignore_keys_for_eval)
        except BaseException as error:
            # on_train_end is not called after an exception: each rank writes out what it logged, then a lost peer
            # is named (which ends the process). A SIGTERM meanwhile is the launcher ending this rank, not a
            # request to save: it ends the process at once, as it did before the preemption callback.
            self.recipe_callbacks.preemption.abandon()
            self.call_recipe_event("on_train_error", error=error)
            self.call_recipe_event("on_train_abort", error=error)
            raise
        finally:
            self.runtime.logs.discard()  # what came after the last log: a next train() starts clean
            if self.ulysses is not None:  # a train() that stopped before train begin
                self.ulysses.restore()
        stop = self.recipe_callbacks.preemption.stop
        if stop is not None:
            # Not back to the script: what follows train() (a final save_model, an evaluation) belongs to the end of
            # the run, which this is not. The job started again continues from the checkpoint (auto_resume).
            facts = self.runtime.facts
            if facts.rank == 0:  # it wrote the manifest
                said = (stop.step, PREEMPTED_EXIT_CODE, stop.signal_name, stop.first_rank)
                logger.warning("checkpoint-%d is complete; exiting with code %d (%s reached rank %d)", *said)
            checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{stop.step}")
            end_launch(stop, checkpoint, rank=facts.rank, local_rank=facts.local_rank)
            raise SystemExit(PREEMPTED_EXIT_CODE)
        return output

    def running_layout(self) -> manifest.CheckpointLayout:
        """This job's layout as a checkpoint's manifest records it (processes, TP and EP degrees, ZeRO stage)."""
        facts = self.runtime.facts
        return manifest.CheckpointLayout(self.args.world_size, facts.layout.tp, facts.layout.ep, facts.zero_stage)

    def _said_relayout(self, converted: relayout.Relayout) -> None:
        self.relayout = converted
        warn_once(logger, converted.line())

    def start_checkpoint(self, checkpoint: str) -> None:
        """Before the Trainer writes `checkpoint` (every rank): not begun, on every rank, when a rank's disk cannot
        hold it (`checkpoint.disk_space`); a folder saved into again loses its old manifest."""
        model, args = self.accelerator.unwrap_model(self.model_wrapped), self.args
        estimate = isinstance(model, PreTrainedModel) and self._save_bytes(model).checkpoint_total(
            args.hf_weights_in_checkpoints
        )  # 0 for another module (e.g. PEFT): then only a checkpoint already written says what one takes
        self._space_needed = disk_space.needed_bytes(args.output_dir, int(estimate))
        if short := [s for s in gather_objects(disk_space.shortage(checkpoint, *self._space_needed)) if s]:
            raise OSError(errno.ENOSPC, short[0])
        manifest.retract_manifest(checkpoint, writes=self.runtime.facts.rank == 0)

    def failed_checkpoint(self, checkpoint: str, error: BaseException) -> None:
        """A write into `checkpoint` failed on this rank: the disk's part in it, as a note on the error and logged."""
        if said := disk_space.explain(error, checkpoint, *self._space_needed):
            logger.error("rank %d: %s", self.runtime.facts.rank, said)

    def finish_checkpoint(self, checkpoint: str) -> None:
        """After the Trainer wrote `checkpoint` (every rank, `_compat.transformers._save_checkpoint`): this rank's
        counters, then every rank's files hashed and made durable and, last, the manifest that makes the checkpoint
        complete; then the rotation of `save_total_limit`, counting complete ones only (`checkpoint.manifest`)."""
        args, facts = self.args, self.runtime.facts
        self.runtime.rank_metrics.save(checkpoint, facts.rank)
        manifest.complete_checkpoint(
            checkpoint, self.state.global_step, self.running_layout(),
            rank=facts.rank, world=args.world_size, flushes=facts.local_rank == 0,
        )  # fmt: skip
        if args.should_save:
            limit, best = args.save_total_limit, self.state.best_model_checkpoint
            for deleted in manifest.rotate_complete_checkpoints(os.path.dirname(checkpoint), limit, best):
                logger.info("Deleted %s (save_total_limit=%s)", deleted, limit)

    def evaluate(self, *args, **kwargs):
        with self._evaluation_engine():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._evaluation_engine():
            return super().predict(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`; under SP, a batch longer than `sp_eval_max_length` stops it with the fix
        (`parallel.sequence_parallel.eval_length_problem`)."""
        if eval_unsharded(self.accelerator):
            if self.args.sp_eval_max_length is None:
                warn_once(logger, UNSHARDED_EVAL)
            problem = eval_length_problem(inputs, self.args.sp_eval_max_length, self.sp_size)
            if problem is not None:
                raise ValueError(problem)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _evaluation_engine(self):
        """Before training, DeepSpeed's evaluation engine without AutoTP/AutoEP, which would rewrite the model in
        place for nothing to be left to the training engine (`_compat.transformers`)."""
        return compat_transformers.evaluation_without_model_parallelism(self, self.runtime.facts.deepspeed)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The recipe's `WarmupCosineRestarts` for `lr_scheduler_type="cosine_with_restarts"`, else the stock one.

        Under DeepSpeed with an `optimizer` section, transformers hands the engine a callable that calls this on a
        copy of the trainer with the engine's optimizer (`deepspeed_optim_sched`); without one, the Trainer calls
        it after the engine is built. Both come here, so the engine applies this schedule in both cases
        (tests/distributed/test_schedule_deepspeed.py). A `scheduler` section in the DeepSpeed config replaces it,
        as in transformers.

        Also the last public hook before a resume under DeepSpeed reads the engine's files (`_compat.
        training_engine`): with `memory_mapped_resume` the engine then reads them memory-mapped
        (`hf_dist_recipes.checkpoint.resume_loading`)."""
        engine = compat_accelerate.training_engine(self) if self.is_deepspeed_enabled else None
        if engine is not None and self.args.memory_mapped_resume:
            resume_loading.install(engine)
        if engine is not None:  # outermost: a checkpoint of another layout never reaches the engine's own load
            relayout.install(engine, self.running_layout(), self._said_relayout)
        if self.lr_scheduler is not None or self.args.lr_scheduler_type != RECIPE_SCHEDULER:
            return super().create_scheduler(num_training_steps, optimizer)
        # The parent builds the stock schedule and marks it created; ours then takes its place on the optimizer.
        # The arguments keep only `num_cycles` in lr_scheduler_kwargs, the one key the stock function accepts.
        super().create_scheduler(num_training_steps, optimizer)
        kwargs = dict(self.args.lr_scheduler_kwargs or {})
        schedule = WarmupCosineRestarts(
            warmup_steps=self.args.get_warmup_steps(num_training_steps),
            total_steps=num_training_steps,
            num_cycles=kwargs.get("num_cycles", default_num_cycles(type(self.args))),
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
        b = self._save_bytes(model)  # the hang watchdog bounds the save's collective timeout by them
        self.call_recipe_event(
            "on_save_begin", bytes_per_rank=b.checkpoint_per_rank(hf_copy) if in_checkpoint else b.hf_per_rank
        )
        try:
            if hf_copy:
                save_hf_checkpoint(model, output_dir, max_shard_bytes=self.args.save_shard_bytes)
            elif self.args.should_save:
                save_config_files(model.config, output_dir, getattr(model, "generation_config", None))
        finally:
            if not in_checkpoint:  # a checkpoint's bound ends in on_save
                self.call_recipe_event("on_save_end")
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
            precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(next(model.parameters()).dtype, "fp32")
            shard = self.args.save_shard_bytes
            self._save_bytes_cache = save_bytes(total, self.args.world_size, precision=precision, max_shard_bytes=shard)
        return self._save_bytes_cache

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The stock log, with what the recipe's callbacks put into the runtime's log sink since the last log
        (`hf_dist_recipes.runtime.LogSink`): the `history` numbers (a resumed run logs them again alike) reach
        `log_history`, every `report_to` integration, the console and TensorBoard; the `job` numbers (the per-rank
        spread: the slowest rank, the largest memory) every integration and TensorBoard, but not `log_history`; the
        `rank` values and texts only this rank's TensorBoard run and summary, which read them from the sink."""
        record = self.runtime.logs.take()
        logs.update(record.history)
        logs.update(record.job)
        # The job numbers stay out of `log_history`, which a resumed run rebuilds alike.
        compat_transformers.log_outside_history(self, super().log, logs, record.job, start_time)
        # After the log that showed it: else the Trainer's running loss stays NaN for the rest of the run.
        compat_transformers.reset_nonfinite_running_loss(self)

    chunked_loss: ChunkedLoss | None = None  # `loss_chunk_tokens` (None: the stock loss)

    @property
    def gradient_health(self):
        """The gradient-health callback built for this trainer."""
        return self.recipe_callbacks.gradient_health

    @property
    def rank_agreement(self):
        """The rank-agreement callback built for this trainer (its `mismatches`, `begin_report`)."""
        return self.recipe_callbacks.rank_agreement

    @property
    def plan_conformance(self):
        return self.recipe_callbacks.plan_conformance

    @property
    def resume_loads(self) -> resume_loading.ResumeLoads | None:
        """What the DeepSpeed engine read on resume (each file, memory-mapped or not) and copied out of the mapped
        files; None without DeepSpeed or with `memory_mapped_resume=False` (no files before a resume)."""
        loads = resume_loading.installed(compat_accelerate.training_engine(self) if self.is_deepspeed_enabled else None)
        return None if loads is None else loads.record()

    @property
    def seed_report(self):
        """This process's seeding (when the arguments were created)."""
        return self.runtime.process.seed_report

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The stock loss; while training, handed to the recipe callbacks (`on_micro_batch_loss`), where the
        gradient-health check multiplies a non-finite loss by NaN so that no engine can apply its gradients
        (`hf_dist_recipes.stability.gradient_health`).

        With `loss_chunk_tokens`, a training batch with labels is computed by the chunked loss
        (`hf_dist_recipes.parallel.chunked_loss`): the stock method calls it in place of the model, so everything
        it does around the model's loss (`num_items_in_batch`, the scale of `average_tokens_across_devices`) stays
        upstream's. Its outputs carry no logits; evaluation and prediction take the stock path, which returns them."""
        caller = model
        # under SP the data adapter hands `shift_labels` in place of `labels`
        if self.chunked_loss is not None and model.training and ("labels" in inputs or "shift_labels" in inputs):
            caller = self.chunked_loss.bind(model, self.accelerator.unwrap_model(model))
        result = super().compute_loss(
            caller, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training:
            return result
        self.runtime.fed.add("loss")
        if return_outputs:
            return self.call_recipe_event("on_micro_batch_loss", loss=result[0]), result[1]
        return self.call_recipe_event("on_micro_batch_loss", loss=result)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.runtime.micro_step(loss, inputs)  # per-rank counters
        self.call_recipe_event("on_micro_step", loss=loss, inputs=inputs)  # the TP-group agreement checks
        return loss


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
