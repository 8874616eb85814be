"""transformers' details that are not public API (proven: `PROVEN["transformers"]`): the private `Trainer` methods
the recipe overrides, the log history, the running loss, the weight-conversion guard under DeepSpeed, evaluation
before training, resume of MoE checkpoints, the stock post-init defaults and the layout on disk. Each says when it
can go."""

from __future__ import annotations

import contextlib
import os

from hf_dist_recipes._compat import needed

# transformers 5.24 `TrainingArguments.__post_init__` turns these fields' declared default None into this value, so
# a plain TrainingArguments holds it whether or not the user chose it (`from_training_arguments` treats it as unset).
# Goes when the declared default is the value post-init leaves (tests/unit/test_arguments.py checks it).
STOCK_POST_INIT_DEFAULTS = {"activation_checkpointing": False, "gradient_checkpointing": False}


# transformers 5.24 `integrations/deepspeed.py::_apply_weight_conversions_to_state_dict` (called by
# `_load_state_dict_into_zero3_model` during `from_pretrained` under ZeRO-3) raises NotImplementedError whenever the
# active DeepSpeed config has `tensor_parallel.autotp_size > 1`, before it looks at a tensor. The guard is for
# models already sliced by TP. Under training AutoTP nothing is sliced yet at that point: `from_pretrained` builds
# the full model inside zero.Init and DeepSpeed applies AutoTP later, in `deepspeed.initialize`. So the conversion
# (e.g. per-expert tensors on disk -> DeepSeek's fused experts) is exactly the one without TP. Proven by equal
# losses: tests/distributed/test_checkpoint_lifecycle.py (the job's evaluation before training equals one plain
# process's loss from the same checkpoint in every layout). Gate and when it goes:
# `WORKAROUNDS["autotp_weight_conversion"]`.
_CONVERSIONS = "_apply_weight_conversions_to_state_dict"
_UNGUARDED = "_hf_dist_recipes_unguarded"


def allow_weight_conversions_under_training_autotp() -> None:
    """Install (once) the wrapper that lets `from_pretrained` convert weights while a training AutoTP config is
    active. Covered: transformers 5.24. Inference TP (`inference.tensor_parallel`) keeps upstream's guard."""
    if not needed("autotp_weight_conversion"):
        return
    import transformers.integrations.deepspeed as hf_ds

    original = getattr(hf_ds, _CONVERSIONS)
    if getattr(original, _UNGUARDED, False):
        return

    def without_training_tp(config):
        if config is None or "tensor_parallel" not in config:
            return config
        return {k: v for k, v in config.items() if k != "tensor_parallel"}

    def convert(model, state_dict, weight_mapping):
        read_config = hf_ds.deepspeed_config
        hf_ds.deepspeed_config = lambda: without_training_tp(read_config())
        try:
            conversions = original(model, state_dict, weight_mapping)
            if isinstance(conversions, dict):  # transformers 5.22: converts at once, the guard ran in the call
                return conversions
            # transformers 5.23 and later: a generator, the guard runs at its first step; hide TP for that step only
            first = next(conversions, None)
        finally:
            hf_ds.deepspeed_config = read_config
        return _resumed(first, conversions)

    def _resumed(first, rest):
        if first is not None:
            yield first
            yield from rest

    setattr(convert, _UNGUARDED, True)
    convert.__wrapped__ = original
    setattr(hf_ds, _CONVERSIONS, convert)


# transformers 5.24 `Trainer._tr_loss` is the running loss tensor that `_maybe_log_save_evaluate` resets with
# `tr_loss -= tr_loss`, which keeps a NaN forever (stability/gradient_health.py). Can go when the Trainer resets a
# non-finite running loss itself.
def reset_nonfinite_running_loss(trainer) -> None:
    """Zero the Trainer's running loss when it is not finite (after the log that showed the NaN)."""
    import torch  # here: the CLI imports this module and must not pay for torch

    running = getattr(trainer, "_tr_loss", None)
    if isinstance(running, torch.Tensor) and not bool(running.isfinite().all()):
        running.zero_()


