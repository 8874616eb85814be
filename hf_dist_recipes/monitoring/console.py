"""The console: what a person reads while a job runs; the rest is in TensorBoard.

The stock progress callbacks (`ProgressCallback` under tqdm, `PrinterCallback` with `disable_tqdm=True`) print
every key of every log. Under RecipeTrainer a training log also holds the tokens per expert (for the demo model 24
keys) and the periodic rank check, so `make demo` printed dicts of about 45 keys. RecipeTrainer replaces those two
callbacks (exactly those classes: a notebook's progress table or a user's own printer stays) by the subclasses here,
which print the same way, with the same arguments, but leave out the keys our callbacks add except the counts of
skipped steps and spikes: a training line shows loss, grad_norm, learning_rate, epoch, skipped_steps, loss_spikes,
grad_norm_spikes (and any key of the user's own). Evaluation and end-of-run lines keep every Trainer key. At train
begin they print, once, where the rest is: the per-rank TensorBoard folder.

Only the printed copy is filtered: `log_history`, `report_to` and TensorBoard get every key they got before. The
per-rank values (system, stragglers, event texts) never reach the console: they join the log after it
(`monitoring/pending.py`).

Events (a spike, a skipped step, ranks that disagree, NVML missing on a GPU run) are said once, by global rank 0,
naming the rank(s) they are about (`warn_once`, `rank_list`): every rank knows them alike, because they come from
values the ranks gathered or agreed on, and a line from each rank said the same thing N times with no rank named
(`make demo` printed each spike twice, issue 30). Each rank's own logs (TensorBoard, its summary) still keep them.

The stack's own repeats are filtered where the recipe's arguments are made, in every rank (`quiet_the_stack`, off
with `filter_stack_warnings=False`): torch's FutureWarning for each collective DeepSpeed calls (a user's script
printed 364 of them in 20 steps, issue 42), and DeepSpeed's "Setting accelerator to CPU" from every rank of a CPU
run. The replicas' transformers logs stop at errors (`log_level_replica="error"`, a recipe default): a tokenizer or
config warning every rank meets alike is said by rank 0.
"""

from __future__ import annotations

import logging
import os
import warnings

from transformers import PrinterCallback, ProgressCallback

from hf_dist_recipes.core.findings import rank_list as rank_list  # console's name for it (warn_once's messages)
from hf_dist_recipes.core.gather import distributed

# Keys our callbacks add that the console leaves to TensorBoard (expert_load.py, rank_agreement.py,
# system_metrics.py, stragglers.py, gradient_health.py, rank_series.py); skipped_steps, loss_spikes,
# grad_norm_spikes are shown.
HIDDEN_PREFIXES = ("experts/", "rank_check/", "system/", "gpu/", "straggler/", "per_rank/")
HIDDEN_KEYS = frozenset({"nonfinite_event", "spike_event", "straggler_event"})

# torch 2.13 and later deprecate collectives DeepSpeed 0.19 calls (`all_gather_into_tensor`, `reduce_scatter_tensor`),
# one FutureWarning per call, every step, on every rank: noise to a user, whose code does not make the calls.
STACK_WARNINGS = ({"message": r".*is deprecated. Please use `torch.distributed", "category": FutureWarning},)


def quiet_the_stack(*, cpu_run: bool) -> None:
    """Ignore the `STACK_WARNINGS` in this process, and on a CPU run (`cpu_run`) name DeepSpeed's accelerator
    (`DS_ACCELERATOR=cpu`, where unset) so that DeepSpeed does not warn from every rank that it detected none; it
    picks the CPU then all the same."""
    for rule in STACK_WARNINGS:
        warnings.filterwarnings("ignore", **rule)
    if cpu_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def console_logs(logs: dict) -> dict:
    """`logs` without the keys the console leaves to TensorBoard (a new dict; `logs` is not changed)."""
    return {k: v for k, v in logs.items() if k not in HIDDEN_KEYS and not k.startswith(HIDDEN_PREFIXES)}


def where_the_rest_is(args) -> str | None:
    """The line naming the per-rank TensorBoard folder, or None when the arguments write no per-rank runs."""
    if not getattr(args, "per_rank_tensorboard", False):
        return None
    return f"Per-rank logs (system, experts, rank checks, events): tensorboard --logdir {args.logging_dir}"


class RecipeProgressCallback(ProgressCallback):
    """`ProgressCallback` printing `console_logs` of each log, and the TensorBoard folder at train begin."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        line = where_the_rest_is(args)
        if line and state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(line)

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class RecipePrinterCallback(PrinterCallback):
    """`PrinterCallback` printing `console_logs` of each log, and the TensorBoard folder at train begin."""

    def on_train_begin(self, args, state, control, **kwargs):
        line = where_the_rest_is(args)
        if line and state.is_local_process_zero:
            print(line)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.pop("total_flos", None)  # as the stock callback does, for every callback after it
        super().on_log(args, state, control, logs=None if logs is None else console_logs(logs), **kwargs)


def use_recipe_console(trainer, held) -> None:
    """Replace the trainer's stock `ProgressCallback` / `PrinterCallback` among `held` (the callbacks it holds) by
    the ones above (public `remove_callback` / `add_callback`; the Trainer adds its progress callback last, so the
    order is kept when this runs right after `Trainer.__init__`)."""
    for callback in held:
        if type(callback) is ProgressCallback:
            replacement = RecipeProgressCallback(max_str_len=callback.max_str_len)
        elif type(callback) is PrinterCallback:
            replacement = RecipePrinterCallback()
        else:
            continue
        trainer.remove_callback(callback)
        trainer.add_callback(replacement)


def on_rank_zero() -> bool:
    """True on global rank 0, and in a process outside any process group (one process, a notebook)."""
    if not distributed():
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0


def warn_once(logger: logging.Logger, message: str, *args) -> None:
    """`logger.warning(message, *args)` on global rank 0 only, for an event every rank holds alike; the message
    names the rank(s) it is about."""
    if on_rank_zero():
        logger.warning(message, *args)
