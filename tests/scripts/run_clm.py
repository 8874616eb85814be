#!/usr/bin/env python
"""A script in the shape of transformers' examples/pytorch/language-modeling/run_clm.py, with one import changed:

    from hf_dist_recipes import RecipeTrainingArguments as TrainingArguments, RecipeTrainer as Trainer

Kept from run_clm: `ModelArguments` / `DataTrainingArguments` dataclasses parsed with `TrainingArguments` by
`HfArgumentParser` (or from one JSON file), a model from `--model_type` + `--config_overrides` or from
`--model_name_or_path`, the tokenizer from `--tokenizer_name` or the model's folder, `load_dataset("text", ...)`
on local files, tokenize then `group_texts` in blocks of `--block_size` (both under `main_process_first`),
`trainer.train(resume_from_checkpoint=...)`, `save_model`, `log_metrics`/`save_metrics`/`save_state`, `evaluate`
with perplexity. Left out: Hub datasets and streaming, the `evaluate` package (the accuracy is computed here; that
package downloads its metric), the model card. Local data and tokenizer: tests/scripts/clm_data.py.

    python tests/scripts/clm_data.py /tmp/clm
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml tests/scripts/run_clm.py \\
        --model_type llama --tokenizer_name /tmp/clm/tokenizer --config_overrides hidden_size=64,... \\
        --train_file /tmp/clm/train.txt --validation_file /tmp/clm/validation.txt --do_train --do_eval ...
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
import torch
import transformers
from datasets import load_dataset
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

# isort: split
# The one changed line: run_clm imports Trainer and TrainingArguments from transformers.
from hf_dist_recipes import RecipeTrainingArguments as TrainingArguments, RecipeTrainer as Trainer  # noqa: I001

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Arguments pertaining to which model/config/tokenizer we are going to fine-tune, or train from scratch."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The model checkpoint for weights initialization. Don't set to train from scratch."},
    )
    model_type: str | None = field(
        default=None, metadata={"help": "If training from scratch, a model type such as llama or deepseek_v3."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Override some default config settings when a model is trained from scratch. Example: "
            "hidden_size=64,num_hidden_layers=2"
        },
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Pretrained config name or path if not the same as model_name"}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Pretrained tokenizer name or path if not the same as model_name"}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store the processed datasets."})
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Override the default `torch.dtype` and load the model under this dtype.",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )

    def __post_init__(self):
        if self.config_overrides is not None and (self.config_name is not None or self.model_name_or_path is not None):
            raise ValueError(
                "--config_overrides can't be used in combination with --config_name or --model_name_or_path"
            )


@dataclass
class DataTrainingArguments:
    """Arguments pertaining to what data we are going to input our model for training and eval."""

    train_file: str | None = field(default=None, metadata={"help": "The input training data file (a text file)."})
    validation_file: str | None = field(
        default=None, metadata={"help": "An optional input evaluation data file to evaluate the perplexity on."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Truncate the number of training examples to this value if set."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Truncate the number of evaluation examples to this value if set."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Sequence length after tokenization; the texts are cut in blocks of it."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Overwrite the cached training and evaluation sets"})
    validation_split_percentage: int | None = field(
        default=5,
        metadata={"help": "The percentage of the train set used as validation set if there's no validation file"},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "The number of processes to use for the preprocessing."}
    )
    keep_linebreaks: bool = field(default=True, metadata={"help": "Whether to keep line breaks in TXT files."})

    def __post_init__(self):
        if self.train_file is None and self.validation_file is None:
            raise ValueError("Need a training/validation file.")


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(
        f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}"
    )

    set_seed(training_args.seed)

    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset(
        "text", data_files=data_files, cache_dir=model_args.cache_dir, keep_linebreaks=data_args.keep_linebreaks
    )
    if "validation" not in raw_datasets:
        pct = data_args.validation_split_percentage
        raw_datasets["validation"] = load_dataset(
            "text", data_files=data_files, split=f"train[:{pct}%]", cache_dir=model_args.cache_dir
        )
        raw_datasets["train"] = load_dataset(
            "text", data_files=data_files, split=f"train[{pct}%:]", cache_dir=model_args.cache_dir
        )

    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        logger.warning("You are instantiating a new config instance from scratch.")
        if model_args.config_overrides is not None:
            config.update_from_string(model_args.config_overrides)

    if model_args.tokenizer_name:
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    elif model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    else:
        raise ValueError("Give --tokenizer_name (tests/scripts/clm_data.py writes one) or --model_name_or_path.")

    if model_args.model_name_or_path:
        dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config)
        n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
        logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    split = "train" if training_args.do_train else "validation"
    column_names = list(raw_datasets[split].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(
            tokenize_function,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=column_names,
            load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )

    block_size = min(data_args.block_size or 1024, tokenizer.model_max_length)

    # Concatenate the texts and cut them in blocks of block_size (the remainder of each map batch is dropped).
    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(
            group_texts,
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"Grouping texts in chunks of {block_size}",
        )

    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

        def preprocess_logits_for_metrics(logits, labels):
            if isinstance(logits, tuple):
                logits = logits[0]
            return logits.argmax(dim=-1)

        def compute_metrics(eval_preds):
            preds, labels = eval_preds
            labels = labels[:, 1:].reshape(-1)
            preds = preds[:, :-1].reshape(-1)
            return {"accuracy": float(np.mean(preds == labels))}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the tokenizer too

        metrics = train_result.metrics
        max_train_samples = data_args.max_train_samples or len(train_dataset)
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        max_eval_samples = data_args.max_eval_samples or len(eval_dataset)
        metrics["eval_samples"] = min(max_eval_samples, len(eval_dataset))
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
