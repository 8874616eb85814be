"""Practice 4, proven while the job runs: the ranks agree on what must agree, or the job says which do not.

`RankAgreementCallback` (registered by `RecipeTrainer`) does three things.

At train begin, one `all_gather_object` of a small record per rank compares:
- the seed and the data sampler's seed (`data_seed`, else the torch seed when the dataloader was made), and a
  checksum of the *global* first step's sample indices (the first `num_processes` batches of the unsharded
  sampler: every rank must compute the same permutation, else samples are repeated or skipped) -- all ranks;
- a checksum of this rank's own first batch's indices -- inside a tensor-parallel group (TP ranks must see the same
  batch; data-parallel ranks see different ones by design);
- a checksum of the weights each rank built, taken when `RecipeTrainer` was constructed (`weights_checksum`) --
  all ranks. Why then, and why not always: DeepSpeed makes the weights agree by overwriting them. Under ZeRO-3,
  `zero.Init` (used by `from_pretrained`/`from_config` once a ZeRO-3 config exists) broadcasts each parameter
  from the first rank of its partition group before partitioning it, and transformers 5.24
  (`integrations.deepspeed.initialize_weights_zero3`) runs the random init on rank 0 only; a model built whole is
  broadcast the same way when the engine partitions it (`Init(module=...)`), DDP broadcasts from rank 0 when it
  wraps. So at train begin the weights agree by construction and a checksum of them cannot fail, and per-rank
  partitions are different slices that cannot be compared. What can differ is what each rank *built*: a model
  built whole (before the arguments, or by calling its class) is checksummed before the engine exists, one pass
  over the weights (float64 sums; bounded by `max_unpartitioned_model_size` under ZeRO-3). A rank whose weights
  differ was built from a different RNG state: rank 0's weights silently win, so the run is not what the script
  says (and its other draws -- dropout, data order -- may differ too): the fix is to seed before building the
  model. Parameters that were already partitioned by `zero.Init` are skipped (their values are rank 0's by
  construction); `weights` is then recorded as "broadcast by zero.Init".

Role-aware dropout streams: also at train begin (after the train dataloader captured its sampler seed, so the
data order does not move), every rank reseeds torch with `dropout_seed(seed, dp_rank, per_rank_dropout)`: the
same stream inside a TP group always (TP correctness), the same stream on every data-parallel replica by default,
or distinct ones per replica with `per_rank_dropout=True` (transformers issue 31412). Weights and data order are
unaffected. This also removes a difference the stack leaves today: with `model_init` under ZeRO-3, rank 0 alone
draws the random init, so the ranks enter training with different RNG states.

Every `rank_check_steps` optimizer steps (default 100; 0 turns it off), one all-gather of 6 float64 per rank
compares: the global step and the learning rate the optimizer holds (all ranks), and inside a TP group the last
micro-step's loss, a checksum of its batch and the torch RNG state (dropout). The first mismatch is reported with
the ranks and the step, and the last step at which they still agreed.

Policy `seed_check` ("error" default: RuntimeError on every rank, the launch fails with the message; "warn": a
warning line in every rank's log; "off": nothing gathered, only the dropout streams are set). Whatever the policy,
every mismatch found is kept in `mismatches` as (step, or None at train begin, `Mismatch`), the same on every rank:
what the preflight reports (`hf_dist_recipes.preflight.training`). Keys added to the next Trainer log (the runtime's
`LogSink`): after each check step `rank_check/ok` (1.0 or 0.0), in the `history` channel, so `log_history`,
`report_to` and TensorBoard see it (a resumed run checks at the same steps); after train begin `rank_check/seed_ok`,
`rank_check/data_ok`, `rank_check/weights_ok` (1.0 agree, 0.0 mismatch, -1.0 not checkable: weights built under
zero.Init) in the `rank` channel, for the per-rank TensorBoard run only: they come with the first log of every
`train()` call, so a resumed run would log them where the uninterrupted one did not (the values are kept in
`begin_report`). All ranks gather the same data and decide alike, so "error" stops every rank at the same point
instead of leaving some waiting in a collective.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from hf_dist_recipes._compat.deepspeed import is_zero_partitioned
from hf_dist_recipes.core.gather import gather_floats, gather_objects
from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.monitoring.console import warn_once
from hf_dist_recipes.runtime import RecipeCallback

logger = logging.getLogger(__name__)

SeedCheck = Literal["error", "warn", "off"]
POLICIES: tuple[str, ...] = get_args(SeedCheck)
ZERO_INIT_BROADCAST = "broadcast by zero.Init"
_PER_RANK_STRIDE = 1_000_003  # a prime: dropout seeds of neighbouring replicas do not collide with seed + 1 runs


def validate_policy(policy: object) -> str:
    if policy not in POLICIES:
        raise ValueError(f"seed_check must be one of {', '.join(POLICIES)}, got {policy!r}; the default is 'error'")
    return policy


def validate_rank_check_steps(steps: object) -> int:
    return positive_int(steps, "rank_check_steps", 100, minimum=0, note="0 turns the periodic check off")


def dropout_seed(seed: int, dp_rank: int, per_rank_dropout: bool) -> int:
    """The torch seed a rank trains with: `seed` on every rank, or a distinct one per data-parallel replica."""
    if not per_rank_dropout:
        return seed
    return (seed + _PER_RANK_STRIDE * (dp_rank + 1)) % 2**32


def checksum(values: Iterable[int]) -> str:
    """16 hex chars of SHA-256 over a sequence of integers (sample indices, token ids)."""
    digest = hashlib.sha256()
    for value in values:
        digest.update(int(value).to_bytes(8, "little", signed=True))
    return digest.hexdigest()[:16]


def tensor_checksum(tensors: Iterable[torch.Tensor]) -> tuple[float, float] | None:
    """(sum, position-weighted sum) in float64 over the tensors, computed where they live; None for no tensors.

    Two random inits from different RNG states differ in both sums with probability 1; the weights make the check
    see a permutation of values between tensors."""
    total = weighted = None
    for i, tensor in enumerate(tensors):
        t = tensor.detach().double()
        s = t.sum()
        total = s if total is None else total + s
        weighted = s * (i + 1) if weighted is None else weighted + s * (i + 1)
    if total is None:
        return None
    return float(total), float(weighted)


def weights_checksum(model: torch.nn.Module | None) -> tuple[float, float] | str | None:
    """Checksum of the weights this rank built; `ZERO_INIT_BROADCAST` when zero.Init already partitioned them."""
    if model is None:
        return None
    params = list(model.parameters())
    whole = [p for p in params if not is_zero_partitioned(p)]
    if params and not whole:
        return ZERO_INIT_BROADCAST
    return tensor_checksum(whole)


def rng_checksum() -> str:
    """Hash of torch's CPU RNG state and the current CUDA device's (dropout draws from these); does not advance."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Mismatch:
    """Ranks of one group that must agree on `what` and do not. `values`: rank -> its value."""

    what: str
    ranks: tuple[int, ...]  # the ranks that differ from the group's most common value
    group: tuple[int, ...]
    values: Mapping[int, object]
    fix: str

    def message(self, step: int | None = None) -> str:
        where = "at train begin" if step is None else f"at step {step}"
        shown = ", ".join(f"rank {r}: {self.values[r]!r}" for r in self.group)
        return (
            f"rank(s) {', '.join(map(str, self.ranks))} disagree with ranks {list(self.group)} on {self.what} "
            f"{where} ({shown}); {self.fix}"
        )


