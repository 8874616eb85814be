"""A job that something ends, run on every rank under `accelerate launch` by tests/distributed/test_job_dies.py,
test_sbatch_requeue.py (under the generated sbatch script) and test_offload_autoep.py:

    survival_worker.py OUTPUT_DIR STEPS SAVE_STEPS [kill-at=K] [step-pause=S] [begin-pause=S] [model=NAME] [bf16=1]
                       [then OUTPUT_DIR STEPS SAVE_STEPS ...]

Trains a tiny Llama (`model=`: another template, e.g. tiny-deepseek-v3; `bf16=1`: in bf16) from its config (the same
weights on every attempt: the recipe seeds before the model is built) with `auto_resume=True`, STEPS steps, a checkpoint
every SAVE_STEPS, then `save_model` to OUTPUT_DIR/final. `kill-at=K`: rank 1 ends itself with SIGKILL at the end of step
K, on the launcher's first attempt only (TORCHELASTIC_RESTART_COUNT=0), as a dead node would. `step-pause=S`: each step
end waits S seconds, so that a test can signal the launcher between two steps; `begin-pause=S`: the first step's
beginning writes OUTPUT_DIR/progress/began-rank<N> and waits S seconds, so that a test can signal it after train() began
(its TensorBoard run written) and before any step ended. Each rank writes OUTPUT_DIR/progress/rank<N> (the last step
ended) and progress/pid-rank<N> at every step end, OUTPUT_DIR/survival/rank<N>-attempt<A>.json at the end of each
attempt that returns from train() (the first step it trained, the step it ended at, its losses),
OUTPUT_DIR/exits/rank<N> with the code of a SystemExit that train() raised (the recipe's exit after a save on a signal),
and under offload OUTPUT_DIR/host/rank<N>.json after step 2 (`host_bytes`: the offloaded states, by kind).
"""

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import TokenBlocks, stdlib_dataset, token_blocks
from tests.distributed.workers.checkpointed_run import checkpointed_run_args
from tests.distributed.workers.runs import mark_run_end, split_runs

SEQ_LEN = 32


class Progress(TrainerCallback):
    def __init__(self, output_dir: str, kill_at: int | None, pause_s: float, begin_pause_s: float = 0.0):
        self.output_dir, self.kill_at, self.pause_s = Path(output_dir), kill_at, pause_s
        self.begin_pause_s = begin_pause_s
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.first_step: int | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and self.begin_pause_s:
            (self.output_dir / "progress").mkdir(parents=True, exist_ok=True)
            (self.output_dir / "progress" / f"began-rank{args.process_index}").write_text("")
            time.sleep(self.begin_pause_s)

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step
        folder = self.output_dir / "progress"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{args.process_index}").write_text(str(state.global_step))
        (folder / f"pid-rank{args.process_index}").write_text(str(os.getpid()))
        if state.global_step == self.kill_at and args.process_index == 1 and self.attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.pause_s)


def host_bytes(engine) -> dict:
    """Bytes of the distinct storages ZeRO-3's offloaded states hold on this rank (DeepSpeed 0.19.8 stage3.py), by
    kind, and the rank's partitioned elements (its parameter partitions): read from the live engine, not derived."""
    import torch

    optimizer, seen = engine.optimizer, set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    fp32 = list(optimizer.fp32_partitioned_groups_flat)
    params = [p.ds_tensor for group in optimizer.fp16_groups for p in group]
    return {
        "elements": sum(t.numel() for t in params),
        "parameters": size(params) if engine.zero_offload_param() else 0,
        "master": size(fp32),
        "moments": size(v for t in fp32 for v in optimizer.optimizer.state.get(t, {}).values()),
        "gradient_partitions": size([optimizer.grad_partitions_flat_buffer]),
        "subgroup_gradients": size(t.grad for t in fp32),
    }


class HostBytes(TrainerCallback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2 and self.trainer.is_deepspeed_enabled:
            engine = self.trainer.model_wrapped
            if engine.zero_offload_optimizer() or engine.zero_offload_param():
                folder = self.output_dir / "host"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"rank{args.process_index}.json").write_text(json.dumps(host_bytes(engine)))


def main(
    output_dir: str,
    steps: int,
    save_steps: int,
    kill_at: int | None,
    pause_s: float,
    model_name: str = "tiny-llama",
    bf16: bool = False,
    begin_pause_s: float = 0.0,
) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = checkpointed_run_args(output_dir, steps, save_steps, auto_resume=True, bf16=bf16)
    model = AutoModelForCausalLM.from_config(template_config(model_name))
    train = TokenBlocks(token_blocks(stdlib_dataset(seq_len=SEQ_LEN, max_bytes=60_000), model.config.vocab_size).tokens)
    progress, host = Progress(output_dir, kill_at, pause_s, begin_pause_s), HostBytes(output_dir)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=train, callbacks=[progress, host])
    host.trainer = trainer
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    out = Path(output_dir) / "survival"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}-attempt{progress.attempt}.json").write_text(
        json.dumps(
            {
                "first_step": progress.first_step,
                "global_step": trainer.state.global_step,
                "loss": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
            }
        )
    )


if __name__ == "__main__":
    runs = split_runs(sys.argv[1:])
    for index, (output_dir, steps, save_steps, *rest) in enumerate(runs):
        options = dict(word.split("=", 1) for word in rest)
        kill_at = int(options["kill-at"]) if "kill-at" in options else None
        try:
            main(
                output_dir,
                int(steps),
                int(save_steps),
                kill_at,
                float(options.get("step-pause", "0")),
                options.get("model", "tiny-llama"),
                options.get("bf16") == "1",
                float(options.get("begin-pause", "0")),
            )
        except SystemExit as stop:  # the recipe's exit after a save on a signal: its code, for the test
            folder = Path(output_dir) / "exits"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{os.environ.get('RANK', '0')}").write_text(str(stop.code))
            raise
        if index < len(runs) - 1:
            mark_run_end(index, int(os.environ.get("RANK", "0")))
