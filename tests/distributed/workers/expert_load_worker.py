"""Run on every rank under `accelerate launch` by tests/distributed/test_expert_load_ranks.py:

    expert_load_worker.py OUTPUT_DIR STEPS GAMMA

Trains tiny-deepseek-v3 for STEPS optimizer steps (micro batch 4 of 32 tokens, gradient accumulation 2, a log every
step) with RecipeTrainer and, when GAMMA > 0, `ExpertBiasBalancer(GAMMA)`, then `save_model` to OUTPUT_DIR/final.
Each rank writes OUTPUT_DIR/expert_load/rank<N>.json: for every MoE layer DeepSpeed AutoEP's own utilization
counter (`AutoEPMoELayer.tokens_per_expert`, this rank's tokens since the layer was built), the layer's EP rank and
local experts, and the final correction bias of its router. The per-rank TensorBoard holds the logged counts.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_dist_recipes import ExpertBiasBalancer, RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks
from hf_dist_recipes.moe.expert_load import find_routed_layers

MICRO_BATCH, SEQ_LEN, GRAD_ACCUM = 4, 32, 2


def main(output_dir: str, steps: int, gamma: float) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    config = template_config("tiny-deepseek-v3")
    data = stdlib_dataset(seq_len=SEQ_LEN, max_bytes=100_000)
    data = token_blocks(data, config.vocab_size)

    def model_init():
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # wider router weights than the 0.02 init, so that the load is uneven
            for layer in find_routed_layers(model):
                if hasattr(layer.router.weight, "ds_id"):  # built under zero.Init: partitioned
                    import deepspeed

                    with deepspeed.zero.GatheredParameters([layer.router.weight], modifier_rank=0):
                        layer.router.weight.normal_(0, 0.3)
                else:
                    layer.router.weight.normal_(0, 0.3)
        return model

    callbacks = [ExpertBiasBalancer(gamma)] if gamma > 0 else []
    trainer = RecipeTrainer(model_init=model_init, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))

    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    layers = {}
    for name, module in trainer.model.named_modules():
        if isinstance(module, AutoEPMoELayer):
            layers[name] = {
                "deepspeed_tokens_per_expert": module.tokens_per_expert.long().tolist(),
                "ep_rank": module.ep_rank,
                "ep_size": module.ep_size,
                "deepspeed_ep_group": torch.distributed.get_process_group_ranks(module.ep_group),
                "runtime_ep_group": trainer.runtime.facts.layout.ep_group(args.process_index),
                "num_local_experts": module.num_local_experts,
                "bias": module.router.e_score_correction_bias.tolist(),
            }
    out = Path(output_dir) / "expert_load"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}.json").write_text(
        json.dumps(
            {
                "rank": args.process_index,
                "world_size": args.world_size,
                "layers": layers,
                "routed": [x.name for x in find_routed_layers(trainer.model)],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
