"""A job that hangs or desyncs on purpose in one of five ways (tests/distributed/test_hang_diagnosis.py): RecipeTrainer
on a tiny model under the launch's DeepSpeed ZeRO-3, 2 ranks. At optimizer step `AT` (callback `on_step_end`):

- skip: rank 0 all-reduces a tensor that rank 1 skips (a rank-dependent branch in a callback);
- op: rank 0 calls all_reduce where rank 1 calls all_gather;
- shape: both all_reduce, rank 0 a tensor of 4 elements, rank 1 one of 6;
- stop: rank 1 freezes itself (SIGSTOP), its sockets open;
- short (no callback): rank 1's dataset is one batch shorter, so its epoch ends a step before rank 0's.

Each line that makes a rank part from the other carries a `# HANG <case> rank <r>` comment: the test finds the user's
line there. Before it, each rank prints `HANG-START <case> <rank> <unix time>`. Extra `name=value` arguments go to
RecipeTrainingArguments (ints and floats parsed).

Usage: hang_worker.py OUTPUT_DIR CASE [name=value ...]
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL

AT = 3
SEQ_LEN, BATCH = 16, 2


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 256, (n, SEQ_LEN), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def started(case: str, rank: int) -> None:
    print(f"HANG-START {case} {rank} {time.time():.3f}", flush=True)


class PartAt(TrainerCallback):
    def __init__(self, case: str):
        self.case = case

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"rank {args.process_index} pid {os.getpid()}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        rank = args.process_index
        print(f"rank {rank} finished step {state.global_step}", flush=True)
        if state.global_step != AT or self.case == "short":
            return
        started(self.case, rank)
        if self.case == "skip":
            if rank == 0:
                dist.all_reduce(torch.ones(1))  # HANG skip rank 0
        elif self.case == "op":
            if rank == 0:
                dist.all_reduce(torch.ones(4))  # HANG op rank 0
            else:
                dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))  # HANG op rank 1
        elif self.case == "shape":
            dist.all_reduce(torch.ones(4 if rank == 0 else 6))  # HANG shape rank 0 HANG shape rank 1
        elif self.case == "stop" and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # HANG stop rank 1


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(output_dir: str, case: str, extra: list[str]) -> None:
    overrides = {name: _value(value) for name, value in (item.split("=", 1) for item in extra)}
    rank = int(os.environ.get("RANK", "0"))
    short = case == "short"
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        max_steps=-1 if short else 200,
        num_train_epochs=1,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed_check="off",
        **overrides,
    )
    # short: rank 0 gets 2 * AT batches of its own, rank 1 one fewer (each rank takes every other batch)
    n = 2 * BATCH * (2 * AT) - (2 * BATCH if short and rank == 1 else 0) if short else 4000
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(**SMALL), args=args, train_dataset=Blocks(n))
    trainer.add_callback(PartAt(case))
    if short:
        started(case, rank)  # the hang is at the end of rank 1's epoch: the whole run counts
    trainer.train()  # HANG short rank 0 HANG short rank 1 HANG stop rank 0
    print(f"rank {rank} train returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
