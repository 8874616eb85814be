"""Run on every rank by tests/distributed/test_tensor_parallel_batch.py under `accelerate launch`.

    tp_batch_worker.py OUTPUT_DIR STEPS recipe|stock

Trains a tiny Llama under the DeepSpeed config the launcher hands over (ZeRO-3 + AutoTP 2, `"train_batch_size":
"auto"`), with RecipeTrainer or with the stock Trainer, and writes what this rank saw to OUTPUT_DIR/probe/rank<N>.json.
"""

import hashlib
import json
import sys
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset

MICRO_BATCH = 4


def main(output_dir: str, steps: int, flavour: str) -> None:
    common = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=MICRO_BATCH,
                  learning_rate=3e-3, warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none",
                  dataloader_drop_last=True, disable_tqdm=True)
    if flavour == "recipe":
        base, args = RecipeTrainer, RecipeTrainingArguments(**common)
    else:
        base, args = Trainer, TrainingArguments(use_cpu=True, **common)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    seen = []

    class Recorder(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12])
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Recorder(model_init=lambda: LlamaForCausalLM(cfg), args=args,
                       train_dataset=stdlib_dataset(seq_len=32, max_bytes=200_000))
    trainer.train()
    q_proj = next(m for n, m in trainer.model.named_modules() if n.endswith("layers.0.self_attn.q_proj")).weight
    out = Path(output_dir) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}.json").write_text(json.dumps({
        "rank": args.process_index,
        "world_size": args.world_size,
        "trainer_total_batch": trainer.get_total_train_batch_size(args),
        "deepspeed_counter_batch": trainer.model_wrapped.train_batch_size(),
        "tp_batch_note": getattr(args, "tp_batch_note", None),
        "q_proj_shape": list(getattr(q_proj, "ds_shape", q_proj.shape)),
        "batches": seen,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