def find_mismatches(values: Sequence[object], groups: Sequence[Sequence[int]], what: str, fix: str) -> list[Mismatch]:
    """Groups whose ranks' `values` (indexed by rank) are not all equal. The ranks named are those outside the
    most common value (ties: the value of the group's first rank is taken as the reference)."""
    found = []
    for group in groups:
        seen = [values[r] for r in group]
        if all(v == seen[0] for v in seen):
            continue
        counts = {}
        for v in seen:
            counts[repr(v)] = counts.get(repr(v), 0) + 1
        best = max(counts.values())
        reference = next(v for v in seen if counts[repr(v)] == best)
        odd = tuple(r for r in group if values[r] != reference)
        found.append(Mismatch(what, odd, tuple(group), {r: values[r] for r in group}, fix))
    return found


def apply_policy(policy: str, mismatches: Sequence[Mismatch], step: int | None = None) -> None:
    """Raise (error, on every rank) or warn (warn, once: rank 0; every rank gathered the same values) about
    `mismatches`, which name the ranks; nothing for none or policy off."""
    if not mismatches or policy == "off":
        return
    text = "Ranks disagree:\n  " + "\n  ".join(m.message(step) for m in mismatches)
    if policy == "error":
        raise RuntimeError(text + "\n(seed_check='warn' reports this without stopping; 'off' skips the check)")
    warn_once(logger, "%s", text)


