"""Full parameter values out of a live DeepSpeed model, one module at a time, under HuggingFace's in-memory names.

Three kinds of sharding are undone, in this order, for the parameters of one module:
- ZeRO-3 partitions: `deepspeed.zero.GatheredParameters` (every rank materialises this module's parameters only);
- AutoTP shards: DeepSpeed's `GatherReplacedLayerParams` (the same context its own 16-bit save uses;
  `_compat.deepspeed.gather_tp_params`);
- AutoEP experts: each rank holds `num_experts / ep_size` experts in `experts.w1/w2/w3`; they are gathered over
  the layer's expert-parallel group, expert by expert, straight into the model's own layout (DeepSeek:
  `experts.gate_up_proj` [E, 2I, H] = w1 then w3 along dim 1, `experts.down_proj` [E, H, I] = w2), with the
  router's weights and score correction bias back under the MoE block's own names. DeepSpeed 0.19.8's
  consolidated save refuses AutoEP (`_raise_if_autoep_zero3_consolidated_export`); this is the gather it lacks.
  What it reads of DeepSpeed's AutoEP layer (not public) comes through `_compat.deepspeed.autoep_layer_parts`.

Every rank must call `iter_module_groups` (the gathers are collectives); only the ranks that `receivers` names for
a group receive its tensors (default: global rank 0 receives every group). With `meta=True` no rank gathers
anything: every rank gets every group as meta tensors of the written shapes and dtypes, from which the writers
plan who writes which shard (`hf_dist_recipes.checkpoint.shard_plan`) before the real pass.
The names and shapes produced are checked against the model class built on the meta device, so a layout this
module does not understand stops with the offending names instead of writing a wrong checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hf_dist_recipes._compat.deepspeed import (
    autoep_experts_for_rank,
    autoep_layer_parts,
    autoep_preset,
    gather_tp_params,
    is_autoep_layer,
    zero_param_id,
)
from hf_dist_recipes._compat.torch import non_persistent_buffer_names
from hf_dist_recipes.core.gather import process_rank

Receivers = Callable[[str], Collection[int]]  # group key -> the global ranks that receive that group's tensors
_GROUP_KEY = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.gate.weight" -> "model.layers.3"


def group_key(name: str) -> str:
    """The unit of streaming: a numbered block ("model.layers.3") or else the top-level name ("lm_head.weight")."""
    m = _GROUP_KEY.match(name)
    return m.group(1) if m else name


def reference_model(model: nn.Module) -> nn.Module:
    """The model's class built on the meta device (no memory, no zero.Init): the names and shapes to produce."""
    with torch.device("meta"):
        return type(model)(model.config)


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
    skipped = non_persistent_buffer_names(module)
    tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None and n not in skipped]
    return tensors


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s dtype; `iter_module_groups(meta=True)` gives it the written shape."""
    return torch.empty(0, dtype=t.dtype, device="meta")


def _gathered_values(module: nn.Module, main: bool, meta: bool = False) -> dict[str, torch.Tensor]:
    """This module's own parameters and persistent buffers, unsharded (ZeRO and TP), on the CPU of main ranks;
    `meta`: placeholders on every rank, nothing gathered."""
    if meta:
        return {name: _placeholder(t) for name, t in _own_tensors(module)}
    params = [p for p in module.parameters(recurse=False) if p is not None]
    out: dict[str, torch.Tensor] = {}
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), gather_tp_params(params, module):
        if main:
            for name, t in _own_tensors(module):
                out[name] = t.detach().to("cpu", copy=True)
    return out


def _gather_experts_into(out: torch.Tensor | None, local: torch.Tensor, layer, receivers) -> None:
    """Each EP rank's [E_local, ...] experts -> `out` ([E, ...] on the CPU, global expert order) on every receiving
    rank: each expert-parallel group (a whole copy of the experts) gathers to the receivers among its ranks, one
    after the other; a group without one does nothing. `out` is None on ranks that do not receive. One `gather`
    per local expert: on the CPU (Gloo) straight into `out`'s views (each expert's block is contiguous); on a GPU
    (NCCL gathers device tensors) through a buffer of one expert per EP rank. No rank allocates more than the
    experts it writes. `layer`: the layer's `AutoEPLayerParts`."""
    group = layer.ep_group
    size = dist.get_world_size(group=group)
    members = dist.get_process_group_ranks(group)
    owners = [autoep_experts_for_rank(layer.placement, r) for r in range(size)]
    for dst in sorted(set(receivers) & set(members)):
        receiving = dist.get_rank() == dst
        if receiving and out is None:
            raise ValueError(f"rank {dst} receives the experts but has no tensor to receive them into")
        direct = receiving and local.device.type == "cpu"
        for j in range(local.shape[0]):
            parts = None
            if receiving:
                parts = (
                    [out[owners[r][j]] for r in range(size)]
                    if direct
                    else [torch.empty_like(local[j]) for _ in range(size)]
                )
            dist.gather(local[j].contiguous(), parts, dst=dst, group=group)
            if receiving and not direct:
                for r, part in enumerate(parts):
                    out[owners[r][j]].copy_(part)


