"""Ulysses sequence parallelism (SP) inside a training rank: what the recipe adds to accelerate's
`ParallelismConfig(sp_size, sp_backend="deepspeed")` and the Trainer's wiring of DeepSpeed's `UlyssesSPAttentionHF`.

With SP p, each rank of an SP group (p consecutive ranks) holds 1/p of every sequence; inside attention an all-to-all
gives it the whole sequence for 1/p of the heads. accelerate registers Ulysses in `Accelerator.prepare`
(accelerator.py:2358-2415) and the Trainer shards the batches and weights the loss by tokens over the SP group
(trainer.py:1819-1843, integrations/deepspeed.py:723-777). What they leave out, and this module supplies:

- **CPU.** The SP registration asserts that `deepspeed.comm` is initialised (parallel_state_sp.py:28), which accelerate
  does only off-CPU (accelerate/state.py:198-214): `init_deepspeed_comm` does it on Gloo, over the process group the
  launcher already made.
- **DeepSeek's MLA.** Ulysses takes one head size, `config.head_dim`, for Q, K and V (ulysses_sp.py:503-512) and
  asserts `key.shape == value.shape` (ulysses_sp.py:299-304). MLA's Q/K heads are `qk_nope + qk_rope` wide (192 for
  V3), its V heads `v_head_dim` (128), and DeepSeek's configs set `head_dim` to the RoPE width (64).
  `UlyssesRegistration` makes the registration read the Q/K width, zero-pads V to it before the attention call and
  crops the output back.
  Exact: the padded V columns only add output columns of zeros, which the crop drops (the scores, and the model's own
  `scaling`, do not read V). The config's `head_dim` is the model's again once the engine is built, so checkpoints
  save the model's own config. The upstream change that would retire this: separate Q/K and V head sizes in
  `UlyssesSPAttentionHF` (its required shapes and its all-to-all of V).
- **A second prepare.** accelerate registers Ulysses at every DeepSpeed `prepare`: an `evaluate()` before `train()`,
  or a second `train()`, would wrap Ulysses' own wrapper and stop at DeepSpeed's "sequence parallel group is already
  initialized". `UlyssesRegistration.before_prepare` starts each registration from the attention function the model
  had and lets DeepSpeed make its groups again.
- **position_ids.** The SP data adapter refuses a batch without them (ulysses_sp.py:666, huggingface/trl#6812):
  `with_position_ids` gives a collator's batches `arange(seq)` positions, which is what the model uses without them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.nn import functional as F
from transformers import TrainerCallback

from hf_dist_recipes._compat.deepspeed import forget_sequence_parallel_groups

# The MLA config fields (DeepSeek-V2/V3, Kimi, GLM-4.5's MLA): Q/K heads are nope + rope wide, V heads v_head_dim.
_MLA_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def sequence_parallel_size(accelerator) -> int:
    """The SP degree of `accelerator`'s `ParallelismConfig` under the DeepSpeed backend (1 without SP)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not getattr(config, "sp_enabled", False) or config.sp_backend != "deepspeed":
        return 1
    return int(config.sp_size)


def eval_unsharded(accelerator) -> bool:
    """Whether evaluation under SP runs each sequence whole on every rank (accelerate's `sp_disable_in_eval`, True
    unless set otherwise; False: it stays sharded, and the eval loader must be sharded like the training one)."""
    handler = getattr(getattr(accelerator, "parallelism_config", None), "sp_handler", None)
    return sequence_parallel_size(accelerator) > 1 and getattr(handler, "sp_disable_in_eval", True) is not False


def init_deepspeed_comm(accelerator) -> bool:
    """Initialise `deepspeed.comm` where the SP registration needs it and accelerate did not (a CPU run under SP);
    returns whether it did. DeepSpeed takes the torch process group the launcher made (no new rendezvous)."""
    if sequence_parallel_size(accelerator) == 1 or accelerator.device.type != "cpu":
        return False
    import deepspeed
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        return False
    deepspeed.init_distributed(dist_backend="gloo")
    return True