def first_batches(train_dataloader) -> tuple[str | None, str | None, int | None]:
    """(global first step checksum, this rank's first batch checksum, sampler seed) of an accelerate dataloader,
    read without consuming it (the seedable sampler reseeds its generator at each iteration); None where unknown.

    Cost: one permutation of the dataset's indices (the sampler's own work at each epoch), once. Under Ulysses SP the
    Trainer hands DeepSpeed's `UlyssesSPDataLoaderAdapter`, which shards the batches of the accelerate dataloader it
    wraps (`dl`, each rank's own): that one is read."""
    if getattr(train_dataloader, "batch_sampler", None) is None and hasattr(train_dataloader, "dl"):
        train_dataloader = train_dataloader.dl
    shard = getattr(train_dataloader, "batch_sampler", None)
    inner = getattr(shard, "batch_sampler", None)
    if shard is None or inner is None:
        return None, None, None
    sampler = getattr(inner, "sampler", None)
    seed = getattr(sampler, "initial_seed", None)
    processes = getattr(shard, "num_processes", 1)
    global_step = [i for batch in itertools.islice(iter(inner), processes) for i in batch]
    own = next(iter(shard), None)
    return checksum(global_step), (None if own is None else checksum(own)), seed


# What must agree, (record key, TP groups only, what, fix): the data order at train begin, then each gathered column
# of the periodic check (step, learning rate, loss, batch, dropout RNG state) in row order.
_DATA_CHECKS = (
    (
        "data_seed",
        False,
        "the data sampler's seed",
        "use the same data_seed on every rank (or seed before the trainer is built)",
    ),
    (
        "global_first_batch",
        False,
        "the first step's sample order",
        "use the same data_seed and the same dataset on every rank",
    ),
    (
        "first_batch",
        True,
        "the first batch inside a TP group",
        "tensor-parallel ranks must get the same batch: shard data by data-parallel rank",
    ),
)
_WEIGHTS_FIX = (
    "seed before building the model: build it after RecipeTrainingArguments (which seeds every rank) or call "
    "seed_everything(seed) first"
)
_STEP_CHECKS = (
    (False, "the global step", "every rank must run the same optimizer steps"),
    (False, "the learning rate", "every rank must use the same optimizer and schedule settings"),
    (True, "the loss inside a TP group", "TP ranks must compute the same loss: same batch, same dropout stream"),
    (True, "the batch inside a TP group", "tensor-parallel ranks must get the same batch"),
    (
        True,
        "the dropout RNG state inside a TP group",
        "TP ranks must draw the same random numbers (do not reseed one rank)",
    ),
)


