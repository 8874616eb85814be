"""Drop-in: where the stock Trainer or TrainingArguments refuses an input, the recipe refuses it with an exception of
the same type (or a subclass) whose message contains upstream's, so a script or test that matches upstream's error
keeps working; where upstream accepts an input the recipe reads on its own (a DeepSpeed config), it accepts it too.
Each case runs through transformers' own classes first, whose error is the expected one (the fragment only checks
that upstream still says so), then through the recipe's, in the same folder. The recipe may add to the message
(the fix), never replace it. Found by running transformers' Trainer tests against RecipeTrainer (issue 39)."""

from __future__ import annotations

import base64
import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments

DS_JSON = json.dumps({"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": "auto"})
DS_BASE64 = base64.urlsafe_b64encode(DS_JSON.encode()).decode()

# (case, arguments, Trainer(...) overrides, train(...) kwargs or None to build the arguments alone,
#  upstream's exception type or None where upstream accepts the input, a fragment of upstream's message).
# "{tmp}" stands for the test's folder.
CASES = [
    ("resume_from_checkpoint=True, no checkpoint", {}, {}, {"resume_from_checkpoint": True},
     ValueError, "No valid checkpoint found in output directory ({tmp}/out)"),
    ("resume_from_checkpoint: no such folder", {}, {}, {"resume_from_checkpoint": "{tmp}/out/checkpoint-5"},
     ValueError, "Can't find a valid checkpoint at {tmp}/out/checkpoint-5"),
    ("deepspeed: no such file", {"deepspeed": "{tmp}/missing.json"}, {}, None,
     ValueError, "Expected a string path to an existing deepspeed config"),
    ("deepspeed: a file that is not JSON", {"deepspeed": "{tmp}/not.json"}, {}, None,
     json.JSONDecodeError, "Expecting value: line 1 column 1 (char 0)"),
    ("deepspeed: a JSON string", {"deepspeed": DS_JSON}, {}, None, None, None),
    ("deepspeed: a base64 JSON string", {"deepspeed": DS_BASE64}, {}, None, None, None),
    ("lr_scheduler_kwargs: a key cosine_with_restarts does not take",
     {"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"bogus": 1}}, {}, {},
     TypeError, "get_cosine_with_hard_restarts_schedule_with_warmup() got an unexpected keyword argument 'bogus'"),
    ("lr_scheduler_kwargs: the recipe's key with another schedule",
     {"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"min_lr_ratio": 0.1}}, {}, {},
     TypeError, "got an unexpected keyword argument 'min_lr_ratio'"),
    ("lr_scheduler_type: unknown", {"lr_scheduler_type": "bogus"}, {}, None, ValueError, "not a valid SchedulerType"),
    ("warmup_steps < 0", {"warmup_steps": -1}, {}, None, ValueError, "Expected value warmup_steps >= 0"),
    ("fp16 and bf16", {"fp16": True, "bf16": True}, {}, None, ValueError, "At most one of fp16 and bf16"),
    ("no train_dataset", {}, {"train_dataset": None}, {}, ValueError, "training requires a train_dataset"),
    ("no model", {}, {"model": None}, {}, RuntimeError, "requires either a `model` or `model_init` argument"),
]  # fmt: skip


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        ids = torch.arange(8) % 32
        return {"input_ids": ids, "labels": ids}


def _tiny_model():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def _in(folder, value):
    if isinstance(value, str):
        return value.replace("{tmp}", str(folder))
    return {k: _in(folder, v) for k, v in value.items()} if isinstance(value, dict) else copy.deepcopy(value)


def _first_error(arguments_class, trainer_class, folder, arguments, trainer, train) -> Exception | None:
    """The exception building the arguments, then the trainer, then training raised first; None if none."""
    try:
        args = arguments_class(
            output_dir=str(folder / "out"), use_cpu=True, report_to=[], max_steps=1, save_strategy="no", **arguments
        )
        if train is not None:
            kwargs = {"model": _tiny_model(), "args": args, "train_dataset": Tokens(), **trainer}
            trainer_class(**kwargs).train(**train)
    except Exception as err:  # noqa: BLE001 - any type: the point is to compare them
        return err
    return None


@pytest.mark.parametrize(
    ("case", "arguments", "trainer", "train", "kind", "fragment"), CASES, ids=[c[0] for c in CASES]
)
def test_the_recipe_raises_what_upstream_raises(tmp_path, case, arguments, trainer, train, kind, fragment):
    (tmp_path / "not.json").write_text("not json\n")
    arguments, trainer, train = _in(tmp_path, arguments), _in(tmp_path, trainer), _in(tmp_path, train)
    stock = _first_error(TrainingArguments, Trainer, tmp_path, arguments, trainer, train)
    ours = _first_error(RecipeTrainingArguments, RecipeTrainer, tmp_path, arguments, trainer, train)
    if kind is None:
        assert stock is None and ours is None, (stock, ours)
        return
    assert type(stock) is kind and _in(tmp_path, fragment) in str(stock), f"upstream changed: {stock!r}"
    assert isinstance(ours, type(stock)), f"upstream raises {stock!r}, the recipe {ours!r}"
    assert str(stock) in str(ours), f"the recipe replaced upstream's message:\n{stock}\n{ours}"
