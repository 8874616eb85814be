"""Practice 5 while the job runs: a non-finite loss or gradient on any rank is found, skipped on every rank or
stopped with a report, never averaged away; loss and gradient-norm spikes are named.

Why one file of about 540 lines, 95 of them this docstring: finding, deciding and skipping are one protocol whose
order inside a step is the correctness argument (the flag set before the engine's check, the decision after the
clip and before the optimizer, one collective for all of it); the pieces that stand alone live beside it
(`nonfinite.py` for the report and halt, `spikes.py` for the spike rules).

`GradientHealthCallback` (registered by `RecipeTrainer`, one per trainer) works like this.

Finding a non-finite value, per rank, without a host sync per micro-step:
- the loss: `RecipeTrainer.compute_loss` hands each training micro-batch's loss to `on_micro_batch_loss` (a
  `RecipeCallback` event, `hf_dist_recipes.runtime`), which ORs
  `~isfinite(loss)` into a device flag and returns the loss multiplied by 1 (finite: bit-for-bit the same loss)
  or by NaN (non-finite). The multiplication makes every gradient of that rank NaN, so a non-finite loss whose
  gradients happened to be finite can never be applied by an engine that only looks at gradients;
- the gradients, under DeepSpeed ZeRO-3: each bucket of the rank's own gradients, just before the engine
  reduce-scatters it (`_compat.deepspeed.watch_zero3_gradients`), gets one 2-norm per parameter from one fused call
  (`_compat.torch.tensor_norms`), added into one float32 slot per parameter (on CPU, where reading a value waits for no
  device, one 2-norm over the bucket first, and the norms only when it is not finite): a few kernels per bucket, and
  DeepSpeed keeps one bucket per backward at its default `reduce_bucket_size` (5e8 elements). A hook per parameter
  tensor instead costs a Python call and a kernel per tensor per micro-step (see
  benchmarks/results/2026-12-03-training-checks-cpu.md);
- the gradients, everywhere else (one process, DDP, ZeRO-1/2): a tensor hook on every trainable parameter
  (registered at train begin, after the engine built the model) keeps the gradient's float32 2-norm; once per step
  they are added into the same slots.
NaN and Inf survive a norm, so a non-finite slot means that parameter's *local* gradient (before any reduction) was
non-finite on this rank. A finite gradient whose float32 norm overflows also counts. The same norms, squared and
summed, give this rank's *local gradient norm* (its own gradient before the reduction; with gradient accumulation
the root of the sum of its micro-batches' squared norms), which names the rank of a gradient-norm spike.

Deciding, once per optimizer step, in `on_pre_optimizer_step` (after the clip and `on_grad_norm`, before
`optimizer.step()`):
- DeepSpeed ZeRO-3: the engine has already decided, the same way on every rank: its `step` all-reduces the global
  gradient norm, which is non-finite exactly when some rank's gradient is (a NaN survives the reduce-scatter), and
  refuses the step when it is (see below). A healthy step (applied, norm finite) needs no collective of ours: its
  spike checks wait, with this rank's loss and local gradient norm, for a step that logs, saves or stops, where one
  all-reduce of the waiting values (each rank its own row of a zeroed table) gives every rank's loss (their mean is
  the step's loss) and local norm of each waiting step, and the checks run in step order (the events reach the same
  log as they would at once; the warnings come at that log). Only a refused step gathers (`all_gather_object`) each
  rank's loss flag and the names of the parameters whose slots are non-finite, for the report.
- Elsewhere: one all-reduce (SUM) of `3 x world_size` float64 values, each rank writing its own slots (its flag,
  its mean micro-batch loss, its local gradient norm), tells every rank which ranks saw a non-finite value and
  every rank's loss and norm. Only when a flag is set, a second collective (`all_gather_object`) collects the
  parameter names.

Skipping the same step on every rank (`nonfinite_policy="skip"`, the default):
- DeepSpeed: accelerate's `DeepSpeedEngineWrapper.backward` runs `engine.backward` *and* `engine.step` inside
  `training_step`, so the step has already been taken or refused when the Trainer's hooks run. DeepSpeed 0.19.8
  ZeRO-3 refuses it on every rank itself when the global gradient norm is not finite (`stage3.py step`:
  `is_invalid_grad_norm` -> overflow -> grads cleared, no optimizer update; in fp16 also `has_overflow`), the
  engine then does not step its scheduler (`_take_model_step`) and `engine.was_step_applied()` is False. The
  poisoned loss above guarantees that a non-finite loss on one rank reaches that check (reduce-scatter spreads the
  NaN to every partition). What DeepSpeed does not do is say so: its skip is one "OVERFLOW! Skipping step" line
  from rank 0, nothing in the Trainer's logs, no rank, no parameter, no limit. Here the skip is verified
  with accelerate's public `optimizer.step_was_skipped` (the engine optimizer's `overflow`; the Trainer reads the
  same to leave its own scheduler alone), counted and reported. If the engine applied a step our flag called
  non-finite (or, under ZeRO-3, whose global norm was not finite), the weights can no longer be trusted and the
  job halts.
- Without DeepSpeed (one process, DDP): the decision comes before `optimizer.step()`. Every rank drops its
  gradients (`optimizer.zero_grad(set_to_none=True)`: torch optimizers leave parameters without a gradient and
  their state untouched) and marks the step skipped on accelerate's optimizer
  (`_compat.accelerate.mark_optimizer_step_skipped`), which makes the Trainer leave the scheduler alone
  (`accelerator.optimizer_step_was_skipped`) as it does after an fp16 overflow. With a GradScaler (fp16) the gradients
  are set to NaN instead, and the scaler skips.
- The Trainer's running loss would stay NaN for the rest of the run (`tr_loss -= tr_loss` keeps a NaN);
  `RecipeTrainer.log` resets it after the log that shows the NaN (`_compat.transformers.reset_nonfinite_running_loss`).
  `global_step` still counts the skipped step; its batch is not retried.

Halting (`nonfinite_policy="halt"`, or more than `max_consecutive_skips` skips in a row): the bad step is
skipped as above, the last good state saved, and every rank raises `NonFiniteHalt` with the report
(`stability.nonfinite`).

Spikes: each applied step's loss (mean over ranks) and pre-clip gradient norm go to a `SpikeDetector` per value
(`stability.spikes`: robust z-score against the last `spike_window` values). A spike names the rank with the
highest own value at that step (its loss; its local gradient norm), against the median over ranks.

Keys added to the next Trainer log (the runtime's `LogSink`):
- `skipped_steps` (every log): optimizer steps skipped for a non-finite value since the run began;
- `loss_spikes`, `grad_norm_spikes` (every log): spikes found since the run began;
  these three in the `history` channel, at each step that logs: `log_history`, every `report_to` integration, the
  console and TensorBoard (as `train/<key>`) get them, and a resumed run logs them alike (saved in checkpoints,
  below);
- `nonfinite_event` (text, in the first log after a skip): "step 5: non-finite loss/gradient on rank(s) 1 ...";
- `spike_event` (text, in the first log after a spike);
  these two in the `rank` channel, for the per-rank TensorBoard run (text `train/<key>`) and the rank summary's
  `events`: text stays out of `log_history` and `report_to`.
Every rank holds the same events (they come from gathered values), so the console gets each one once: a warning
line from global rank 0 (`monitoring.console.warn_once`), naming the rank(s).
State saved in checkpoints (`ExportableState`): the counters, the consecutive-skip count, the steps skipped (last
100), and both spike windows; a resumed run continues them (read back at train begin from the checkpoint's trainer
state, whether or not `restore_callback_states_from_checkpoint` is set).

fp16 (`args.fp16`): a step whose gradients overflow under a finite loss is the loss scaler's own skip (it halves the
scale and tries again), counted in `loss_scale_overflows` only, never as a non-finite step; a non-finite loss still
is one.

`nonfinite_policy="off"` registers nothing per step (no hooks, no all-reduce): the stock behaviour, where
DeepSpeed ZeRO-3 skips silently and a plain optimizer applies the NaN.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics

import torch
from transformers.trainer_callback import ExportableState

from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes._compat import deepspeed as compat_deepspeed
from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.core.gather import distributed, gather_objects
from hf_dist_recipes.monitoring.console import warn_once
from hf_dist_recipes.runtime import RecipeCallback
from hf_dist_recipes.stability.nonfinite import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    REPORT_NAME,
    NonFiniteHalt,
    NonFinitePolicy,
    NonFiniteReport,
    next_action,
    validate_max_consecutive_skips,
    validate_nonfinite_policy,
)
from hf_dist_recipes.stability.spikes import (
    DEFAULT_SPIKE_THRESHOLD,
    DEFAULT_SPIKE_WINDOW,
    SpikeDetector,
    highest_rank,
    validate_spike_settings,
)

logger = logging.getLogger(__name__)

_SKIPS_KEPT = 100
_COUNTERS = ("skipped_steps", "loss_spikes", "grad_norm_spikes")  # the run-long counters every log carries
# state(): the constructor's arguments and the attributes a checkpoint keeps
_STATE = {
    "args": ("nonfinite_policy", "max_consecutive_skips", "spike_window", "spike_threshold"),
    "attributes": ("consecutive_skips", "skipped_at", "loss_window", "grad_norm_window", *_COUNTERS),
}


def _under_deepspeed(optimizer) -> bool:
    """accelerate wraps the engine's optimizer in this class; its `step_was_skipped` is the engine's `overflow`."""
    from accelerate.utils import DeepSpeedOptimizerWrapper

    return isinstance(optimizer, DeepSpeedOptimizerWrapper)


class GradientHealthCallback(RecipeCallback, ExportableState):
    """See the module docstring. Built by `RecipeTrainer` from the arguments' fields of the same names; the trainer
    feeds it each micro-batch's loss and the pre-clip norm (`RecipeCallback` events)."""

    def __init__(
        self,
        nonfinite_policy: NonFinitePolicy = "skip",
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        spike_window: int = DEFAULT_SPIKE_WINDOW,
        spike_threshold: float = DEFAULT_SPIKE_THRESHOLD,
    ):
        self.nonfinite_policy = validate_nonfinite_policy(nonfinite_policy)
        self.max_consecutive_skips = validate_max_consecutive_skips(max_consecutive_skips)
        self.spike_window, self.spike_threshold = validate_spike_settings(spike_window, spike_threshold)
        # State kept in checkpoints (see state()).
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.skipped_at: list[list] = []  # [step, [ranks]] of the last 100 skips
        self.loss_spikes = 0
        self.grad_norm_spikes = 0
        self.loss_window: list[float] = []
        self.grad_norm_window: list[float] = []
        # Per run, not saved.
        self.loss_scale_overflows = 0  # fp16 loss-scaler overflows: the scaler's own skips, not counted above
        self._hooks: list = []
        self._names: list[str] = []
        self._grad_sums: torch.Tensor | None = None
        self._sum_index: list[int] = []
        self._sum_values: list[torch.Tensor] = []
        self._loss_bad: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._micro_steps = 0
        self._grad_norm: float | None = None
        self._local_sq: torch.Tensor | None = None  # this step's squared local gradient norm (module docstring)
        # DeepSpeed ZeRO-3: gradients watched per bucket (`_compat.deepspeed.watch_zero3_gradients`), the engine
        # decides.
        self._zero3 = False
        self._optimizer = None
        self._index: dict[int, int] = {}  # id(parameter) -> its slot in _grad_sums
        # (step, this rank's loss tensor or None, its local gradient norm tensor, grad norm) awaiting spike checks
        self._unchecked: list[tuple] = []
        self._skipping = False  # this step's optimizer step is being skipped (non-DeepSpeed: undo the mark after)
        self.halt_report: NonFiniteReport | None = None
        self.reports: list[NonFiniteReport] = []  # this run's last _SKIPS_KEPT reports, for callers to read
        # (step, every rank's local gradient norm at it) of the last step checked; None before the first
        self.rank_norms: tuple[int, list[float]] | None = None

    # ExportableState
    def state(self) -> dict:
        return {key: {name: getattr(self, name) for name in names} for key, names in _STATE.items()}

    @property
    def active(self) -> bool:
        return self.nonfinite_policy != "off"

    # Fed by the trainer (RecipeCallback events)
    def on_micro_batch_loss(self, args, state, control, loss: torch.Tensor, **kwargs) -> torch.Tensor:
        """Record a training micro-batch's loss; return it unchanged if finite, else multiplied by NaN."""
        if not self.active or not isinstance(loss, torch.Tensor):
            return loss
        value = loss.detach()
        finite = torch.isfinite(value).all()
        if self._loss_bad is None or self._loss_bad.device != value.device:
            self._loss_bad = torch.zeros((), dtype=torch.bool, device=value.device)
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=value.device)
        self._loss_bad |= ~finite
        self._loss_sum += value.double().mean()
        self._micro_steps += 1
        return loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)

    def on_grad_norm(self, args, state, control, grad_norm, **kwargs) -> None:
        """The pre-clip global gradient norm of this step (clipped or not)."""
        norm = grad_norm
        if norm is None:
            self._grad_norm = None
            return
        self._grad_norm = float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    # TrainerCallback
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        # A resume loads the checkpoint's TrainerState, which holds what state() returned when it was saved; the
        # Trainer itself restores it only with restore_callback_states_from_checkpoint=True (default False).
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, dict) and state.global_step > 0:
            for key, value in saved.get("attributes", {}).items():
                setattr(self, key, value)
        if not self.active or model is None:
            return
        self._log_counters()
        self._remove_hooks()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in params]
        self._grad_sums = torch.zeros(len(params), dtype=torch.float32, device=args.device)
        self._local_sq = torch.zeros((), dtype=torch.float64, device=args.device)
        if compat_deepspeed.watch_zero3_gradients(optimizer, self._observe_bucket):
            self._zero3, self._optimizer = True, optimizer
            self._index = {id(p): i for i, (_, p) in enumerate(params)}
            return
        for i, (_, p) in enumerate(params):
            self._hooks.append(p.register_hook(self._grad_hook(i)))

    @torch.no_grad()
    def _observe_bucket(self, params: list, flat: torch.Tensor | None) -> None:
        # A few kernels per bucket (one bucket per backward at DeepSpeed's default 5e8 elements), not per tensor.
        if flat is not None and flat.device.type == "cpu":
            # A norm, not a sum: it also gives the local gradient norm a spike names the rank by. Measured on the
            # demo's 1,012,224 gradients, one CPU thread: 140 us per micro-step (the sum it replaced: 55 us).
            norm = float(torch.linalg.vector_norm(flat, dtype=torch.float32))
            if math.isfinite(norm):
                self._local_sq += norm * norm
                return  # all finite: one norm, and reading a CPU tensor waits for no device (on GPU it would sync)
        index = [self._index.get(id(p), -1) for p in params]
        if -1 in index:  # not a parameter of the model seen at train begin: nothing to name it by
            params = [p for p, i in zip(params, index, strict=True) if i >= 0]
            index = [i for i in index if i >= 0]
        if not params:
            return
        # One fused call for all the bucket's norms; NaN and Inf survive them.
        norms = compat_torch.tensor_norms([p.grad for p in params]).to(self._grad_sums.device)
        self._local_sq += norms.double().square().sum()
        self._grad_sums.index_add_(0, torch.tensor(index, device=self._grad_sums.device), norms)

    def _grad_hook(self, index: int):
        # One reduction per gradient and nothing else on the hot path; the norms are placed once per step.
        def hook(grad):
            self._sum_index.append(index)
            self._sum_values.append(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32))

        return hook

    def _collect_grad_sums(self) -> None:
        if self._sum_values:
            index = torch.tensor(self._sum_index, device=self._grad_sums.device)
            norms = torch.stack(self._sum_values).to(self._grad_sums.device)
            self._local_sq += norms.double().square().sum()
            self._grad_sums.index_add_(0, index, norms)
            self._sum_index, self._sum_values = [], []

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def on_train_end(self, args, state, control, **kwargs):
        self._check_unchecked()  # normally done already at the last step (should_training_stop)
        self._remove_hooks()
        if self._zero3:
            compat_deepspeed.unwatch_zero3_gradients(self._optimizer)
            self._zero3, self._optimizer = False, None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        if not self.active:
            return
        self.runtime.require_fed(
            "loss", "GradientHealthCallback", "every training micro-batch's loss (RecipeTrainer.compute_loss)"
        )
        step = state.global_step + 1  # the step being taken now; global_step counts it after on_optimizer_step
        if self._zero3:
            self._zero3_step(args, state, control, optimizer, step)
            self._reset_step()
            return
        if self._grad_sums is not None:
            self._collect_grad_sums()
        bad_params = (
            ~torch.isfinite(self._grad_sums) if self._grad_sums is not None else torch.zeros(0, dtype=torch.bool)
        )
        device = self._grad_sums.device if self._grad_sums is not None else args.device
        loss_bad = (
            self._loss_bad.to(device)
            if self._loss_bad is not None
            else torch.zeros((), dtype=torch.bool, device=device)
        )
        # The slots of the collective below: the process group's own ranks.
        world = torch.distributed.get_world_size() if distributed() else 1
        rank = torch.distributed.get_rank() if distributed() else 0
        # Each rank's slots: its flag, its mean micro-batch loss, its local gradient norm.
        flags = torch.zeros(3 * world, dtype=torch.float64, device=device)
        flags[rank] = (loss_bad | bad_params.any()).double() + 2 * loss_bad.double()  # 1: gradient, 3: loss too
        if self._micro_steps:
            flags[world + rank] = self._loss_sum.to(device) / self._micro_steps
        if self._local_sq is not None:
            flags[2 * world + rank] = self._local_sq.to(device).sqrt()
        if world > 1:
            torch.distributed.all_reduce(flags)  # the one collective of a healthy step
        values = flags.tolist()
        ranks = [r for r in range(world) if values[r] > 0]
        loss_ranks = [r for r in range(world) if values[r] > 2]
        rank_losses, rank_norms = values[world : 2 * world], values[2 * world :]
        engine_skipped = _under_deepspeed(optimizer) and bool(optimizer.step_was_skipped)
        if getattr(args, "fp16", False) and not loss_ranks and (ranks or engine_skipped):
            # fp16 dynamic loss scaling: inf gradients under a finite loss are the scaler's overflow, which it
            # skips by itself and answers by halving the scale (several in a row at the start of every run).
            # Counting them would halt a healthy fp16 run after max_consecutive_skips.
            self.loss_scale_overflows += 1
            self._reset_step()
            return
        if ranks or engine_skipped:
            gathered = gather_objects([n for n, bad in zip(self._names, bad_params.tolist(), strict=True) if bad])
            parameters = {r: names for r, names in enumerate(gathered) if names}
            # Under DeepSpeed the step is already taken: one our flags call non-finite must have been refused.
            applied = _under_deepspeed(optimizer) and bool(ranks) and not engine_skipped
            self._nonfinite_step(args, control, optimizer, step, ranks, loss_ranks, parameters, applied)
        else:
            self.consecutive_skips = 0
            loss = sum(rank_losses) / world if self._micro_steps else None
            self._check_spikes(step, loss, self._grad_norm, rank_losses, rank_norms)
        self._reset_step()

    def _zero3_step(self, args, state, control, optimizer, step: int) -> None:
        """DeepSpeed ZeRO-3 has taken or refused the step already: its `step` all-reduced the global gradient norm
        and refused the step on every rank when it was not finite (the `_compat` test pins this). Both values are
        the same on every rank, so a healthy step needs no collective of ours; only a refused one gathers who saw
        what, from the flags each rank kept locally (loss; gradient norms per bucket before the reduce-scatter)."""
        norm = self._grad_norm
        skipped = optimizer is not None and bool(optimizer.step_was_skipped)
        if not skipped and (norm is None or math.isfinite(norm)):
            self.consecutive_skips = 0
            loss = self._loss_sum / self._micro_steps if self._micro_steps else None  # a new tensor, no sync
            self._unchecked.append((step, loss, self._local_sq.sqrt(), norm))
            return
        self._check_unchecked()  # every rank is here together: the earlier steps' spikes first, in order
        loss_bad = self._loss_bad is not None and bool(self._loss_bad)
        bad = (~torch.isfinite(self._grad_sums)).tolist()
        gathered = gather_objects((loss_bad, [n for n, b in zip(self._names, bad, strict=True) if b]))
        ranks = [r for r, (loss, names) in enumerate(gathered) if loss or names]
        loss_ranks = [r for r, (loss, _) in enumerate(gathered) if loss]
        if getattr(args, "fp16", False) and not loss_ranks:
            self.loss_scale_overflows += 1  # the loss scaler's own skip (see on_pre_optimizer_step)
            return
        parameters = {r: names for r, (_, names) in enumerate(gathered) if names}
        self._nonfinite_step(args, control, optimizer, step, ranks, loss_ranks, parameters, applied=not skipped)

    def _check_unchecked(self) -> None:
        """Spike checks of the healthy ZeRO-3 steps since the last call, in step order: one all-reduce of every
        rank's loss and local gradient norm of those steps, each rank writing its own row of a zeroed table (the mean
        loss over ranks, and the rank a spike names), where a check per step would cost a collective per step. An
        all-reduce, not an all-gather: a rank whose data ran out reaches this at its last step while the others
        all-gather ZeRO-3 parameters in their next one, and Gloo then aborts on the mismatched all-gather sizes
        instead of leaving the hang that the watchdog names and dumps (tests/distributed/test_hang_diagnosis.py,
        short case). Called where every rank is at once and before
        anything reads the windows or the counters: at a step that logs, saves or stops (`on_step_end`), before a
        refused step's report, at train end. Every rank holds the same steps."""
        if not self._unchecked:
            return
        entries, self._unchecked = self._unchecked, []
        nan = torch.tensor(math.nan, dtype=torch.float64, device=self._grad_sums.device)
        mine = torch.stack(
            [v for _, loss, local, _ in entries for v in (nan if loss is None else loss.to(nan), local.to(nan))]
        )
        world = torch.distributed.get_world_size() if distributed() else 1
        table = torch.zeros(world, mine.numel(), dtype=torch.float64, device=mine.device)
        table[torch.distributed.get_rank() if distributed() else 0] = mine
        if world > 1:
            torch.distributed.all_reduce(table)  # SUM: row r holds rank r's values alone
        rows = table.tolist()  # rank r: [loss, local norm] of each waiting step, in step order
        for i, (step, _, _, norm) in enumerate(entries):
            rank_losses, rank_norms = [row[2 * i] for row in rows], [row[2 * i + 1] for row in rows]
            total = sum(rank_losses) / len(rows)
            self._check_spikes(step, total if math.isfinite(total) else None, norm, rank_losses, rank_norms)

    def _nonfinite_step(self, args, control, optimizer, step, ranks, loss_ranks, parameters, applied: bool):
        report = NonFiniteReport(step=step, ranks=ranks, loss_ranks=loss_ranks, parameters=parameters)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.skipped_at = (self.skipped_at + [[step, ranks]])[-_SKIPS_KEPT:]
        self.reports = (self.reports + [report])[-_SKIPS_KEPT:]
        action = next_action(self.nonfinite_policy, self.consecutive_skips, self.max_consecutive_skips)
        if applied:
            # The engine took a step with a gradient we know was not finite: nothing after it is trustworthy.
            action, report.reason = "halt", "DeepSpeed applied this step although a value was non-finite"
        elif not _under_deepspeed(optimizer):
            self._skip_optimizer_step(optimizer)
        if action == "halt" and not report.reason:
            report.reason = (
                "nonfinite_policy='halt'"
                if self.nonfinite_policy == "halt"
                else f"{self.consecutive_skips} consecutive skips > max_consecutive_skips={self.max_consecutive_skips}"
            )
        report.action = action
        message = report.message()
        warn_once(logger, "Non-finite loss or gradient: %s", message)
        self.runtime.logs.rank({"nonfinite_event": message})
        self._log_counters()
        control.should_log = True
        if action == "halt":
            self.halt_report = report
            control.should_save = True  # the Trainer saves checkpoint-<step>; on_save then stops every rank

    def _skip_optimizer_step(self, optimizer) -> None:
        if optimizer is None:
            return
        if compat_accelerate.has_grad_scaler(optimizer):
            # The scaler asserts on an optimizer without gradients; NaN gradients make it skip by itself.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
            return
        optimizer.zero_grad(set_to_none=True)
        compat_accelerate.mark_optimizer_step_skipped(optimizer, True)
        self._skipping = True

    def _check_spikes(
        self, step: int, loss: float | None, grad_norm: float | None, rank_losses: list, rank_norms: list
    ) -> None:
        """`rank_losses`, `rank_norms`: every rank's own loss and local gradient norm at `step`, in rank order."""
        self.rank_norms = (step, list(rank_norms))  # the per-rank series of the integrations (monitoring.rank_series)
        for what, value, per_rank, rank_value in (
            ("loss", loss, rank_losses, "loss"),
            ("grad_norm", grad_norm, rank_norms, "local gradient norm"),
        ):
            if value is None:
                continue
            # self.<what>_window and self.<what>_spikes: the state() attributes of that value
            detector = SpikeDetector(self.spike_window, self.spike_threshold, getattr(self, f"{what}_window"))
            z = detector.check(value)
            setattr(self, f"{what}_window", detector.values)
            if z is None:
                continue
            median = statistics.median(detector.values[:-1])
            setattr(self, f"{what}_spikes", getattr(self, f"{what}_spikes") + 1)
            message = (
                f"step {step}: {what} spike {value:.6g} against a median of {median:.6g} over the last "
                f"{self.spike_window} steps (robust z {z:.1f} > {self.spike_threshold:g}); "
                + highest_rank(per_rank, rank_value)
            )
            warn_once(logger, "Spike: %s", message)
            self.runtime.logs.rank({"spike_event": message})
            self._log_counters()

    def _log_counters(self) -> None:
        """Every log carries the run-long counters (a resumed run continues them, so logs them alike)."""
        self.runtime.logs.standing({name: getattr(self, name) for name in _COUNTERS})

    def _reset_step(self) -> None:
        if self._grad_sums is not None:
            self._grad_sums.zero_()
        if self._loss_bad is not None:
            self._loss_bad.zero_()
            self._loss_sum.zero_()
        if self._local_sq is not None:
            self._local_sq.zero_()
        self._micro_steps = 0
        self._grad_norm = None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        # After DefaultFlowCallback (first in the list) decided; the log, the save and the stop come after this.
        if self._unchecked and (control.should_log or control.should_save or control.should_training_stop):
            self._check_unchecked()

        if self._skipping:  # after the Trainer read it to leave the scheduler alone
            compat_accelerate.mark_optimizer_step_skipped(optimizer, False)
            self._skipping = False

    def on_save(self, args, state, control, **kwargs):
        if self.halt_report is None:
            return
        report, self.halt_report = self.halt_report, None
        path = os.path.join(args.output_dir, REPORT_NAME)
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(dict(report.to_dict(), checkpoint=f"checkpoint-{state.global_step}"), f, indent=2)
        raise NonFiniteHalt(
            f"{report.message()}. The last good state is saved in "
            f"{os.path.join(args.output_dir, f'checkpoint-{state.global_step}')} (weights after "
            f"the last applied step); report: {path}"
        )
