"""Chunked cross-entropy: the causal-LM loss over token chunks, so the tokens x vocabulary fp32 logits never exist.

Why: the logits and the loss over them are the largest activation of a large-vocabulary model. DeepSeek-V3
(vocabulary 129,280) at sequence 4,096 and micro batch 3 keeps 17.75 GiB for them in the loss's backward pass (three
fp32 tensors of the logits' shape, `memory.logits_bytes`), out of about 39 GiB of activations. Computed a chunk of
`chunk_tokens` tokens at a time, with each chunk's LM head + fp32 cross-entropy under activation checkpointing
(`torch.utils.checkpoint`, non-reentrant, transformers' own default), only one chunk's logits are alive at any
moment, in the forward pass and in the backward pass (which recomputes them a chunk at a time):
chunk_tokens x V x 12 bytes instead of tokens x V x 12 (`memory.chunked_logits_bytes`). The price is one more LM-head
matmul per token in the backward pass.

The loss is transformers' `ForCausalLMLoss` (loss/loss_utils.py), to the rounding of a sum taken in another order:
labels shifted by one (or the batch's `shift_labels`), `ignore_index` -100, the fp32 upcast of the logits, and the sum
over tokens divided by `num_items_in_batch` when the Trainer passes it (gradient accumulation: the label tokens of all
the micro-batches of the step), else by this batch's label tokens (a mean; 0 label tokens give NaN, as there).

How the model is driven, through public interfaces only: the whole model is called, as the engine always calls it,
with `logits_to_keep=1` (transformers' argument for generation: the LM head runs on the last position only, b x V
logits) and without labels (so it computes no loss); a forward hook on its base model (`model.base_model`, the
decoder stack under `lm_head`: Llama, DeepSeek-V3, Qwen, Mixtral, ...) keeps the final hidden states; then each chunk
calls the LM head module (`model.get_output_embeddings()`), not its weight, so that DeepSpeed ZeRO-3's module hooks
gather the partitioned weight for it and release it after, in the forward pass and in each chunk's recomputation.
Calling the whole model (not its base model and head one after the other) keeps ZeRO-3's hooks on the root module,
which start and end its parameter fetching for the step.

The first call checks that the model's logits are its LM head applied to those hidden states: the model's own
logits of the last position against the head's on the kept hidden states. A model that scales or caps its logits
after the head (Gemma's soft-capping, Cohere's logit scale) or DeepSpeed's vocabulary-parallel head (each TP rank
holds a slice of the vocabulary) fails it, with the fix, rather than training on another loss. A model that adds an
auxiliary loss to the language-model loss (Mixtral-style router losses, `output_router_logits=True`) is refused too.

Training only: evaluation and prediction take the stock path (`RecipeTrainer.compute_loss`), which returns the
logits their metrics need; forward-only, it keeps 10 bytes per logit, not 12 (`memory` module docstring).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default, and what its data collators pad labels with

OFF_FIX = "or set loss_chunk_tokens=0 (the stock loss)"


def validate_loss_chunk_tokens(
    value: int | None, name: str = "loss_chunk_tokens", off: str = "None for the stock loss"
) -> None:
    """`value` is None or a positive number of tokens per chunk; else ValueError naming the fix (`off`: how the
    caller spells the stock loss)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive number of tokens per loss chunk (e.g. 4096), or {off}; got {value!r}"
        )


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sum of one chunk's token losses: the head's logits, upcast to fp32 as `ForCausalLMLoss` does."""
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    head: nn.Module,
    chunk_tokens: int,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ForCausalLMLoss(head(hidden_states), labels, ...)` computed `chunk_tokens` tokens at a time (module docstring).

    `hidden_states`: (batch, sequence, hidden), what the head reads; `labels`: (batch, sequence), unshifted, or
    `shift_labels` already shifted. Each chunk runs under `torch.utils.checkpoint`, so neither pass keeps more than
    one chunk's logits; tokens are chunked across sequences (the batch flattened)."""
    validate_loss_chunk_tokens(chunk_tokens, "chunk_tokens")
    if shift_labels is None:
        # as ForCausalLMLoss: tokens < n predict n; the last position has nothing to predict
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if targets.numel() != hidden.shape[0]:
        raise ValueError(
            f"labels have {targets.numel()} tokens but the hidden states {hidden.shape[0]}; pass labels of the "
            "input_ids' shape"
        )
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        if hidden.requires_grad and torch.is_grad_enabled():
            total = total + checkpoint(
                _chunk_loss_sum, head, hidden[chunk], targets[chunk], ignore_index, use_reentrant=False
            )
        else:  # nothing to recompute for: no graph is kept
            total = total + _chunk_loss_sum(head, hidden[chunk], targets[chunk], ignore_index)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()  # cross_entropy's "mean" with ignore_index
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _head_and_body(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the LM head, the base model under it) of a transformers causal LM, or ValueError naming the fix."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", model)
    accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
    if head is None or body is model or not accepts:
        raise ValueError(
            f"loss_chunk_tokens needs a transformers causal LM with an LM head over a base model whose forward "
            f"takes logits_to_keep (LlamaForCausalLM, DeepseekV3ForCausalLM, Qwen3ForCausalLM, ...); "
            f"{type(model).__name__} is not one: set loss_chunk_tokens=0 (the stock loss)"
        )
    return head, body