def _autoep_layer_tensors(
    module: nn.Module, ref: nn.Module, receivers: Collection[int], meta: bool = False
) -> dict[str, torch.Tensor]:
    """An AutoEPMoELayer's tensors under the names of the HF MoE block it replaced (`ref`, on meta), relative."""
    import deepspeed

    layer = autoep_layer_parts(module)
    preset = autoep_preset(layer.model_family)
    if preset is None:
        raise ValueError(
            f"DeepSpeed has no AutoEP preset named {layer.model_family!r}: this DeepSpeed version's AutoEP layers "
            "are not understood by hf_dist_recipes.checkpoint.gather"
        )
    main = meta or process_rank() in receivers
    out: dict[str, torch.Tensor] = {}
    # Router: weight (and bias) under the block's router name, the score correction bias wherever the block keeps it.
    router = {k: v for k, v in _gathered_values(layer.router, main, meta).items()}
    router.update({f"gate.{k}": v for k, v in _gathered_values(layer.router_gate, main, meta).items()})
    ref_names = {n for n, _ in ref.named_parameters()} | {n for n, _ in ref.named_buffers()}
    ecb = [n for n in ref_names if n.endswith("e_score_correction_bias")]
    if main:
        out[f"{preset.router}.weight"] = router["gate.weight"]
        if "gate.bias" in router and f"{preset.router}.bias" in ref_names:
            out[f"{preset.router}.bias"] = router["gate.bias"]
        if "e_score_correction_bias" in router and ecb:
            out[ecb[0]] = router["e_score_correction_bias"]
    # Experts: gather ZeRO partitions (over the expert-data-parallel group), then the experts over the EP group,
    # directly into the block's own tensors (DeepSeek: gate_up_proj [E, 2I, H] = gate then up rows; down_proj).
    ep = preset.experts
    fused = preset.expert_w3 is None
    if meta:  # names in the order the real pass inserts them; shapes come from the reference model
        names = [preset.expert_w1] if fused else [preset.expert_w1, preset.expert_w3]
        out.update({f"{ep}.{w}": _placeholder(layer.w1) for w in (*names, preset.expert_w2)})
        if layer.shared_experts is not None:
            for name, t in _iter_plain(layer.shared_experts, True, meta=True):
                out[f"{preset.shared_experts}.{name}"] = t
        return out
    with deepspeed.zero.GatheredParameters([layer.w1, layer.w2, layer.w3], modifier_rank=None):
        w1, w2, w3 = (p.detach() for p in (layer.w1, layer.w2, layer.w3))
        n, inter = layer.num_experts, w1.shape[1]
        ref_experts = ref.get_submodule(ep)
        if fused and tuple(getattr(ref_experts, preset.expert_w1).shape)[1] != 2 * inter:
            raise ValueError(
                f"{type(ref).__name__}.{ep}.{preset.expert_w1} is not [E, 2I, H]: the transposed fused "
                "expert layout is not exported by hf_dist_recipes.checkpoint.gather"
            )
        if main and fused:
            gate_up = torch.empty((n, 2 * inter, w1.shape[2]), dtype=w1.dtype)
            targets = [(w1, gate_up[:, :inter]), (w3, gate_up[:, inter:])]
            out[f"{ep}.{preset.expert_w1}"] = gate_up
        elif main:
            targets = [
                (w1, torch.empty((n, *w1.shape[1:]), dtype=w1.dtype)),
                (w3, torch.empty((n, *w3.shape[1:]), dtype=w3.dtype)),
            ]
            out[f"{ep}.{preset.expert_w1}"], out[f"{ep}.{preset.expert_w3}"] = targets[0][1], targets[1][1]
        else:
            targets = [(w1, None), (w3, None)]
        down = torch.empty((n, *w2.shape[1:]), dtype=w2.dtype) if main else None
        for local, target in (*targets, (w2, down)):
            _gather_experts_into(target, local, layer, receivers)
        if main:
            out[f"{ep}.{preset.expert_w2}"] = down
    if layer.shared_experts is not None:
        for name, t in _iter_plain(layer.shared_experts, main):
            out[f"{preset.shared_experts}.{name}"] = t
    return out


