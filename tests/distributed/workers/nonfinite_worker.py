"""Run on every rank by tests/distributed/test_nonfinite.py under `accelerate launch` (CPU ranks, DeepSpeed).

    nonfinite_worker.py OUTPUT_DIR STEPS [--model tiny-llama|tiny-deepseek-v3] [--inject-rank R --inject-step K
                        --what loss|grad] [--policy skip|halt] [--resume CHECKPOINT]
                        [--spike-rank R --spike-step K] [--spike-window N]

RecipeTrainingArguments -> model (template shrunk, built with from_config: under ZeRO-3 inside zero.Init) ->
RecipeTrainer. At optimizer step K (1-based) on rank R only, the model's own loss is made NaN (a forward hook) or
the gradient of one parameter is (a tensor hook registered before the engine's, so DeepSpeed's reduction and the
trainer see it). At step K of --spike-step, rank R of --spike-rank multiplies its loss by 100 (its gradients too):
a spike of the mean loss and of the gradient norm that one rank made. After every optimizer step each rank records,
from the live DeepSpeed engine: `was_step_applied()`, the engine's `gradient_clipping()` and the clip value its
ZeRO-3 optimizer applies (`clip_grad`), the learning rate in the engine optimizer's param_groups, a SHA-256 of the
full weights (ZeRO partitions gathered with `GatheredParameters`: under TP each rank's TP shard), whether they are
finite, and how the gradient-health callback watches the gradients (hooks per parameter tensor, or DeepSpeed
ZeRO-3's buckets). Writes OUTPUT_DIR/health/rank<N>.json (with the Trainer's log_history) unless the job halts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import TokenBlocks
from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback

SEQ, SAMPLES = 16, 64
POISONED = {"tiny-llama": "model.layers.0.mlp.up_proj.weight", "tiny-deepseek-v3": "model.layers.0.mlp.up_proj.weight"}


def token_data(vocab: int) -> TokenBlocks:
    """Fixed random tokens from a private generator: the data do not depend on the global RNG."""
    return TokenBlocks(torch.randint(0, vocab, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0)))


class Inject(TrainerCallback):
    def __init__(self, model, rank: int | None, step: int, what: str, param: str, spike: tuple = (None, None)):
        self.rank, self.step, self.what, self.active = rank, step, what, False
        self.spike, self.spiking = spike, False
        model.register_forward_hook(self._loss)
        dict(model.named_parameters())[param].register_hook(
            lambda g: g * math.nan if self.active and self.what == "grad" else g
        )

    def _loss(self, module, inputs, output):
        if self.active and self.what == "loss" and module.training:
            output.loss = output.loss * math.nan
        if self.spiking and module.training:
            output.loss = output.loss * 100.0
        return output

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = args.process_index == self.rank and state.global_step + 1 == self.step
        self.spiking = (args.process_index, state.global_step + 1) == self.spike


class Record(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import deepspeed

        engine = self.trainer.model_wrapped
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params):
            digest = hashlib.sha256()
            finite = True
            for p in params:
                digest.update(p.detach().float().contiguous().numpy().tobytes())
                finite = finite and bool(torch.isfinite(p).all())
        self.steps.append(
            {
                "step": state.global_step,
                "applied": engine.was_step_applied(),
                "gradient_clipping": engine.gradient_clipping(),
                "zero_clip_grad": getattr(engine.optimizer, "clip_grad", None),
                "lr": engine.optimizer.param_groups[0]["lr"],
                "weights": digest.hexdigest(),
                "finite": finite,
                "engine_skipped_steps": engine.skipped_steps,
                # how the gradients are watched: hooks per parameter tensor, or ZeRO-3's buckets (issue 18 part 6)
                "param_hooks": len(self.trainer.gradient_health._hooks),
                "bucket_watch": self.trainer.gradient_health._zero3,
            }
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--inject-rank", type=int, default=None)
    p.add_argument("--inject-step", type=int, default=3)
    p.add_argument("--what", default="loss")
    p.add_argument("--policy", default="skip")
    p.add_argument("--resume", default=None)
    p.add_argument("--spike-rank", type=int, default=None)
    p.add_argument("--spike-step", type=int, default=None)
    p.add_argument("--spike-window", type=int, default=50)
    opts = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=opts.output_dir,
        seed=0,
        max_steps=opts.steps,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        per_rank_tensorboard=False,
        lr_scheduler_type="linear",
        warmup_steps=0,
        nonfinite_policy=opts.policy,
        spike_window=opts.spike_window,
    )
    overrides = {"hidden_size": 32, "num_hidden_layers": 2} if opts.model == "tiny-deepseek-v3" else {}
    config = template_config(opts.model, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    record = Record()
    spike = (opts.spike_rank, opts.spike_step)
    callbacks = [Inject(model, opts.inject_rank, opts.inject_step, opts.what, POISONED[opts.model], spike), record]
    trainer = RecipeTrainer(model=model, args=args, train_dataset=token_data(config.vocab_size), callbacks=callbacks)
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=opts.resume)
    out = {
        "rank": args.process_index,
        "steps": record.steps,
        "log_history": trainer.state.log_history,
        # Event texts stay out of log_history: the rank summary callback keeps what this rank's logs carried.
        "events": next(c for c in trainer.callback_handler.callbacks if isinstance(c, RankSummaryCallback)).events,
        "health_state": trainer.gradient_health.state(),
    }
    target = Path(opts.output_dir) / "health"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