@dataclass
class ChunkedLoss:
    """The chunked loss of one trainer: `chunk_tokens` tokens per chunk; `checked` once the first call found the
    model's logits to be its head on the kept hidden states (module docstring)."""

    chunk_tokens: int
    checked: bool = False

    def __post_init__(self):
        validate_loss_chunk_tokens(self.chunk_tokens)

    def bind(self, model: nn.Module, unwrapped: nn.Module) -> ChunkedLossModel:
        """A callable taking the model's inputs (labels included) that returns a `CausalLMOutputWithPast` whose
        loss is the chunked one and which has no logits: what `Trainer.compute_loss` calls in place of `model`.
        `model`: what the Trainer calls (the DeepSpeed engine, ...); `unwrapped`: the transformers model in it."""
        return ChunkedLossModel(self, model, unwrapped)


class ChunkedLossModel:
    """`model(**inputs)` with the chunked loss (`ChunkedLoss.bind`)."""

    def __init__(self, owner: ChunkedLoss, model: nn.Module, unwrapped: nn.Module):
        self.owner, self.model, self.unwrapped = owner, model, unwrapped
        self.head, self.body = _head_and_body(unwrapped)

    @property
    def training(self) -> bool:
        return self.model.training

    def __call__(self, **inputs) -> CausalLMOutputWithPast:
        labels = inputs.pop("labels", None)
        shift_labels = inputs.pop("shift_labels", None)
        num_items_in_batch = inputs.pop("num_items_in_batch", None)
        kept: list[torch.Tensor] = []

        def keep(module, args, output):
            kept.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        hook = self.body.register_forward_hook(keep)
        try:
            # logits_to_keep=1: the head runs on the last position only (b x V); no labels: the model adds no loss
            outputs = self.model(**inputs, logits_to_keep=1)
        finally:
            hook.remove()
        hidden = kept[-1]
        if getattr(outputs, "aux_loss", None) is not None:
            raise ValueError(
                f"{type(self.unwrapped).__name__} adds an auxiliary loss (output_router_logits=True) to its language-"
                f"model loss, which the chunked loss does not; set output_router_logits=False in its config, "
                f"{OFF_FIX}"
            )
        if not self.owner.checked:
            self._check_head(hidden, outputs.logits)
        loss = chunked_causal_lm_loss(
            hidden,
            labels,
            self.head,
            self.owner.chunk_tokens,
            num_items_in_batch=num_items_in_batch,
            shift_labels=shift_labels,
        )
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None))

    def _check_head(self, hidden: torch.Tensor, logits: torch.Tensor | None) -> None:
        """The model's logits of the last position equal its head's on the kept hidden states (module docstring)."""
        with torch.no_grad():
            ours = self.head(hidden[:, -1:, :])
        if logits is not None and logits.shape == ours.shape:
            tolerance = 1e-4 if logits.dtype == torch.float32 else 2e-2
            if torch.allclose(logits.float(), ours.float(), rtol=tolerance, atol=tolerance):
                self.owner.checked = True
                return
        found = "none" if logits is None else f"shape {tuple(logits.shape)}"
        raise ValueError(
            f"{type(self.unwrapped).__name__}'s logits are not its LM head applied to its base model's output "
            f"(expected {tuple(ours.shape)}, the model returned {found} or other values): it scales or caps them, or "
            f"DeepSpeed's vocabulary-parallel head splits the vocabulary, and the chunked loss would train on another "
            f"loss; set tensor_parallel.vocab_parallel_lm_head false in the DeepSpeed config if that is it, {OFF_FIX}"
        )


def chunked_loss_for(
    args, label_smoother, compute_loss_func, other_compute_loss: str | None = None
) -> ChunkedLoss | None:
    """The trainer's chunked loss for its arguments' `loss_chunk_tokens` (None or 0: None, the stock loss), or
    ValueError when the trainer computes its loss another way (label smoothing, a `compute_loss_func`, or
    `other_compute_loss`: the name of a Trainer class whose own `compute_loss` runs under the recipe's, such as trl's
    SFTTrainer, which reads the logits), which the chunked loss would silently replace or starve of logits."""
    tokens = getattr(args, "loss_chunk_tokens", None)
    if not tokens:
        return None
    if label_smoother is not None:
        other = f"the trainer was given label_smoothing_factor={args.label_smoothing_factor}; drop it"
    elif compute_loss_func is not None:
        other = "the trainer was given a compute_loss_func; drop it"
    elif other_compute_loss:
        other = f"{other_compute_loss} computes its loss its own way (it may read the logits); use the Trainer's"
    else:
        return ChunkedLoss(tokens)
    raise ValueError(
        f"loss_chunk_tokens={tokens} computes the plain causal-LM cross-entropy in place of the model's, but {other}, "
        "or set loss_chunk_tokens=0 for the stock loss"
    )