def is_mla(config) -> bool:
    """Whether a model config describes MLA attention with V heads narrower than its Q/K heads, or a `head_dim`
    other than the Q/K width (DeepSeek's: the RoPE width)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not all(isinstance(getattr(text, name, None), int) for name in _MLA_FIELDS):
        return False
    width = text.qk_nope_head_dim + text.qk_rope_head_dim
    return text.v_head_dim != width or getattr(text, "head_dim", width) != width


class UlyssesRegistration:
    """What the recipe does around each Ulysses registration (accelerate's, in every DeepSpeed `prepare`) for one
    model. `before_prepare` (train() start) puts back the attention function the implementation had when the trainer
    was built, which accelerate would otherwise wrap a second time (Ulysses inside Ulysses, after an `evaluate()`
    before `train()` or in a second `train()`), and lets DeepSpeed make its SP groups again
    (`_compat.deepspeed.forget_sequence_parallel_groups`). For MLA (`mla`) it is also the shim of the module
    docstring: `before_prepare` sets the head size Ulysses reads to the Q/K width; `after_prepare` (train begin: the
    engine is built) restores the config and wraps the registered attention so V is padded and the output cropped;
    `restore` puts the config back (idempotent), for a train() that failed before train begin.

    `implementation`: the attention implementation Ulysses wraps (`sp_attn_implementation`); `attention_functions`:
    transformers' `ALL_ATTENTION_FUNCTIONS` (handed over so a test can pass its own)."""

    def __init__(self, model, implementation: str, attention_functions=None):
        if attention_functions is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as attention_functions
        self.use_model(model)
        self.implementation = implementation
        self.functions = attention_functions
        current = attention_functions[implementation] if implementation in attention_functions else None
        self._core: Callable | None = getattr(current, "recipe_mla_core", current)  # before any registration

    def use_model(self, model) -> None:
        """Care for `model` from now on (the one `model_init` built in train()), the earlier model's config restored."""
        if getattr(self, "_changed", False):
            self.restore()
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.mla = is_mla(self.config)
        self._head_dim: object = None
        self._changed = False

    @property
    def qk_width(self) -> int:
        return self.config.qk_nope_head_dim + self.config.qk_rope_head_dim

    def before_prepare(self) -> None:
        forget_sequence_parallel_groups()
        if self._core is not None:
            self.functions[self.implementation] = self._core
        if self.mla and not self._changed:
            self._head_dim, self._changed = getattr(self.config, "head_dim", None), True
            self.config.head_dim = self.qk_width

    def after_prepare(self) -> None:
        self.restore()
        registered = self.functions[self.implementation]
        if self.mla and getattr(registered, "recipe_mla_core", None) is None:
            self.functions[self.implementation] = _pad_values(registered, self._core)

    def restore(self) -> None:
        if self._changed:
            self.config.head_dim, self._changed = self._head_dim, False

    def callback(self) -> TrainerCallback:
        """The callback that calls `after_prepare` at train begin (the Trainer builds the engine just before)."""
        return _AfterPrepare(self)


class _AfterPrepare(TrainerCallback):
    def __init__(self, shim: UlyssesRegistration):
        self.shim = shim

    def on_train_begin(self, args, state, control, **kwargs):
        self.shim.after_prepare()


def _pad_values(attention: Callable, core: Callable | None) -> Callable:
    """`attention` called with V zero-padded to the Q/K head size, its output cropped back to V's."""

    def mla_attention(module, query, key, value, attention_mask, *args, **kwargs):
        width, full = value.shape[-1], query.shape[-1]
        if width == full:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        value = F.pad(value, (0, full - width))
        output, weights = attention(module, query, key, value, attention_mask, *args, **kwargs)
        # Ulysses returns (batch, seq, heads x head size), the stock functions (batch, seq, heads, head size)
        if output.dim() == 3:
            output = output.unflatten(-1, (-1, full))[..., :width].flatten(-2)
        else:
            output = output[..., :width]
        return output, weights

    mla_attention.recipe_mla_core = core  # what before_prepare puts back
    return mla_attention


def with_position_ids(collator: Callable) -> Callable:
    """`collator`, whose batches also carry `position_ids` (`arange(seq)` per row) where they had none: the SP adapter
    shards every tensor of a batch along the sequence and needs the global positions (module docstring)."""

    def collate(features):
        batch = collator(features)
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(ids, torch.Tensor) and "position_ids" not in batch:
            batch["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).clone()
        return batch

    collate.recipe_position_ids = collator
    return collate


def ulysses_registration_for(model, accelerator) -> UlyssesRegistration | None:
    """The registration helper for `model` under `accelerator`'s SP (None without a model yet: `model_init` builds it
    in train()). The attention implementation is the one accelerate hands Ulysses (`sp_attn_implementation`, which
    must equal the model's; "sdpa", accelerate's documented default, where it names none)."""
    if model is None:
        return None
    handler = getattr(accelerator.parallelism_config, "sp_handler", None)
    implementation = getattr(handler, "sp_attn_implementation", None) or "sdpa"
    return UlyssesRegistration(model, implementation)


def eval_length_problem(inputs, limit: int | None, sp: int) -> str | None:
    """Why an eval batch `inputs` may not run under SP `sp` with the arguments' `sp_eval_max_length` `limit` (None when
    it may). Evaluation runs unsharded (accelerate's `sp_disable_in_eval`, its default): every rank holds the whole
    sequence, whose activations SP was there to divide by `sp` (huggingface/transformers#46868: an out-of-memory error
    at the first evaluation)."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if limit is None or not isinstance(ids, torch.Tensor) or ids.shape[-1] <= limit:
        return None
    return (
        f"an eval batch holds sequences of {ids.shape[-1]} tokens, over sp_eval_max_length={limit}: under sequence "
        f"parallelism evaluation runs each sequence whole on every rank (not 1/{sp} of it, as training does), so it "
        f"needs about {sp} x the activation memory of a training step. Evaluate on sequences of at most {limit} "
        f"tokens, or raise sp_eval_max_length if the memory is there"
    )


UNSHARDED_EVAL = (
    "evaluation under sequence parallelism runs every eval sequence whole on every rank (accelerate's "
    "sp_disable_in_eval): about sp_size x a training step's activation memory at the same length; set "
    "sp_eval_max_length to stop an evaluation whose sequences are longer than what fits"
)
