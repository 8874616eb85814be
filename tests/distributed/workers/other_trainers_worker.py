"""Run on every rank by tests/distributed/test_other_trainers.py under `accelerate launch` with the shipped
2-process ZeRO-3 CPU config: the recipe applied to trl's `SFTTrainer` and to transformers' `Seq2SeqTrainer`.

    other_trainers_worker.py OUTPUT_DIR SFT_STEPS

1. `recipe(SFTTrainer)` trains a tiny Llama-style model (from a config) on text lines with a character-level BPE
   tokenizer trained here with `tokenizers` (no downloads), from an `SFTConfig` that leaves the schedule at the
   recipe's defaults (warm-up 5% of the steps, 3 cosine cycles with hard restarts, no floor). Every optimizer step
   records the learning rate the live engine's optimizer holds (what that step applies) and, after training, the
   clip value the engine applies. The `SFTConfig` is the process's first arguments: its post-init creates the
   process group, before the recipe upgrades it (the plain route of issue 30 section 1); the process state at
   train begin and the recipe's warnings are recorded (`tests.support.process_state`).
2. `recipe(DPOTrainer)` trains a second tiny Llama-style model by DPO on a preference set made here from the same
   text (prompt: a line's start; chosen: its true continuation; rejected: that continuation reversed), with an
   explicit reference model built from the same seed, so policy and reference start equal. Records the logged
   losses, whether the reference model (a ZeRO-3 inference engine of its own, trl's `prepare_deepspeed`) still holds
   its initial weights after training, gathered, and whether the policy moved.
3. `recipe(Seq2SeqTrainer)` trains a tiny T5 (from a config) for a few steps to copy short token sequences, then
   `predict()`s with `predict_with_generate=True` and `generation_max_length=7` (ZeRO-3: every rank generates,
   `synced_gpus`), and evaluates.

Writes OUTPUT_DIR/result/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    TrainerCallback,
    set_seed,
)
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_dist_recipes import RecipeTrainingArguments, recipe, recipe_arguments
from hf_dist_recipes.core.model_templates import template_config
from tests.support.process_state import ProcessStateAtTrainBegin, recipe_warnings

GENERATION_MAX_LENGTH = 7
SEQ2SEQ_STEPS = 6
DPO_STEPS = 12


class EngineLearningRates(TrainerCallback):
    """The learning rate the engine's optimizer holds at the start of each optimizer step."""

    def __init__(self):
        self.trainer = None
        self.lrs: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.lrs.append(self.trainer.model_wrapped.optimizer.param_groups[0]["lr"])


# What the SFT and DPO runs set alike, as a trl user writes it; bf16=False: trl's default (bf16 unless fp16) refuses
# a CPU run before any recipe code.
TRL_ARGS = dict(
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    bf16=False,
    seed=7,
)


def _llama_config(tokenizer):
    """A tiny Llama-style config sized to `tokenizer`, its special tokens the tokenizer's (no BOS)."""
    config = template_config("tiny-llama")
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    return config


def _text_lines() -> list[str]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if len(line.strip()) > 20][:256]


def _tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A BPE of at most 200 entries over the characters of `lines` (deterministic: same text, same trainer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<eos>", "<unk>"], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft(output_dir: str, steps: int, lines: list[str], tokenizer) -> dict:
    config = _llama_config(tokenizer)
    # The first arguments of the process: their own post-init creates the process group (the plain route).
    with recipe_warnings() as warnings_seen:
        args = SFTConfig(
            output_dir=output_dir,
            max_steps=steps,
            max_length=48,
            **TRL_ARGS,
        )
        probe, process_state = EngineLearningRates(), ProcessStateAtTrainBegin()
        set_seed(args.seed)  # an SFTConfig does not seed: as transformers' examples do, before building the model
        trainer = recipe(SFTTrainer)(
            model=AutoModelForCausalLM.from_config(config),
            args=args,
            train_dataset=Dataset.from_dict({"text": lines}),
            processing_class=tokenizer,
            callbacks=[probe],
        )
    trainer.add_callback(process_state)  # after the recipe's callbacks: sees the state they leave at train begin
    probe.trainer = trainer
    trainer.train()
    engine = trainer.model_wrapped
    return {
        "trainer_class": type(trainer).__name__,
        "args_class": type(trainer.args).__name__,
        "args_is_sftconfig": isinstance(trainer.args, SFTConfig),
        "args_is_recipe": isinstance(trainer.args, RecipeTrainingArguments),
        "max_length": trainer.args.max_length,
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "lr_scheduler_type": str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type)),
        "lr_scheduler_kwargs": trainer.args.lr_scheduler_kwargs,
        "warmup_steps": trainer.args.get_warmup_steps(steps),
        "lrs": probe.lrs,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "gradient_clipping": engine.gradient_clipping(),
        "zero_clip_grad": getattr(engine.optimizer, "clip_grad", None),
        "zero_stage": engine.zero_optimization_stage(),
        "logging_dir": trainer.args.logging_dir,
        "process_state": process_state.state,
        "recipe_warnings": warnings_seen,
    }


