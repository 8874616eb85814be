"""Ulysses SP on the tiny DeepSeek-V3 model (MLA + MoE), for tests/distributed/test_sequence_parallel.py.

    sp_worker.py OUTPUT_DIR STEPS single INIT DP...    (one process, no DeepSpeed, no SP: the references)
    sp_worker.py OUTPUT_DIR STEPS recipe|recipe-early|stock|recipe+stock INIT    (every rank, `accelerate launch`)

The single run first saves a seeded `from_config` model to INIT; every run then trains those weights
(`from_pretrained`, under ZeRO-3 partitioned as it loads) with sdpa attention on 32-token blocks of the standard
library's source, taken in order (`train_sampling_strategy="sequential"`), micro batch 1, AdamW, clipping 1.0; the SP
runs also compute the loss 8 tokens at a time and the MLPs in 2 slices (the reference neither). Each writes
OUTPUT_DIR/rank<N>.json: per-step losses and gradient norms, the eval losses (before training too: the 2-rank SP
run's evaluation registers Ulysses before its training does), tokens counted, the config's `head_dim`
after training and the one saved, the SP degree the trainer saw, or the error that stopped it.

Under SP with DP replicas (world / SP) optimizer step k takes one block per replica: replica d's SP group processes
the block its first rank's loader gave, then the next rank's. The reference reproduces that order with micro
batch DP (`reference_order`), so each step sees the same blocks.
"""

import json
import sys
import traceback
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import TokenBlocks, stdlib_dataset, token_blocks
from hf_dist_recipes.parallel.sequence_parallel import with_position_ids

MODEL = "tiny-deepseek-v3"
SP = 2


def reference_order(blocks: int, dp: int, sp: int = SP) -> list[int]:
    """Block indices in the order one process must see them (micro batch `dp`) to take, at each step, the blocks
    the SP x DP run does: within a window of dp x sp blocks, step j takes block j of each replica's sp blocks."""
    window = dp * sp
    order = []
    for start in range(0, blocks - blocks % window, window):
        for j in range(sp):
            order += [start + d * sp + j for d in range(dp)]
    return order


def main(output_dir: str, steps: int, flavour: str, init: str, dp: int = 1) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    single = flavour == "single"
    # recipe-early: the model loaded before the arguments, so not under zero.Init, which would have initialised
    # DeepSpeed's communication; the SP set-up then needs the recipe's (on CPU accelerate leaves it out)
    early = (
        AutoModelForCausalLM.from_pretrained(init, attn_implementation="sdpa") if flavour == "recipe-early" else None
    )
    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=dp if single else 1,
        learning_rate=3e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        seed=7,
    )
    if flavour == "stock":
        trainer_class, args = Trainer, TrainingArguments(use_cpu=True, **common)
    elif single:
        trainer_class, args = RecipeTrainer, RecipeTrainingArguments(**common)
    else:  # ALST's other pieces on as well: the loss 8 tokens at a time, the MLPs in 2 slices
        trainer_class = RecipeTrainer
        args = RecipeTrainingArguments(**common, loss_chunk_tokens=8, tiled_mlp_shards=2)
    if single and not Path(init).exists():
        AutoModelForCausalLM.from_config(template_config(MODEL)).save_pretrained(init)
    # Ulysses refuses eager attention
    model = early or AutoModelForCausalLM.from_pretrained(init, attn_implementation="sdpa")
    blocks = token_blocks(stdlib_dataset(seq_len=32, max_bytes=40_000), model.config.vocab_size)
    held_out = TokenBlocks(blocks.tokens[-4:])  # evaluated after training, whole on every rank
    if single:
        blocks = TokenBlocks(blocks.tokens[reference_order(len(blocks), dp)])
    head_dim = model.config.head_dim
    record = {"rank": args.process_index, "flavour": flavour, "head_dim_before": head_dim}
    try:
        # The stock twin gets the positions the SP adapter requires (the recipe adds them itself), so that what stops
        # it is the MLA head sizes
        collator = with_position_ids(default_data_collator) if flavour == "stock" else None
        import deepspeed.comm

        record["comm_before_trainer"] = deepspeed.comm.is_initialized()
        trainer = trainer_class(model=model, args=args, train_dataset=blocks, data_collator=collator)
        record["sp_size"] = getattr(trainer, "sp_size", None)
        if flavour in ("recipe", "single"):  # an evaluation's prepare registers Ulysses before the training one does
            record["eval_first_loss"] = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
        trainer.train()
        trainer.save_model(str(Path(output_dir) / "final"))
        trainer.accelerator.wait_for_everyone()  # rank 0 writes the config
        saved = json.loads((Path(output_dir) / "final" / "config.json").read_text())
        record["eval_loss"] = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
        if not single:  # a limit below the eval sequences' 32 tokens stops evaluation before it runs
            trainer.args.sp_eval_max_length = 16
            try:
                trainer.evaluate(eval_dataset=held_out)
            except ValueError as error:
                record["eval_refused"] = str(error)
        record.update(
            tokens=trainer.runtime.rank_metrics.tokens,
            data_ok=trainer.rank_agreement.begin_report.get("rank_check/data_ok"),
            chunked_loss_ran=bool(trainer.chunked_loss and trainer.chunked_loss.checked),
            tiled_mlps=sum(hasattr(m, "recipe_untiled_forward") for m in model.modules()),
            losses=[e["loss"] for e in trainer.state.log_history if "loss" in e],
            grad_norms=[e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
            head_dim_after=model.config.head_dim,
            head_dim_saved=saved.get("head_dim"),
        )
    except Exception as error:  # the stock twin's failure, recorded for the test
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()[-3000:]
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    output_dir, steps, flavour, init, *dps = sys.argv[1:]
    if flavour == "single":
        for dp in dps:  # one reference per DP degree, in this one process
            main(str(Path(output_dir) / f"dp{dp}"), int(steps), flavour, init, int(dp))
    elif flavour == "recipe+stock":
        # The recipe's run first, in fresh processes; then, to spare a launch, the stock twin in the same ranks, from
        # what a fresh process would hold: the model's own sdpa (the recipe's registration wrapped it) and no SP groups.
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from hf_dist_recipes._compat.deepspeed import forget_sequence_parallel_groups

        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        main(output_dir, int(steps), "recipe", init)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        forget_sequence_parallel_groups()
        main(str(Path(output_dir) / "stock"), int(steps), "stock", init)
    else:
        main(output_dir, int(steps), flavour, init)
