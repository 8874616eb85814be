"""RankSummaryCallback: at the end of training every rank writes `<output_dir>/rank_summaries/rank<N>.json`.

Fields (units in the names): rank, world_size, steps, tokens, train_seconds (time spent inside optimizer steps),
tokens_per_s, param_elements (all parameters' elements), param_elements_local (what this rank holds: its ZeRO-3
partitions, or everything without ZeRO-3), first_rank_loss / last_rank_loss (this rank's own loss at its first and
last log), first_loss / last_loss (the Trainer's cross-rank loss, from the log history), seed, rng_fingerprint,
logging_dir, host, local_rank, run_id (the launch's id, shared by all its ranks and recorded in the
TensorBoard run too), nccl_env_applied / env_applied / process_setup (what the arguments applied to the process,
the last with when: `comm.process_setup`), events (every text this process's logs carried, the last `EVENTS_KEPT`,
as {step, key, text}: `nonfinite_event`, `spike_event`, `straggler_event`, `system/nvml`: the runtime's `rank`
channel, which never reaches `log_history`). `hf_dist_recipes.logs.summary` reads them back.

This callback also keeps the books it reports: it times every optimizer step (`RankMetrics.step_begin/step_end`)
and closes the loss window at each log, so `per_rank_tensorboard=False` still gives full summaries.

At every checkpoint each rank's counters go into `checkpoint-N/rank_metrics/rank<N>.json` (RecipeTrainer writes them
before the checkpoint's manifest, `RecipeTrainerMixin.finish_checkpoint`, so that they are part of it) and are loaded
on resume, so a resumed job's summary counts the whole job, not only its last stretch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hf_dist_recipes._compat.deepspeed import held_elements
from hf_dist_recipes.monitoring import SUMMARY_DIRNAME
from hf_dist_recipes.monitoring.system_metrics import launch_identity
from hf_dist_recipes.runtime import RecipeCallback

EVENTS_KEPT = 1000  # events are rare (a skip, a spike, a straggler); a run that spikes every step keeps the last


class RankSummaryCallback(RecipeCallback):
    """`logging_dir`: recorded in the summary. Reads the run's runtime: its rank metrics, seeding, log sink."""

    def __init__(self, logging_dir: str | None):
        self.logging_dir = logging_dir
        self.events: list[dict] = []  # {step, key, text} of each text in a log, in order

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._identity = launch_identity(args)  # collective, so taken at train begin on every rank

    @property
    def metrics(self):
        return self.runtime.rank_metrics

    def on_step_begin(self, args, state, control, **kwargs):
        self.metrics.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.runtime.require_fed("micro_step", "RankSummaryCallback", "each micro step's loss and tokens (RankMetrics)")
        self.metrics.step_end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Sets this rank's first/last loss at the log steps; the TensorBoard callback reads the same window.
        self.metrics.flush_window(state.global_step)
        for key, value in self.runtime.logs.last.rank.items():  # this log's texts (events), from every callback
            if isinstance(value, str):
                self.events.append({"step": state.global_step, "key": key, "text": value})
        del self.events[:-EVENTS_KEPT]

    def on_train_end(self, args, state, control, **kwargs):
        self.metrics.flush_window()  # the steps after the last log
        losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
        m, seeding = self.metrics, self.runtime.process.seed_report
        total, local = parameter_elements(kwargs.get("model"))
        summary = {
            "rank": self.runtime.facts.rank,
            "world_size": self.runtime.facts.layout.world,
            "steps": state.global_step,
            "tokens": m.tokens,
            "train_seconds": m.train_seconds,
            "tokens_per_s": m.tokens / m.train_seconds if m.train_seconds else None,
            "param_elements": total,
            "param_elements_local": local,
            "first_rank_loss": m.first_loss,
            "last_rank_loss": m.last_loss,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "seed": seeding.seed if seeding else None,
            "rng_fingerprint": seeding.fingerprint if seeding else None,
            "logging_dir": self.logging_dir,
            # The NCCL defaults RecipeTrainingArguments set because nobody had (hf_dist_recipes.comm.nccl_defaults), and
            # every environment default it set, the CUDA allocator's included (environment.alloc_defaults).
            "nccl_env_applied": dict(self.runtime.process.nccl_env_applied),
            "env_applied": dict(self.runtime.process.env_applied),
            # Each of them and the collective timeout with when, around the process group (comm.process_setup).
            "process_setup": [dataclasses.asdict(s) for s in self.runtime.process.settings],
            "events": list(self.events),
        }
        identity = getattr(self, "_identity", None)
        summary.update(
            host=identity.host if identity else None,
            local_rank=identity.local_rank if identity else None,
            run_id=identity.run_id if identity else None,
        )
        out = Path(args.output_dir) / SUMMARY_DIRNAME
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.runtime.facts.rank}.json").write_text(json.dumps(summary, indent=2))


def parameter_elements(model) -> tuple[int, int]:
    """(all elements, elements held by this rank) of `model`'s parameters. ZeRO-3 leaves each parameter an empty
    placeholder, whose sizes `_compat.deepspeed.held_elements` reads."""
    if model is None:
        return 0, 0
    sizes = [held_elements(p) for p in model.parameters()]
    return sum(whole for whole, _ in sizes), sum(held for _, held in sizes)