class RankAgreementCallback(RecipeCallback):
    """See the module docstring. `weights`: this rank's `weights_checksum` at construction. The run's runtime
    (`hf_dist_recipes.runtime`) gives the rank layout (the TP groups); `on_micro_step` each micro step's loss and
    batch."""

    def __init__(
        self,
        *,
        seed: int,
        policy: SeedCheck = "error",
        rank_check_steps: int = 100,
        per_rank_dropout: bool = False,
        weights: tuple[float, float] | str | None = None,
    ):
        self.seed = seed
        self.policy = validate_policy(policy)
        self.rank_check_steps = validate_rank_check_steps(rank_check_steps)
        self.per_rank_dropout = per_rank_dropout
        self.weights = weights
        self.begin_report: dict[str, float] = {}
        self.last_agreed_step: int | None = None
        self._loss: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        # Every disagreement found, as (step, or None at train begin, Mismatch): the same list on every rank (all
        # decide from the same gathered data), for callers that report instead of stopping (the preflight).
        self.mismatches: list[tuple[int | None, Mismatch]] = []

    @property
    def tp_size(self) -> int:
        """The job's AutoTP degree (the runtime's layout)."""
        return self.runtime.facts.layout.tp

    def _disagree(self, rows: list, key, tp_only: bool, what: str, fix: str) -> list[Mismatch]:
        """`find_mismatches` of each rank's `rows[rank][key]` over every rank, or with `tp_only` inside each TP group
        (nothing to compare at TP 1)."""
        layout, values = self.runtime.facts.layout, [row[key] for row in rows]
        if tp_only and layout.tp == 1:
            return []
        return find_mismatches(values, layout.tp_groups() if tp_only else [list(range(layout.world))], what, fix)

    def on_micro_step(self, args, state, control, loss: torch.Tensor, inputs, **kwargs) -> None:
        """Each micro step's loss and inputs: keeps references only."""
        self._loss = loss
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        self._ids = ids if isinstance(ids, torch.Tensor) else None

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        layout = self.runtime.facts.layout
        dp_rank = layout.dp_rank(self.runtime.facts.rank)
        torch.manual_seed(dropout_seed(self.seed, dp_rank, self.per_rank_dropout))  # every CUDA device as well
        if self.policy == "off":
            return
        global_first, own_first, sampler_seed = first_batches(train_dataloader)
        record = {
            "seed": self.seed,
            "data_seed": sampler_seed,
            "global_first_batch": global_first,
            "first_batch": own_first,
            "weights": self.weights,
        }
        records = gather_objects(record)
        check = functools.partial(self._disagree, records)
        seed_bad = check("seed", False, "the seed", "pass the same seed= on every rank")
        data_bad = [m for found in _DATA_CHECKS for m in check(*found)]
        weights_known = all(r["weights"] is not None and r["weights"] != ZERO_INIT_BROADCAST for r in records)
        weights_bad = check("weights", False, "the weights they built", _WEIGHTS_FIX) if weights_known else []
        self.begin_report = {
            "rank_check/seed_ok": float(not seed_bad),
            "rank_check/data_ok": float(not data_bad),
            "rank_check/weights_ok": float(not weights_bad) if weights_known else -1.0,
        }
        self.runtime.logs.rank(self.begin_report)  # the first log of this train() only: not log_history's
        self.mismatches += [(None, m) for m in seed_bad + data_bad + weights_bad]
        apply_policy(self.policy, seed_bad + data_bad + weights_bad)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.policy == "off" or not self.rank_check_steps:
            return
        if self.tp_size > 1:
            self.runtime.require_fed(
                "micro_step", "RankAgreementCallback with tp_size > 1", "each micro step's loss and batch"
            )
        if state.global_step % self.rank_check_steps:
            return
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None and optimizer.param_groups else -1.0
        loss = float(self._loss.detach().float()) if self._loss is not None else float("nan")
        ids = (
            -1.0
            if self._ids is None
            else float(
                torch.sum(
                    self._ids.long()
                    * (1 + torch.arange(self._ids.numel(), device=self._ids.device).view_as(self._ids) % 997)
                )
            )
        )
        rng = rng_checksum()
        rng = -1.0 if rng is None else float(int(rng[:13], 16))  # 52 bits of the hex digest: exact in a float64
        rows = gather_floats([float(state.global_step), lr, loss, ids, rng, float(self.runtime.facts.rank)])
        bad = [m for i, found in enumerate(_STEP_CHECKS) for m in self._disagree(rows, i, *found)]
        if bad:
            since = "" if self.last_agreed_step is None else f" (last agreement at step {self.last_agreed_step})"
            bad = [Mismatch(m.what + since, m.ranks, m.group, m.values, m.fix) for m in bad]
        else:
            self.last_agreed_step = state.global_step
        self.runtime.logs.history({"rank_check/ok": float(not bad)})
        self.mismatches += [(state.global_step, m) for m in bad]
        apply_policy(self.policy, bad, step=state.global_step)
