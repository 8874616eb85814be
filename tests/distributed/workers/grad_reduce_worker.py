"""Run on every rank by tests/distributed/test_grad_reduce_dtype.py under `accelerate launch` with a ZeRO-3 DeepSpeed
JSON and bf16 training.

    grad_reduce_worker.py DEEPSPEED_JSON OUTPUT_DIR STEPS [LOSS_CHUNK_TOKENS] [then DEEPSPEED_JSON OUTPUT_DIR STEPS ...]

Each `then` is one more run in the same processes with its own DeepSpeed JSON (tests/distributed/workers/runs.py
`use_deepspeed_json`); each run counts only its own reduce-scatters.

Records the dtype and size of every tensor DeepSpeed reduce-scatters (a wrapper around `deepspeed.comm.
reduce_scatter_fn`, which ZeRO-3's `reduce_scatter_coalesced` calls, passing each call through unchanged) and the
logged losses, into OUTPUT_DIR/reduce/rank<N>.json.

With LOSS_CHUNK_TOKENS, the same run is trained again in this process with the chunked loss
(`loss_chunk_tokens`, tests/unit/test_chunked_loss.py): its losses and gradient norms, whether the LM head's weight
is partitioned (ZeRO-3 gathers it for each chunk through its module hooks) and the most tokens the head saw in one
call, in the forward pass or a chunk's recomputation, go under "chunked".
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import deepspeed.comm
from transformers import AutoModelForCausalLM

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks
from tests.distributed.workers.runs import split_runs, use_deepspeed_json


def main(output_dir: str, steps: int, chunk: int | None = None) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    seen: dict[str, int] = {}
    original = deepspeed.comm.reduce_scatter_fn

    def recording(output_tensor, tensor, *args, **kwargs):
        key = str(tensor.dtype)
        seen[key] = seen.get(key, 0) + tensor.numel() * tensor.element_size()
        return original(output_tensor, tensor, *args, **kwargs)

    deepspeed.comm.reduce_scatter_fn = recording
    try:
        _train(output_dir, steps, chunk, seen)
    finally:
        deepspeed.comm.reduce_scatter_fn = original  # the next run of the launch wraps the original again


def _train(output_dir: str, steps: int, chunk: int | None, seen: dict[str, int]) -> None:
    config = template_config("tiny-llama")
    data = token_blocks(stdlib_dataset(seq_len=32, max_bytes=20_000), config.vocab_size)
    common = dict(
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
    args = RecipeTrainingArguments(**common)
    trainer = RecipeTrainer(model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=data)
    trainer.train()
    out = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "loss" in e],
        "reduce_scatter_bytes_by_dtype": dict(seen),
        "communication_data_type": str(trainer.model_wrapped.communication_data_type),
    }
    if chunk:
        args = RecipeTrainingArguments(**common, loss_chunk_tokens=chunk)  # seeds: the model below is the first's
        model = AutoModelForCausalLM.from_config(config)
        tokens: list[int] = []
        model.lm_head.register_forward_hook(lambda m, inputs, output: tokens.append(inputs[0].shape[:-1].numel()))
        weight = model.lm_head.weight
        chunked = RecipeTrainer(model=model, args=args, train_dataset=data)
        chunked.train()
        out["chunked"] = {
            "losses": [e["loss"] for e in chunked.state.log_history if "loss" in e],
            "grad_norms": [e["grad_norm"] for e in chunked.state.log_history if "loss" in e],
            "lm_head_partitioned": weight.ds_tensor.numel() < weight.ds_numel,
            "lm_head_max_tokens": max(tokens),
            "lm_head_calls": len(tokens),
        }
    target = Path(output_dir) / "reduce"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    for ds_json, output_dir, steps, *chunk in split_runs(sys.argv[1:]):
        use_deepspeed_json(ds_json)
        main(output_dir, int(steps), int(chunk[0]) if chunk else None)