def _iter_plain(
    module: nn.Module, main: bool, prefix: str = "", meta: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in _gathered_values(module, main, meta).items():
        yield prefix + name, t
    for child_name, child in module.named_children():
        yield from _iter_plain(child, main, f"{prefix}{child_name}.", meta)


def _iter_tensors(module: nn.Module, ref: nn.Module, receivers: Receivers, meta: bool, prefix: str, seen: set[int]):
    if is_autoep_layer(module):
        block = ref.get_submodule(prefix.rstrip("."))
        for name, t in _autoep_layer_tensors(module, block, receivers(group_key(prefix + "_")), meta).items():
            yield prefix + name, t
        return
    rank = process_rank()
    main = meta or any(rank in receivers(group_key(prefix + n)) for n, _ in _own_tensors(module))
    values = _gathered_values(module, main, meta)
    for name, param in _own_tensors(module):
        key = zero_param_id(param)
        key = id(param) if key is None else ("ds", key)
        if key in seen:  # a tied weight: safetensors stores it once, from_pretrained ties it again
            continue
        seen.add(key)
        if name in values:
            yield prefix + name, values[name]
    for child_name, child in module.named_children():
        yield from _iter_tensors(child, ref, receivers, meta, f"{prefix}{child_name}.", seen)


def iter_module_groups(
    model: nn.Module, *, receivers: Receivers | None = None, meta: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's full tensors group by group (see `group_key`), in-memory HF names, CPU, to the ranks in
    `receivers(group_key)` (default: global rank 0 for every group); the other ranks take part in the collectives
    and get only the groups they receive. `meta`: no collective at all, every group on every rank as meta tensors
    of the written shapes and dtypes. Raises ValueError when a produced name or shape is not the model class's
    own."""
    ref = reference_model(model)
    expected = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    receivers = receivers or (lambda key: (0,))
    group: dict[str, torch.Tensor] = {}
    current = None
    for name, tensor in _iter_tensors(model, ref, receivers, meta, "", set()):
        if meta and name in expected:
            tensor = torch.empty(expected[name], dtype=tensor.dtype, device="meta")
        if name not in expected or tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"gathered {name!r} with shape {tuple(tensor.shape)}, which {type(model).__name__} "
                f"does not have ({expected.get(name, 'no such name')}): this sharding layout is not "
                "understood by hf_dist_recipes.checkpoint.gather"
            )
        key = group_key(name)
        if current is not None and key != current:
            yield group
            group = {}
        current = key
        group[name] = tensor
    if group:
        yield group
