"""Full parameter values out of a live DeepSpeed model, one module at a time, under HuggingFace's in-memory names.

Three kinds of sharding are undone, in this order, for the parameters of one module:
- ZeRO-3 partitions: `deepspeed.zero.GatheredParameters` (every rank materialises this module's parameters only);
- AutoTP shards: DeepSpeed's `GatherReplacedLayerParams` (the same context its own 16-bit save uses);
- AutoEP experts: each rank holds `num_experts / ep_size` experts in `experts.w1/w2/w3`; they are gathered over
  the layer's expert-parallel group, expert by expert, straight into the model's own layout (DeepSeek:
  `experts.gate_up_proj` [E, 2I, H] = w1 then w3 along dim 1, `experts.down_proj` [E, H, I] = w2), with the
  router's weights and score correction bias back under the MoE block's own names. DeepSpeed 0.19.8's
  consolidated save refuses AutoEP (`_raise_if_autoep_zero3_consolidated_export`); this is the gather it lacks.

Every rank must call `iter_module_groups` (the gathers are collectives); only `main` ranks receive tensors.
The names and shapes produced are checked against the model class built on the meta device, so a layout this
module does not understand stops with the offending names instead of writing a wrong checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

_GROUP_KEY = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.gate.weight" -> "model.layers.3"


def group_key(name: str) -> str:
    """The unit of streaming: a numbered block ("model.layers.3") or else the top-level name ("lm_head.weight")."""
    m = _GROUP_KEY.match(name)
    return m.group(1) if m else name


def reference_model(model: nn.Module) -> nn.Module:
    """The model's class built on the meta device (no memory, no zero.Init): the names and shapes to produce."""
    with torch.device("meta"):
        return type(model)(model.config)


def _is_autoep_layer(module: nn.Module) -> bool:
    return getattr(module, "_is_autoep_layer", False)


def _zero_gather(params):
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _tp_gather(params, module):
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    return GatherReplacedLayerParams(params, module, enabled=True)


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
    tensors += [
        (n, b)
        for n, b in module.named_buffers(recurse=False)
        if b is not None and n not in module._non_persistent_buffers_set
    ]
    return tensors


def _gathered_values(module: nn.Module, main: bool) -> dict[str, torch.Tensor]:
    """This module's own parameters and persistent buffers, unsharded (ZeRO and TP), on the CPU of main ranks."""
    params = [p for p in module.parameters(recurse=False) if p is not None]
    out: dict[str, torch.Tensor] = {}
    with _zero_gather(params), _tp_gather(params, module):
        if main:
            for name, t in _own_tensors(module):
                out[name] = t.detach().to("cpu", copy=True)
    return out


