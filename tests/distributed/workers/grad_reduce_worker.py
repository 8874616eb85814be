"""Run on every rank by tests/distributed/test_grad_reduce_dtype.py under `accelerate launch` with a ZeRO-3 DeepSpeed
JSON and bf16 training.

    grad_reduce_worker.py OUTPUT_DIR STEPS

Records the dtype and size of every tensor DeepSpeed reduce-scatters (a wrapper around `deepspeed.comm.
reduce_scatter_fn`, which ZeRO-3's `reduce_scatter_coalesced` calls, passing each call through unchanged) and the
logged losses, into OUTPUT_DIR/reduce/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import deepspeed.comm
from transformers import AutoModelForCausalLM

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks
from hf_dist_recipes.parallel.models import template_config


def main(output_dir: str, steps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    seen: dict[str, int] = {}
    original = deepspeed.comm.reduce_scatter_fn

    def recording(output_tensor, tensor, *args, **kwargs):
        key = str(tensor.dtype)
        seen[key] = seen.get(key, 0) + tensor.numel() * tensor.element_size()
        return original(output_tensor, tensor, *args, **kwargs)

    deepspeed.comm.reduce_scatter_fn = recording
    config = template_config("tiny-llama")
    data = token_blocks(stdlib_dataset(seq_len=32, max_bytes=20_000), config.vocab_size)
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=True,
        seed=7,
    )
    trainer = RecipeTrainer(model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=data)
    trainer.train()
    out = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "reduce_scatter_bytes_by_dtype": seen,
        "communication_data_type": str(trainer.model_wrapped.communication_data_type),
    }
    target = Path(output_dir) / "reduce"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
