"""Run on every rank by tests/distributed/test_hpz_model_init.py under `accelerate launch` with a ZeRO-3 DeepSpeed
JSON, with or without ZeRO++ hpZ (`zero_hpz_partition_size`).

    hpz_worker.py DEEPSPEED_JSON OUTPUT_DIR STEPS [then DEEPSPEED_JSON OUTPUT_DIR STEPS]...

Each `then` is one more run in the same processes with its own DeepSpeed JSON (tests/distributed/workers/runs.py
`use_deepspeed_json`): the test runs plain ZeRO-3 first, then hpZ, whose two builds are then still the process's
first and second hpZ groups.
`RecipeTrainer(model_init=...)` builds tiny-llama twice in this process: once in the constructor and again in
`train()` (transformers 5.24 `call_model_init`), each time under zero.Init. Writes OUTPUT_DIR/hpz/rank<N>.json:
the logged training losses, how often model_init ran, how many of the trained model's parameters zero.Init gave an
hpZ group, and the most parameters seen holding hpZ's secondary (node-local) partition during a forward pass.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks
from tests.distributed.workers.runs import split_runs, use_deepspeed_json


def main(output_dir: str, steps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    config = template_config("tiny-llama")
    data = stdlib_dataset(seq_len=32, max_bytes=20_000)
    data = token_blocks(data, config.vocab_size)
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=7,
    )
    builds = []
    secondary_seen = [0]

    def model_init():
        builds.append(1)
        model = AutoModelForCausalLM.from_config(config)

        def count_secondary(module, inputs, output):
            # By the head's forward the earlier modules have been released, which (under hpZ) makes their
            # secondary partitions; the optimizer step drops them again, so they are counted here, mid-step.
            held = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in model.parameters())
            secondary_seen[0] = max(secondary_seen[0], held)

        model.lm_head.register_forward_hook(count_secondary)
        return model

    trainer = RecipeTrainer(model_init=model_init, args=args, train_dataset=data)
    trainer.train()
    out = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "model_init_calls": len(builds),
        "secondary_partitions": secondary_seen[0],
        "params_with_hpz_group": sum(
            getattr(p, "ds_zero_param_process_group", None) is not None for p in trainer.model.parameters()
        ),
        "params": sum(1 for _ in trainer.model.parameters()),
    }
    target = Path(output_dir) / "hpz"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    for ds_json, output_dir, steps in split_runs(sys.argv[1:]):
        use_deepspeed_json(ds_json)
        main(output_dir, int(steps))