# transformers 5.25 `Trainer.log(logs, start_time)` appends `{**logs, "step": global_step}` to `state.log_history`, a
# copy, once per call and before `callback_handler.on_log(..., logs)`, which hands every integration `logs` itself.
# So a key can reach the integrations and leave the history: dropped from that copy after the stock log. Nothing
# public says where the entry comes from. Can go when the Trainer's log takes values meant for the integrations only
# (tests/unit/test_compat.py::test_the_stock_log_appends_a_copy_of_its_logs_to_the_history).
def log_outside_history(trainer, log, logs: dict, keys, start_time: float | None = None) -> None:
    """Call the stock `log(logs, start_time)` (`Trainer.log`, bound) and leave `keys` out of the `log_history` entry
    it appends; the integrations still receive them."""
    history = trainer.state.log_history
    before = len(history)
    log(logs, start_time)
    if keys and len(history) > before:
        for key in keys:
            history[-1].pop(key, None)


# transformers 5.25 `get_scheduler` (which `Trainer.create_scheduler` calls) hands `lr_scheduler_kwargs` to the
# function `optimization.TYPE_TO_SCHEDULER_FUNCTION` (not documented) holds for the type, so a key that function does
# not take is Python's TypeError naming it; the recipe's earlier error starts with the same sentence
# (tests/unit/test_upstream_messages.py). Goes when the recipe leaves that check to the Trainer.
def scheduler_function_name(schedule) -> str:
    """The name of the function the stock Trainer builds a `schedule` (a `SchedulerType`) with."""
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

    return TYPE_TO_SCHEDULER_FUNCTION[schedule].__name__


