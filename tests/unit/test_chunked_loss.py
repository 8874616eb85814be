"""The chunked cross-entropy (`hf_dist_recipes.parallel.chunked_loss`) equals transformers' causal-LM loss, keeps no
more than one chunk's logits, and trains RecipeTrainer to the same losses as the stock loss (one process; 2 ZeRO-3
ranks with the LM head partitioned: tests/distributed/test_grad_reduce_dtype.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.parallel.chunked_loss import ChunkedLoss, chunked_causal_lm_loss
from tests.support.models import SMALL

VOCAB = 512
SEQ = 24


def _llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def _batch(rows: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels with ignored tokens: a masked prompt, padding at the end, one row nearly all ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, 15:] = -100
    labels[-1, 2:] = -100
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("chunk", [1, 5, 24, 1000])
@pytest.mark.parametrize("num_items", [None, 37])
def test_equals_the_stock_causal_lm_loss_and_its_gradients(chunk, num_items):
    model = _llama()
    ids, labels = _batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    plain = model(input_ids=ids, labels=labels, **kwargs).loss
    plain.backward()
    expected = _grads(model)
    chunked = ChunkedLoss(chunk).bind(model, model)(input_ids=ids, labels=labels, **kwargs)
    assert chunked.logits is None
    chunked.loss.backward()
    got = _grads(model)
    assert abs(chunked.loss.item() - plain.item()) <= 1e-6
    assert max((got[n] - expected[n]).abs().max().item() for n in expected) <= 1e-6


def test_the_function_matches_for_cause_lm_loss_with_shift_labels_and_a_mean():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3:6] = -100
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reference = ForCausalLMLoss(head(hidden), labels, vocab_size=50)
    for kwargs in ({"labels": labels}, {"labels": None, "shift_labels": shifted}):
        ours = chunked_causal_lm_loss(hidden, head=head, chunk_tokens=4, **kwargs)
        assert abs(ours.item() - reference.item()) <= 1e-6
    # every label ignored: NaN, as cross_entropy's mean
    assert chunked_causal_lm_loss(hidden, torch.full_like(labels, -100), head, 4).isnan()


def test_the_full_logits_never_exist_forward_or_backward():
    """The LM head never sees more tokens than a chunk, but once: the model's own call, on the last position of each
    sequence (logits_to_keep=1). With the stock loss it sees every token: what this test would catch."""
    model = _llama()
    ids, labels = _batch()
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    model(input_ids=ids, labels=labels).loss.backward()
    assert seen == [ids.numel()]
    seen.clear()
    chunk = 10
    loss = ChunkedLoss(chunk).bind(model, model)(input_ids=ids, labels=labels).loss
    forward = list(seen)
    loss.backward()
    recomputed = seen[len(forward) :]
    rows = ids.shape[0]
    # the model's own call (last positions), the first-call check (the same), then the chunks
    assert forward[:2] == [rows, rows] and max(forward[2:]) == chunk and sum(forward[2:]) == ids.numel()
    assert recomputed and max(recomputed) <= chunk and sum(recomputed) == ids.numel()


def test_a_model_whose_logits_are_not_its_head_on_the_hidden_states_is_refused():
    class Scaled(LlamaForCausalLM):  # as Cohere's logit_scale or Gemma's soft-capping: not lm_head(hidden) alone
        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    model = Scaled(_llama().config)
    ids, labels = _batch()
    with pytest.raises(ValueError, match="not its LM head applied.*loss_chunk_tokens=0"):
        ChunkedLoss(8).bind(model, model)(input_ids=ids, labels=labels)


def test_a_model_without_an_lm_head_is_refused():
    from transformers import LlamaModel

    model = LlamaModel(_llama().config)
    with pytest.raises(ValueError, match="LM head over a base model.*loss_chunk_tokens=0"):
        ChunkedLoss(8).bind(model, model)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_chunk_tokens_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="positive number of tokens per loss chunk"):
        ChunkedLoss(bad)


class _Rows(torch.utils.data.Dataset):
    """Rows of 24 tokens whose labels ignore a different number of tokens each (so the micro-batches of a step hold
    different label counts, which `num_items_in_batch` weighs)."""

    def __init__(self, n: int = 32, vocab: int = 256):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: (i * 5) % 17] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _train(tmp_path, **overrides) -> RecipeTrainer:
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **overrides,
    )
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL), args=args, train_dataset=_Rows(), eval_dataset=_Rows(8)
    )
    trainer.train()
    return trainer


def test_recipe_trainer_trains_to_the_stock_losses(tmp_path):
    """The tiny DeepSeek-V3 model, gradient accumulation 2, ignored labels: the same loss and gradient-norm history,
    and evaluation (the stock path, which returns logits) gives the same loss."""
    plain = _train(tmp_path / "plain")
    chunked = _train(tmp_path / "chunked", loss_chunk_tokens=7)
    assert chunked.chunked_loss is not None and chunked.chunked_loss.checked and plain.chunked_loss is None
    logs = [[e for e in t.state.log_history if "loss" in e] for t in (plain, chunked)]
    assert len(logs[0]) == 4
    for a, b in zip(*logs, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
    assert abs(plain.evaluate()["eval_loss"] - chunked.evaluate()["eval_loss"]) <= 1e-6


def test_label_smoothing_with_chunks_is_refused(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1; drop it, or set loss_chunk_tokens=0"):
        _train(tmp_path, loss_chunk_tokens=8, label_smoothing_factor=0.1)


def test_a_trainer_with_its_own_compute_loss_under_the_recipe_is_refused(tmp_path):
    """recipe(SFTTrainer)-like: a Trainer class whose compute_loss runs under the recipe's (trl's reads the logits for
    its token accuracy); a subclass of RecipeTrainer overriding compute_loss above the recipe is the user's own."""
    from transformers import Trainer

    from hf_dist_recipes import recipe

    class ReadsLogits(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = RecipeTrainingArguments(output_dir=str(tmp_path), report_to="none", loss_chunk_tokens=8)
    with pytest.raises(ValueError, match="ReadsLogits.* computes its loss its own way.*loss_chunk_tokens=0"):
        recipe(ReadsLogits)(model=build_tiny_deepseek(**SMALL), args=args)

    class Mine(RecipeTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    assert Mine(model=build_tiny_deepseek(**SMALL), args=args).chunked_loss.chunk_tokens == 8


# The estimate: DeepSeek-V3 (vocabulary 129,280) at sequence 4,096 and micro batch 3, the shipped 8-node plan.
DSV3_PLAN = ["--model", "deepseek-v3", "--nodes", "8", "--ep", "16", "--micro-batch", "3", "--grad-accum", "5"]
DSV3_PLAN += ["--offload-optimizer", "--activation-checkpointing", "--gpu-memory", "80"]


def _estimate_json(capsys, *flags: str) -> dict:
    import json

    from hf_dist_recipes.cli.main import main

    code = main(["config", "estimate", *DSV3_PLAN, *flags, "--json"])
    row = json.loads(capsys.readouterr().out)["estimates"][0]
    assert code == (1 if row["fits"] is False else 0)  # exit 1: the plan does not fit the 80 GiB
    return row


def test_the_estimate_counts_one_chunk_of_logits(capsys):
    """By the reasons of `memory.logits_bytes`, computed here: in the loss's backward three fp32 tensors (4 bytes
    each) of the logits' shape are alive: 3 x 4,096 tokens x 129,280 x 12 bytes = 17.75 GiB; with the chunked loss
    only one chunk's logits exist, in either pass: 1,024 tokens x 129,280 x 12 bytes = 1.48 GiB."""
    vocab, fp32_tensors = 129_280, 3
    plain = _estimate_json(capsys)
    chunked = _estimate_json(capsys, "--loss-chunk-tokens", "1024")
    assert plain["activation_parts"]["logits"] == 3 * 4096 * vocab * fp32_tensors * 4
    assert round(plain["activation_parts"]["logits"] / 2**30, 2) == 17.75
    assert chunked["activation_parts"]["logits"] == 1024 * vocab * fp32_tensors * 4
    assert round(chunked["activation_parts"]["logits"] / 2**30, 2) == 1.48
    assert chunked["plan"]["loss_chunk_tokens"] == 1024 and plain["plan"]["loss_chunk_tokens"] is None
    # nothing else changes: the whole saving is the logits'
    saving = plain["activation_parts"]["logits"] - chunked["activation_parts"]["logits"]
    assert plain["activations"] - chunked["activations"] == saving
    # a chunk larger than the micro-batch's tokens counts the tokens there are
    whole = _estimate_json(capsys, "--loss-chunk-tokens", str(10**6))
    assert whole["activation_parts"]["logits"] == 3 * 4096 * vocab * fp32_tensors * 4


def test_a_plan_refuses_a_chunk_that_is_not_a_positive_count():
    from hf_dist_recipes.planning.plan import ParallelPlan

    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="--loss-chunk-tokens N"):
            ParallelPlan(loss_chunk_tokens=bad).validate()


def test_no_vocabulary_parallel_head_with_the_chunked_loss():
    """The generated JSON keeps the head whole under TP when the plan chunks its loss (the chunk needs every
    vocabulary entry's logit; the first call refuses a vocabulary-parallel head)."""
    from hf_dist_recipes.planning.models import introspect
    from hf_dist_recipes.planning.plan import ParallelPlan
    from hf_dist_recipes.planning.zero_buffers import use_vocab_parallel_lm_head

    model = introspect("deepseek-v3")
    plan = ParallelPlan(nodes=2, tp=8, ep=16, micro_batch=3)
    assert use_vocab_parallel_lm_head(plan, model)
    assert not use_vocab_parallel_lm_head(
        ParallelPlan(nodes=2, tp=8, ep=16, micro_batch=3, loss_chunk_tokens=1024), model
    )


def test_generate_records_the_chunk_and_the_arguments_take_it(tmp_path, monkeypatch):
    """config generate records --loss-chunk-tokens in the JSON (only when given: files generated without it are as
    before); RecipeTrainingArguments take it from the launcher's config unless given, 0 turning it off."""
    import json

    from hf_dist_recipes._compat import accelerate as compat_accelerate
    from hf_dist_recipes.cli.main import main
    from hf_dist_recipes.parallel.plan_record import recorded_plan

    base = ["config", "generate", "--cpu", "--gpus-per-node", "2", "--output", str(tmp_path)]
    assert main([*base, "--name", "plain"]) == 0
    assert main([*base, "--name", "chunked", "--loss-chunk-tokens", "512"]) == 0
    plain = json.loads((tmp_path / "deepspeed" / "plain.json").read_text())
    chunked = json.loads((tmp_path / "deepspeed" / "chunked.json").read_text())
    assert "loss_chunk_tokens" not in recorded_plan(plain) and recorded_plan(chunked)["loss_chunk_tokens"] == 512
    monkeypatch.setenv(compat_accelerate.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE, str(tmp_path / "deepspeed" / "chunked.json"))
    out = str(tmp_path / "run")
    assert RecipeTrainingArguments(output_dir=out, use_cpu=True).loss_chunk_tokens == 512
    assert RecipeTrainingArguments(output_dir=out, use_cpu=True, loss_chunk_tokens=64).loss_chunk_tokens == 64
    assert RecipeTrainingArguments(output_dir=out, use_cpu=True, loss_chunk_tokens=0).loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="positive number of tokens per loss chunk.*or 0 or None for the stock loss"):
        RecipeTrainingArguments(output_dir=out, use_cpu=True, loss_chunk_tokens=-8)
