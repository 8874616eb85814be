"""Run on every rank by tests/distributed/test_setup_checks.py under `accelerate launch` with a generated ZeRO-3
config whose plan assumed activation checkpointing.

    setup_worker.py OUTPUT_DIR

Writes OUTPUT_DIR/setup/rank<N>.json with what RecipeTrainer did in five scenarios, in this order (the first needs
a process in which no arguments exist yet):
1. the model built before the arguments (`from_config`, not partitioned) -> the constructor's error;
2. built after the arguments with `from_config` (partitioned under zero.Init) -> accepted;
3. built after the arguments by calling its class (not partitioned) -> the constructor's error;
4. default arguments: activation checkpointing from the plan; 2 training steps;
5. `activation_checkpointing=False` against that plan -> the constructor's error naming the fix; with
   `allow_no_recompute=True`: 1 training step and the warning;
6. a model class without activation-checkpointing support (`supports_gradient_checkpointing = False`) under that
   plan -> the constructor's error naming the fix; with `allow_no_recompute=True`: 1 training step without
   recomputation and the warning.
7. micro batch 1 (the plan's) x accumulation 2 (not the plan's 1): 1 training step, no batch warning.
Scenario 4 trains at micro batch 2 against the plan's 1: rank 0's start-up warning is in "batch_warning".
"""

import json
import sys
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import stdlib_dataset, token_blocks
from hf_dist_recipes.parallel.construction import unpartitioned_bytes

LIMIT = "1KB"  # far below tiny-llama's 0.4 MB, so only a partitioned model passes


class NoRecomputeLlama(LlamaForCausalLM):
    """tiny-llama under a class that, like many remote-code models, declares no activation-checkpointing support."""

    supports_gradient_checkpointing = False


def main(output_dir: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    config = template_config("tiny-llama")
    data = stdlib_dataset(seq_len=32, max_bytes=50_000)
    data = token_blocks(data, config.vocab_size)
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        max_unpartitioned_model_size=LIMIT,
    )
    out: dict = {}

    early = AutoModelForCausalLM.from_config(config)  # before any arguments: a full copy on this rank
    out["before_args_bytes"] = unpartitioned_bytes(early)
    out["before_args"] = _construct(lambda: RecipeTrainer(model=early, args=RecipeTrainingArguments(**common)))

    # Fresh arguments for every trainer, as in a script (a second Accelerator with a DeepSpeed plugin is refused
    # unless new arguments reset the state first).
    args = RecipeTrainingArguments(**common)
    out["after_args"] = _construct(lambda: RecipeTrainer(model=AutoModelForCausalLM.from_config(config), args=args))
    args = RecipeTrainingArguments(**common)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    out["direct_class"] = _construct(lambda: RecipeTrainer(model=model_class(config), args=args))

    planned = RecipeTrainingArguments(max_steps=2, **common)
    trainer = RecipeTrainer(model=AutoModelForCausalLM.from_config(config), args=planned, train_dataset=data)
    trainer.train()
    out["planned"] = {
        "activation_checkpointing": planned.activation_checkpointing,
        "model_recomputes": trainer.model.is_activation_checkpointing,
        "warnings": trainer.plan_conformance.warnings,
        "batch_warning": trainer.plan_conformance.batch_warning,
        "bf16": planned.bf16,
    }

    refused = RecipeTrainingArguments(max_steps=1, activation_checkpointing=False, **common)
    out["refused"] = _construct(lambda: RecipeTrainer(model=AutoModelForCausalLM.from_config(config), args=refused))
    refused = RecipeTrainingArguments(max_steps=1, activation_checkpointing=False, allow_no_recompute=True, **common)
    out["refused_allowed"] = _train_one_step(AutoModelForCausalLM.from_config(config), refused, data)

    args = RecipeTrainingArguments(max_steps=1, **common)
    out["cannot"] = _construct(lambda: RecipeTrainer(model=NoRecomputeLlama._from_config(config), args=args))
    allowed = RecipeTrainingArguments(max_steps=1, allow_no_recompute=True, **common)
    out["cannot_allowed"] = _train_one_step(NoRecomputeLlama._from_config(config), allowed, data)

    accumulated = RecipeTrainingArguments(
        **{**common, "per_device_train_batch_size": 1}, gradient_accumulation_steps=2, max_steps=1
    )
    out["accumulated"] = _train_one_step(AutoModelForCausalLM.from_config(config), accumulated, data)

    target = Path(output_dir) / "setup"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{planned.process_index}.json").write_text(json.dumps(out))


def _train_one_step(model, args, data) -> dict:
    trainer = RecipeTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {
        "activation_checkpointing": args.activation_checkpointing,
        "model_recomputes": trainer.model.is_activation_checkpointing,
        "warnings": trainer.plan_conformance.warnings,
        "batch_warning": trainer.plan_conformance.batch_warning,
        "steps": trainer.state.global_step,
        "engine_batch": [
            trainer.model_wrapped.train_micro_batch_size_per_gpu(),
            trainer.model_wrapped.gradient_accumulation_steps(),
        ],
    }


def _construct(build) -> dict:
    try:
        trainer = build()
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None, "unpartitioned_bytes": unpartitioned_bytes(trainer.model)}


if __name__ == "__main__":
    main(sys.argv[1])