# transformers 5.24 `core_model_loading.py:2024 revert_weight_conversion(model, state_dict)`: the reverse of the
# conversions `from_pretrained` applied (e.g. fused experts -> one tensor per expert), the layout on disk;
# `save_pretrained` calls it on each shard (modeling_utils.py:3612). Public name, undocumented module (the "Dynamic
# weight loading" guide documents WeightConverter, not this). Goes when transformers documents it or a public
# equivalent (the layout `save_pretrained` writes for a given state dict).
def to_disk_layout(model, tensors: dict) -> dict:
    """`tensors` (in-memory names of `model`) renamed and reshaped to the layout `save_pretrained` writes."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


# overrides run before the Trainer's and call it through super(). Covered: transformers 5.24 (signatures and call
# sites checked by tests/unit/test_compat.py::test_the_private_trainer_methods_the_recipe_overrides).
class TrainerPrivateOverrides:
    """Mixin of `RecipeTrainerMixin`: the overrides of private `Trainer` methods, each with when it can go."""

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers 5.23-5.25 `Trainer._get_grad_norm(model, grad_norm=None)`: called once per optimizer step by
        `_run_epoch` before `on_pre_optimizer_step`, with the clip call's pre-clip norm, or None when
        `max_grad_norm == 0` skips the clip (it then computes the norm unclipped); returns the norm the Trainer
        logs. Both branches pass here, so the recipe callbacks hear the norm clipped or not (`on_grad_norm`: the
        gradient-health spike detector). Can go when a public hook receives the pre-clip norm (in 5.25
        `on_pre_optimizer_step` gets none; `on_optimizer_step` neither)."""
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.call_recipe_event("on_grad_norm", grad_norm=norm)
        return norm

    def _load_callback_state(self):
        """transformers 5.24 `Trainer._load_callback_state()`: on a resume with
        `restore_callback_states_from_checkpoint`, it rebuilds each stateful callback as `type(cb)(**saved_args)`
        and appends the new one through the callback handler, not `Trainer.add_callback`: a recipe callback rebuilt so
        has no runtime. The run's is handed to it, and it takes its role (`RecipeCallbacks.replaced_by`). Can go when
        the Trainer restores a callback's state into the instance it holds (or calls a public hook after restoring)."""
        held = list(self.callback_handler.callbacks)
        super()._load_callback_state()
        rebuilt = [c for c in self.callback_handler.callbacks if not any(c is h for h in held)]
        self.hand_runtime(rebuilt)
        self.recipe_callbacks = self.recipe_callbacks.replaced_by(rebuilt)

    def _save_checkpoint(self, model, trial):
        """transformers 5.25 `Trainer._save_checkpoint(model, trial)`, which `_maybe_log_save_evaluate` calls before
        `on_save`: it writes checkpoint-N and then rotates (`rotate_checkpoints` with `args.save_total_limit`), so
        at `save_total_limit=1` the last complete checkpoint is gone before the new one is, and a half-written one
        counts. A save the disk cannot hold is not begun, a failed one is explained, and a folder saved into again
        first loses its old manifest (`start_checkpoint`, `failed_checkpoint`). The
        stock rotation is off for the call (the limit is None only meanwhile, so the checkpoint's training_args.bin
        records None); then `finish_checkpoint` makes it complete (fsync, barrier, the manifest)
        and rotates complete checkpoints only (`hf_dist_recipes.checkpoint.manifest`). Can go when the Trainer
        offers a hook after a checkpoint's files and before its rotation, or rotation by a callable."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.start_checkpoint(folder)
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as error:  # torch's full-disk error is a RuntimeError
            self.failed_checkpoint(folder, error)
            raise
        finally:
            self.args.save_total_limit = limit
        self.finish_checkpoint(folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers 5.23-5.25 `Trainer._load_optimizer_and_scheduler(checkpoint)`: on a resume `train()` calls it
        right after `deepspeed_load_checkpoint`; under DeepSpeed it loads nothing itself. Here CPU Adam's step state
        is replayed to the uninterrupted run's (`_compat.deepspeed.replay_cpu_adam_steps`). Can go with the
        `cpu_adam_resumed_step` workaround."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.is_deepspeed_enabled:
            from hf_dist_recipes._compat.deepspeed import replay_cpu_adam_steps

            replay_cpu_adam_steps(self.model_wrapped.optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers 5.24 `Trainer._load_from_checkpoint(resume_from_checkpoint, model=None)`, which `train()`
        calls on resume: without DeepSpeed it restores MoE experts too, through `from_pretrained`'s conversion
        (`resume_needs_conversion`, below). Can go when transformers PR 48822 (issue 48805) is released and the
        minimum transformers includes it (equal losses after resume: tests/unit/test_moe_resume.py)."""
        target = self.model if model is None else model
        if needed("moe_resume_conversion") and resume_needs_conversion(self, resume_from_checkpoint, target):
            load_converted_checkpoint(target, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


# Evaluation before training under DeepSpeed. transformers 5.24 (PR huggingface/transformers#44889, open; #30205 for
# ZeRO-2): an evaluation before training builds an inference-only engine and keeps it as `model_wrapped`; `train()`
# then destroys it (`accelerator.free_memory()`), sees a model that looks wrapped, skips preparing it and stops in
# `accelerator.backward` ('NoneType' object has no attribute 'backward'). The evaluation also finalized the DeepSpeed
# config, which accelerate and the Trainer share as one dict (`deepspeed_plugin.hf_ds_config.config`), for zero
# steps and dropped its `optimizer` block. And AutoTP/AutoEP would rewrite the model in place for that engine
# (DeepSpeed 0.19.8 cannot rewrite it a second time: "AutoEP: no MoE layers detected" when train() builds its engine).
# Covered: transformers 5.24, accelerate 1.16, deepspeed 0.19.8; can go when #44889 is released and the evaluation
# engine no longer shares the training config (equal losses: tests/distributed/test_checkpoint_lifecycle.py).
def restore_deepspeed_config(trainer, config: dict) -> None:
    """Put `config` (the snapshot taken when the trainer was built) back into the dict accelerate shares."""
    import copy

    shared = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    shared.clear()
    shared.update(copy.deepcopy(config))


def forget_evaluation_engine(trainer, config: dict) -> None:
    """Before `train()`: drop an engine an earlier evaluation built, and restore the training config."""
    if not needed("evaluation_before_training"):
        return
    if trainer.is_deepspeed_enabled and trainer.model_wrapped is not trainer.model:
        restore_deepspeed_config(trainer, config)
        trainer.model_wrapped, trainer.deepspeed = trainer.model, None


@contextlib.contextmanager
def evaluation_without_model_parallelism(trainer, config: dict):
    """Before training, build the evaluation engine as plain ZeRO-3 (no AutoTP/AutoEP sections), so the training
    engine applies TP and EP to the untouched model; the evaluation's numbers are the same (TP/EP only split work)."""
    if not needed("evaluation_before_training") or not trainer.is_deepspeed_enabled or trainer.deepspeed is not None:
        yield
        return
    shared = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    for key in ("tensor_parallel", "expert_parallel"):
        shared.pop(key, None)
    try:
        yield
    finally:
        restore_deepspeed_config(trainer, config)


# Resume of a model whose checkpoint layout differs from its parameters (MoE experts). transformers 5.24
# `Trainer._load_from_checkpoint` (and `_load_best_model`), without DeepSpeed or FSDP, reads the checkpoint's
# safetensors and calls `model.load_state_dict(state_dict, False)`: no weight conversion. `save_pretrained` writes
# the hub layout (one tensor per expert, `experts.<i>.gate_proj.weight`), the model holds fused experts
# (`experts.gate_up_proj`), so the experts keep their fresh values and only a warning says so (transformers issue
# 48805; PR 48822, open). `from_pretrained` applies the conversion: a checkpoint whose tensor names are not the
# model's is loaded through it and copied in, all names checked. Covered: transformers 5.24. Gate and when it goes:
# `WORKAROUNDS["moe_resume_conversion"]`.
def checkpoint_tensor_names(checkpoint_dir: str) -> set[str] | None:
    """Tensor names of the safetensors weights in `checkpoint_dir` (single file or sharded index); None if none."""
    import json

    from safetensors import safe_open

    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint_dir, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def resume_needs_conversion(trainer, checkpoint_dir: str, model) -> bool:
    """True when the stock resume would load `checkpoint_dir` into `model` by names that do not match."""
    from transformers import PreTrainedModel

    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
        return False
    names = checkpoint_tensor_names(checkpoint_dir)
    return names is not None and names != set(model.state_dict())


def load_converted_checkpoint(model, checkpoint_dir: str) -> None:
    """Load `checkpoint_dir`'s weights into `model` through `from_pretrained`'s conversions (strict: every
    parameter and buffer must come from the checkpoint)."""
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(checkpoint_dir, config=model.config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded


# torch's flight-recorder analyser, used as a library by comm/hang_report.py. torch 2.13 ships it as
# `torch.distributed.flight_recorder` (the `fr_trace` script; its `components` modules are not documented API):
# `build_groups_memberships(pg_config)` -> the groups and their ranks, `align_trace_from_beginning(entries)` -> every
# rank's entries from the first record all ranks still hold, `build_collectives(entries, ...)` -> one `Collective`
# per matched or unmatched collective, matched by (group, collective_seq_id) with `Op.match` (op, input/output sizes,
# all_gather's world-size rule, dtypes, state); the first mismatch of a group has `pass_check` False and either
# `missing_ranks` (members with no entry at that sequence id) or `mismatch_collectives` {rank: Collective whose
# `type_of_mismatch` is a `MatchInfo` (`.state.name`, `.culprit` text)}. It logs its findings on the "Flight
# Recorder" logger (silenced here: the report says them) and assumes NCCL's `pg_config`; Gloo's names its groups ""
# with no ranks (seen on torch 2.13), so the caller passes the groups it rebuilt from the entries. Covered: torch
