"""Preflight checks 5 ("training") and 6 ("failure_paths"): short real training runs under the user's launch.

Runs inside `accelerate launch` on every rank, so the runs get the launch's DeepSpeed config (ZeRO stage, AutoTP
and AutoEP degrees, precision) exactly as the user's job will: the arguments are `RecipeTrainingArguments`, the
trainer `RecipeTrainer`, nothing is re-implemented here. `run_training_checks` (`checks`) is the one entry point;
every rank returns the same list of `CheckResult`s (each rank's measurements, `facts.RunFacts`, are gathered and
every rank decides from the same data in `verdicts`), one row per finding. `run` makes one run, with `trainer`'s
`PreflightTrainer` (RecipeTrainer plus a digest of each batch), its step recorder and its NaN hook.

The model: `model_config` built whole on every rank by its class (not under `zero.Init`), so that what each rank
built is compared across ranks by the rank-agreement check (under `zero.Init` rank 0's init is broadcast and there
is nothing to compare); the engine then partitions and slices it as the plan says. The data: the demo's
(`hf_dist_recipes.demo.data.stdlib_dataset`), the standard library's Python source as byte blocks of SEQ_LEN, which
a small model learns within a few steps. Peak learning rate LEARNING_RATE (3e-3; what the tiny models of the tests
train at), micro batch MICRO_BATCH (4): both unless the DeepSpeed JSON fixes them (a generated JSON's "auto" micro
batch is the one its recorded plan was sized for); the schedule, clipping and every other setting are the recipe's
defaults or the JSON's values.

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
  by step k + 3), counted one skip (`trainer.gradient_health`, whose report for the step names the rank whose loss
  it was), and logged a `nonfinite_event` at that step. Under TP the NaN also reaches that rank's TP partners'
  gradients (TP's backward all-reduces activation gradients in the group, `core.layout.RankLayout.tp_group`): they
  may be flagged too, no rank outside the group.
When the training run failed, both rows are errors ("not run").

Output folders under `output_dir`: `training/` (the main run and its checkpoint), `tensorboard/` (its per-rank
TensorBoard runs), `failure_paths/` (the resumed run, its own logs). Any of them already holding files (an earlier
preflight, or a real job's output) stops the checks before they run, with a ValueError on every rank: nothing is
deleted.
"""

from hf_dist_recipes.preflight.training.checks import run_training_checks

__all__ = ["run_training_checks"]
