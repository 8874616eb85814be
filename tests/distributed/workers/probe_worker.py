"""Run on every rank by the distributed tests under `accelerate launch`.

    probe_worker.py OUTPUT_DIR STEPS recipe|stock MODEL [from_config|direct|from_config+direct] [GRAD_ACCUM]

Trains MODEL (a template of hf_dist_recipes.planning.models: tiny-llama, tiny-deepseek-v3) under the
DeepSpeed config the launcher hands over, with RecipeTrainer or the stock Trainer (micro batch 4, sequences of 32
bytes), and writes what this rank saw to OUTPUT_DIR/probe/rank<N>.json: its batches (hashes), losses, the global
batch, and every parameter's per-rank shape (`ds_shape` after TP/EP) and local ZeRO partition size.
The model is built by `AutoModelForCausalLM.from_config` (under ZeRO-3: inside `deepspeed.zero.Init`, as
`from_pretrained` does), or with `direct` by calling the model class itself (no `zero.Init`). GRAD_ACCUM
(default 1): gradient_accumulation_steps; `samples` then lists, per micro step, the optimizer step it belongs to and
a hash of each sample, so a test can count the global batch from what the ranks consumed.
`from_config+direct`: the from_config run, then in the same processes (new arguments and trainer) one step with
`direct` into OUTPUT_DIR/direct: a second build of the same layout without a launch of its own.
"""

import hashlib
import json
import sys
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks

MICRO_BATCH = 4


def main(
    output_dir: str, steps: int, flavour: str, model_name: str, build: str = "from_config", grad_accum: str = "1"
) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=int(grad_accum),
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    if flavour == "recipe":
        base, args = RecipeTrainer, RecipeTrainingArguments(**common)
    else:
        base, args = Trainer, TrainingArguments(use_cpu=True, **common)
    config = template_config(model_name)
    seen = []
    samples = []  # (optimizer step this micro step counts towards, [hash of each sample])

    class Recorder(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"].cpu().numpy()
            seen.append(hashlib.sha256(ids.tobytes()).hexdigest()[:12])
            # global_step is still the count of finished optimizer steps while this micro step runs.
            samples.append([self.state.global_step, [hashlib.sha256(row.tobytes()).hexdigest()[:12] for row in ids]])
            return super().training_step(model, inputs, num_items_in_batch)

    data = stdlib_dataset(seq_len=32, max_bytes=200_000)
    data = token_blocks(data, config.vocab_size)
    if build == "direct":
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        model_init = lambda: model_class(config)  # noqa: E731
    else:
        model_init = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    trainer = Recorder(model_init=model_init, args=args, train_dataset=data)
    trainer.train()
    params = {
        n: {
            "shape": list(getattr(p, "ds_shape", p.shape)),
            "local": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel(),
        }
        for n, p in trainer.model.named_parameters()
    }
    out = Path(output_dir) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    groups = {}
    if hasattr(trainer, "runtime") and trainer.runtime.facts.layout.tp > 1:  # RecipeTrainer under AutoTP: its
        # layout against DeepSpeed's own group membership (DeepSpeed makes a TP group only under AutoTP)
        import torch.distributed as dist
        from deepspeed.utils import groups as ds_groups

        layout = trainer.runtime.facts.layout
        groups = {
            "runtime_tp_group": layout.tp_group(args.process_index),
            "runtime_dp_group": layout.dp_group(args.process_index),
            "deepspeed_tp_group": dist.get_process_group_ranks(ds_groups.get_tensor_model_parallel_group()),
        }
    (out / f"rank{args.process_index}.json").write_text(
        json.dumps(
            {
                "rank": args.process_index,
                "world_size": args.world_size,
                "trainer_total_batch": trainer.get_total_train_batch_size(args),
                "deepspeed_counter_batch": trainer.model_wrapped.train_batch_size(),
                "tp_batch_note": getattr(args, "tp_batch_note", None),
                "params": params,
                "batches": seen,
                "samples": samples,
                "engine_micro_batch": trainer.model_wrapped.train_micro_batch_size_per_gpu(),
                "engine_grad_accum": trainer.model_wrapped.gradient_accumulation_steps(),
                "optimizer_steps": trainer.state.global_step,
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                **groups,
            }
        )
    )


if __name__ == "__main__":
    output_dir, steps, flavour, model_name, build, *grad_accum = *sys.argv[1:5], *(sys.argv[5:7] or ["from_config"])
    if build == "from_config+direct":
        main(output_dir, int(steps), flavour, model_name, "from_config", *grad_accum)
        main(str(Path(output_dir) / "direct"), 1, flavour, model_name, "direct", *grad_accum)
    else:
        main(output_dir, int(steps), flavour, model_name, build, *grad_accum)
