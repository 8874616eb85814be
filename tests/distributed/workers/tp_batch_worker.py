"""Run on every rank by tests/distributed/test_tensor_parallel_batch.py under `accelerate launch`.

Trains a tiny Llama with RecipeTrainer under the DeepSpeed config the launcher hands over (ZeRO-3 + AutoTP 2,
`"train_batch_size": "auto"`) and writes what it saw to <output_dir>/probe/rank<N>.json.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset


class Probe(TrainerCallback):
    def __init__(self):
        self.batches = []

    def on_step_begin(self, args, state, control, **kwargs):
        pass


def main(output_dir: str, steps: int) -> None:
    args = RecipeTrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none", dataloader_drop_last=True,
        disable_tqdm=True,
    )
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    seen = []

    class Recorder(RecipeTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12])
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Recorder(model_init=lambda: LlamaForCausalLM(cfg), args=args,
                       train_dataset=stdlib_dataset(seq_len=32, max_bytes=200_000))
    trainer.train()
    engine = trainer.model_wrapped
    q_proj = next(m for n, m in trainer.model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    weight = q_proj.weight
    rank = args.process_index
    out = Path(output_dir) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank,
        "world_size": args.world_size,
        "engine_train_batch_size": engine.train_batch_size(),
        "trainer_total_batch": trainer.get_total_train_batch_size(args),
        "tp_batch_note": args.tp_batch_note,
        "q_proj_shape": list(getattr(weight, "ds_shape", weight.shape)),
        "batches": seen,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