def _gather_experts_into(out: torch.Tensor | None, local: torch.Tensor, layer: nn.Module) -> None:
    """Each EP rank's [E_local, ...] experts -> `out` ([E, ...] on the CPU, global expert order) on the first rank
    of every expert-parallel group; `out` is None on ranks that do not write. One `gather` per local expert: on the
    CPU (Gloo) straight into `out`'s views (each expert's block is contiguous); on a GPU (NCCL gathers device
    tensors) through a buffer of one expert per EP rank. No rank allocates more than the experts it writes."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    group = layer.ep_group
    size = dist.get_world_size(group=group)
    dst = dist.get_global_rank(group, 0)
    receiving = dist.get_rank() == dst
    if out is not None and not receiving:
        raise ValueError(
            f"the writing rank {dist.get_rank()} is not the first rank of its expert-parallel group "
            f"(that is rank {dst}): save from global rank 0"
        )
    owners = [autoep_experts_for_rank(layer.expert_placement_descriptor, r) for r in range(size)]
    direct = out is not None and local.device.type == "cpu"
    for j in range(local.shape[0]):
        parts = None
        if receiving:
            parts = (
                [out[owners[r][j]] for r in range(size)]
                if direct
                else [torch.empty_like(local[j]) for _ in range(size)]
            )
        dist.gather(local[j].contiguous(), parts, dst=dst, group=group)
        if receiving and out is not None and not direct:
            for r, part in enumerate(parts):
                out[owners[r][j]].copy_(part)


def _autoep_layer_tensors(layer: nn.Module, ref: nn.Module, main: bool) -> dict[str, torch.Tensor]:
    """An AutoEPMoELayer's tensors under the names of the HF MoE block it replaced (`ref`, on meta), relative."""
    import deepspeed
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset, preset_name_for_hf_model_type

    preset = get_preset(preset_name_for_hf_model_type(layer.model_family) or layer.model_family)
    out: dict[str, torch.Tensor] = {}
    # Router: weight (and bias) under the block's router name, the score correction bias wherever the block keeps it.
    router = {k: v for k, v in _gathered_values(layer.router, main).items()}
    router.update({f"gate.{k}": v for k, v in _gathered_values(layer.router.gate, main).items()})
    ref_names = {n for n, _ in ref.named_parameters()} | {n for n, _ in ref.named_buffers()}
    ecb = [n for n in ref_names if n.endswith("e_score_correction_bias")]
    if main:
        out[f"{preset.router_pattern}.weight"] = router["gate.weight"]
        if "gate.bias" in router and f"{preset.router_pattern}.bias" in ref_names:
            out[f"{preset.router_pattern}.bias"] = router["gate.bias"]
        if "e_score_correction_bias" in router and ecb:
            out[ecb[0]] = router["e_score_correction_bias"]
    # Experts: gather ZeRO partitions (over the expert-data-parallel group), then the experts over the EP group,
    # directly into the block's own tensors (DeepSeek: gate_up_proj [E, 2I, H] = gate then up rows; down_proj).
    experts, ep = layer.experts, preset.experts_pattern
    with deepspeed.zero.GatheredParameters([experts.w1, experts.w2, experts.w3], modifier_rank=None):
        w1, w2, w3 = (p.detach() for p in (experts.w1, experts.w2, experts.w3))
        n, inter = layer.num_experts, w1.shape[1]
        ref_experts = ref.get_submodule(ep)
        fused = preset.expert_w3 is None
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
            _gather_experts_into(target, local, layer)
        if main:
            out[f"{ep}.{preset.expert_w2}"] = down
    if layer.shared_experts is not None:
        for name, t in _iter_plain(layer.shared_experts, main):
            out[f"{preset.shared_experts_pattern}.{name}"] = t
    return out


def _iter_plain(module: nn.Module, main: bool, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in _gathered_values(module, main).items():
        yield prefix + name, t
    for child_name, child in module.named_children():
        yield from _iter_plain(child, main, f"{prefix}{child_name}.")


def _iter_tensors(module: nn.Module, ref: nn.Module, main: bool, prefix: str, seen: set[int]):
    if _is_autoep_layer(module):
        for name, t in _autoep_layer_tensors(module, ref.get_submodule(prefix.rstrip(".")), main).items():
            yield prefix + name, t
        return
    values = _gathered_values(module, main)
    for name, param in _own_tensors(module):
        key = getattr(param, "ds_id", None)
        key = id(param) if key is None else ("ds", key)
        if key in seen:  # a tied weight: safetensors stores it once, from_pretrained ties it again
            continue
        seen.add(key)
        if main:
            yield prefix + name, values[name]
    for child_name, child in module.named_children():
        yield from _iter_tensors(child, ref, main, f"{prefix}{child_name}.", seen)


def iter_module_groups(model: nn.Module, main: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the model's full tensors group by group (see `group_key`), in-memory HF names, CPU, on main ranks;
    other ranks take part in the collectives and receive empty groups. Raises ValueError when a produced name or
    shape is not the model class's own."""
    ref = reference_model(model)
    expected = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    group: dict[str, torch.Tensor] = {}
    current = None
    for name, tensor in _iter_tensors(model, ref, main, "", set()):
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
    if group or not main:
        yield group