def _preferences(lines: list[str]) -> Dataset:
    """Prompt: a line's first 12 characters; chosen: the next 12 as written; rejected: those 12 reversed."""
    rows = [(line[:12], line[12:24], line[12:24][::-1]) for line in lines if len(line) >= 24]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def _full_weights(module) -> dict[str, torch.Tensor]:
    """Every parameter of `module` (ZeRO-3 partitioned or not) as full CPU tensors, on every rank."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone().cpu() for name, p in params.items()}


def _partitioned(module) -> bool:
    """Every parameter of `module` is a ZeRO-3 partition (its local tensor empty until gathered)."""
    return all(hasattr(p, "ds_id") and p.numel() == 0 for p in module.parameters())


def dpo(output_dir: str, lines: list[str], tokenizer) -> dict:
    config = _llama_config(tokenizer)
    # The route the docs give trl users (docs/your-script.md): the recipe's arguments of trl's class, made by the
    # script. It must say which defaults it put in place of DPOConfig's, as the plain route above does.
    with recipe_warnings() as warned_by_arguments:
        args = recipe_arguments(DPOConfig)(
            output_dir=output_dir,
            max_steps=DPO_STEPS,
            max_length=32,
            **TRL_ARGS,
        )
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    set_seed(args.seed)
    ref_model = AutoModelForCausalLM.from_config(config)  # the same seed: the reference equals the start
    # Built under the DPOConfig's ZeRO-3 (zero.Init: each rank holds a partition), so read gathered.
    initial = _full_weights(model)
    ref_initial = _full_weights(ref_model)
    starts_equal = sorted(ref_initial) == sorted(initial) and all(
        torch.equal(ref_initial[n], initial[n]) for n in initial
    )
    with recipe_warnings() as warnings_seen:
        trainer = recipe(DPOTrainer)(
            model=model,
            ref_model=ref_model,
            args=args,
            train_dataset=_preferences(lines),
            processing_class=tokenizer,
        )
    trainer.train()
    engine = trainer.model_wrapped
    ref_after = _full_weights(trainer.ref_model.module if hasattr(trainer.ref_model, "module") else trainer.ref_model)
    policy_after = _full_weights(engine.module)
    return {
        "trainer_class": type(trainer).__name__,
        "args_class": type(trainer.args).__name__,
        "zero_stage": engine.zero_optimization_stage(),
        "ref_is_engine": type(trainer.ref_model).__name__,
        "ref_zero_stage": trainer.ref_model.zero_optimization_stage(),
        "starts_equal": starts_equal,
        "ref_unchanged": sorted(ref_after) == sorted(initial)
        and all(torch.equal(ref_after[n], initial[n]) for n in initial),
        "ref_partitioned": _partitioned(trainer.ref_model),
        "policy_changed": [n for n in initial if not torch.equal(policy_after[n], initial[n])],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "rewards_accuracies": [e["rewards/accuracies"] for e in trainer.state.log_history if "rewards/accuracies" in e],
        "lr_scheduler_type": str(getattr(trainer.args.lr_scheduler_type, "value", trainer.args.lr_scheduler_type)),
        "lr_scheduler_kwargs": trainer.args.lr_scheduler_kwargs,
        "recipe_warnings": warned_by_arguments + warnings_seen,
    }


def seq2seq(output_dir: str, tokenizer) -> dict:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=pad,
        eos_token_id=eos,
        decoder_start_token_id=pad,
    )
    # Copy task: 4 random tokens (none special) and EOS, in and out.
    g = torch.Generator().manual_seed(0)
    rows = (torch.randint(3, len(tokenizer), (96, 4), generator=g)).tolist()
    data = Dataset.from_dict({"input_ids": [r + [eos] for r in rows], "labels": [r + [eos] for r in rows]})
    train, evaluation = data.select(range(80)), data.select(range(80, 96))
    args = Seq2SeqTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        max_steps=SEQ2SEQ_STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        predict_with_generate=True,
        generation_max_length=GENERATION_MAX_LENGTH,
        seed=7,
    )
    # Plain Seq2SeqTrainingArguments do not seed: as transformers' example scripts do, seed before building the model
    # (else the ranks' weights differ and the recipe's rank check stops the job, naming this fix).
    set_seed(args.seed)
    model = T5ForConditionalGeneration(config)
    # Never the pad token: each row then runs until EOS or the length cap, which shows the cap that applied.
    model.generation_config.suppress_tokens = [pad]
    trainer = recipe(Seq2SeqTrainer)(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    trainer.train()
    prediction = trainer.predict(evaluation)
    metrics = trainer.evaluate()
    return {
        "trainer_class": type(trainer).__name__,
        "args_class": type(trainer.args).__name__,
        "predict_with_generate": trainer.args.predict_with_generate,
        "generation_max_length": trainer.args.generation_max_length,
        "model_generation_max_length": model.generation_config.max_length,
        "predictions_shape": list(prediction.predictions.shape),
        "predictions_dtype": str(prediction.predictions.dtype),
        "first_tokens": sorted({int(t) for t in prediction.predictions[:, 0]}),
        "label_ids_shape": list(prediction.label_ids.shape),
        "predictions": prediction.predictions.tolist(),
        "eval_loss": metrics.get("eval_loss"),
        "test_loss": prediction.metrics.get("test_loss"),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "eval_samples": len(evaluation),
        "pad_token_id": pad,
    }


def main(output_dir: str, steps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    lines = _text_lines()
    tokenizer = _tokenizer(lines)
    out = Path(output_dir)
    result = {
        "sft": sft(str(out / "sft"), steps, lines, tokenizer),
        "dpo": dpo(str(out / "dpo"), lines, tokenizer),
        "seq2seq": seq2seq(str(out / "seq2seq"), tokenizer),
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / "result").mkdir(parents=True, exist_ok=True)
    (out / "result" / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
