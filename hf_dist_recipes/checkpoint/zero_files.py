"""A DeepSpeed ZeRO-3 training checkpoint (with or without AutoTP and AutoEP) read back as full tensors under
DeepSpeed's module names or the HF model's (`to_hf_names`): what `checkpoint.offline` exports and `relayout` resumes.

What is on disk, in `checkpoint-N/global_stepN/`, one pair per rank (global rank = D x tp + T):
`zero_pp_rank_{D}_mp_rank_{T}_model_states.pt` -- `param_shapes` (per optimizer sub-group, name -> TP/EP-local
shape, in flat order), persistent buffers whole in `module`, AutoTP's `universal_checkpoint_info` (row-parallel,
replicated and vocabulary patterns), AutoEP's `ds_autoep_layers` (ep_rank, expert placement);
`..._optim_states.pt` -- `fp32_flat_groups`: per sub-group this rank's slice `flat[r*ceil(n/P):(r+1)*ceil(n/P)]` of
every parameter, P the sub-group's partition size (`ds_zero_partition_groups` when AutoEP is on; otherwise inferred
from the flat size, because parameters that AutoTP keeps whole are partitioned by zero.Init over the whole world).
The file names and keys are DeepSpeed's, not public: they live in `_compat` (`ZERO_RANK_FILE`, `ZeroCheckpointKeys`).

Files are memory-mapped; `Rebuilder.tensor` reads the bytes of one parameter when asked for it (or none: `meta`).
`Rebuilder(files, state="exp_avg")` rebuilds an optimizer state instead of the fp32 master weights: the torch
optimizer's `state[sub-group]` tensors are flat exactly like `fp32_flat_groups` (same slices, same order), so one
rebuild serves both (`checkpoint.relayout` reads the moments this way; the export reads the weights only).
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hf_dist_recipes._compat.deepspeed import ZERO_RANK_FILE, AutoEPPreset
from hf_dist_recipes._compat.deepspeed import ZeroCheckpointKeys as K
from hf_dist_recipes.core.layout import RankLayout


def resolve_tag_dir(path: str) -> str:
    """`checkpoint-N` (its `latest` names the tag) or the `global_stepN` folder itself."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such directory; pass a Trainer checkpoint folder (checkpoint-N)")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            path = os.path.join(path, f.read().strip())
    if not any(ZERO_RANK_FILE.match(n) for n in os.listdir(path)):
        raise ValueError(
            f"{path}: no DeepSpeed zero_pp_rank_*_mp_rank_*_states.pt files; pass a checkpoint-N "
            "folder written under DeepSpeed ZeRO-3"
        )
    return path


@dataclass
class _Fragment:
    chunk: torch.Tensor  # this partition rank's slice (a view into a memory-mapped file)
    shape: tuple[int, ...]  # the TP/EP-local shape of the parameter
    tp: int
    ep: int | None


@dataclass
class RankFiles:
    """The memory-mapped per-rank files of one checkpoint tag."""

    tag_dir: str
    tp_size: int
    dp_size: int
    model: dict[tuple[int, int], dict] = field(default_factory=dict)
    optim: dict[tuple[int, int], dict] = field(default_factory=dict)

    @classmethod
    def load(cls, tag_dir: str) -> RankFiles:
        found = {}
        for name in os.listdir(tag_dir):
            m = ZERO_RANK_FILE.match(name)
            if m:
                found[(int(m.group(2)), int(m.group(3)), m.group(4))] = os.path.join(tag_dir, name)
        tp_size = 1 + max(t for _, t, _ in found)
        dp_size = 1 + max(d for d, _, _ in found)
        files = cls(tag_dir, tp_size, dp_size)
        for d in range(dp_size):
            for t in range(tp_size):
                for kind, store in (("model", files.model), ("optim", files.optim)):
                    if (d, t, kind) not in found:
                        raise ValueError(
                            f"{tag_dir}: the {kind} states of data-parallel rank {d}, TP rank {t} are "
                            "missing; copy every rank's files into the checkpoint folder"
                        )
                    # weights_only=False: the pickles hold DeepSpeed's own classes (ZeroStageEnum, LossScaler).
                    store[(d, t)] = torch.load(found[(d, t, kind)], map_location="cpu", mmap=True, weights_only=False)
        return files


def _fragments(files: RankFiles, state: str | None = None):
    """name -> {partition group (tuple of ranks): {partition rank: _Fragment}}, without reading any tensor; `state`:
    an optimizer state's name (None: the fp32 master weights)."""
    layout = RankLayout(files.tp_size * files.dp_size, files.tp_size)
    world = layout.world
    meta = files.model[(0, 0)]
    experts = {e[K.EXPERT_KEY_PREFIX] for e in meta.get(K.AUTOEP_LAYERS) or []}
    out: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for (d, t), model in sorted(files.model.items()):
        osd = files.optim[(d, t)][K.OPTIMIZER_STATE]
        groups = osd.get(K.PARTITION_GROUPS) or []
        ep_rank = {e[K.EXPERT_KEY_PREFIX]: e[K.EP_RANK] for e in model.get(K.AUTOEP_LAYERS) or []}
        global_rank = layout.rank(d, t)
        for i, shapes in enumerate(model[K.PARAM_SHAPES]):
            flat = osd[K.FP32_FLAT_GROUPS][i] if state is None else osd[K.TORCH_OPTIMIZER][K.STATE][i][state]
            if i < len(groups):
                size, prank, ranks = (
                    groups[i][K.GROUP_COUNT],
                    groups[i][K.GROUP_RANK],
                    tuple(groups[i][K.GROUP_RANKS]),
                )
            else:
                size = _partition_size(
                    list(shapes.values()), flat.numel(), sorted({files.dp_size, world, osd[K.PARTITION_COUNT]})
                )
                if size == world and world != files.dp_size:  # zero.Init's world group: rank = global rank
                    prank, ranks = global_rank, tuple(range(world))
                else:  # the data-parallel group of this TP rank
                    prank, ranks = d, tuple(layout.dp_group(global_rank))
            offset = 0
            for name, shape in shapes.items():
                part = math.ceil(math.prod(shape) / size)
                owner = name.rsplit(".", 1)[0]
                ep = ep_rank.get(owner) if owner in experts else None
                out[name][ranks][prank] = _Fragment(flat.narrow(0, offset, part), tuple(shape), t, ep)
                offset += part
            if offset != flat.numel():
                raise ValueError(
                    f"{files.tag_dir}: rank (dp {d}, tp {t}) group {i} holds {flat.numel()} elements, "
                    f"its parameters {offset}: not a layout this exporter understands"
                )
    return out


def _partition_size(shapes, flat_numel: int, candidates: list[int]) -> int:
    fits = [p for p in candidates if sum(math.ceil(math.prod(s) / p) for s in shapes) == flat_numel]
    if not fits:
        raise ValueError(f"no partition size in {candidates} explains a flat group of {flat_numel} elements")
    return fits[0]


def _local_tensors(copies: dict, meta: bool = False) -> list[tuple[torch.Tensor, set[int], int | None]]:
    """One TP/EP-local tensor per ZeRO copy (new memory, read from the mapped files; `meta`: nothing read), with
    the TP ranks and EP rank that held it."""
    out = []
    for ranks, parts in copies.items():
        if sorted(parts) != list(range(len(ranks))):
            raise ValueError(f"partition ranks {sorted(parts)} of {len(ranks)}: some rank's files are missing")
        shape = parts[0].shape
        if meta:
            out.append(
                (
                    torch.empty(shape, dtype=parts[0].chunk.dtype, device="meta"),
                    {p.tp for p in parts.values()},
                    parts[0].ep,
                )
            )
            continue
        flat = torch.cat([parts[r].chunk for r in range(len(ranks))])[: math.prod(shape)]
        out.append((flat.view(shape), {p.tp for p in parts.values()}, parts[0].ep))
    return out


def _matches(patterns, name: str) -> bool:
    return any(re.match(p, name) for p in patterns)


class Rebuilder:
    """Full tensors under DeepSpeed's module names, one parameter at a time: the fp32 master weights, or with `state`
    one optimizer state ("exp_avg", "exp_avg_sq"), shaped as its parameter."""

    def __init__(self, files: RankFiles, state: str | None = None):
        self.files = files
        meta = files.model[(0, 0)]
        self.uc = meta.get(K.UNIVERSAL_INFO) or {}
        self.autoep = {e[K.EXPERT_KEY_PREFIX]: e for e in meta.get(K.AUTOEP_LAYERS) or []}
        self.fragments = _fragments(files, state)
        self.buffers = {k: meta[K.MODULE][k] for k in meta.get(K.BUFFER_NAMES, []) if k in meta[K.MODULE]}
        self.shared = dict(meta.get(K.SHARED_PARAMS) or {})

    def names(self) -> list[str]:
        return [*self.fragments, *self.buffers]

    def tensor(self, name: str, meta: bool = False) -> torch.Tensor:
        """The full tensor `name`; `meta`: its shape and dtype only, nothing read."""
        if name in self.buffers:
            return torch.empty_like(self.buffers[name], device="meta") if meta else self.buffers[name].clone()
        locals_ = _local_tensors(self.fragments[name], meta)
        owner = name.rsplit(".", 1)[0]
        if owner in self.autoep:  # experts: [E_local, ...] per EP rank -> [E, ...] in global order
            layer = self.autoep[owner]
            by_ep = {ep: t for t, _, ep in locals_}
            full = torch.empty(
                (layer[K.NUM_EXPERTS], *by_ep[0].shape[1:]), dtype=by_ep[0].dtype, device=by_ep[0].device
            )
            for entry in layer[K.EXPERT_PLACEMENT][K.PLACEMENT_RANKS]:
                full[torch.tensor(entry[K.PLACEMENT_EXPERTS], dtype=torch.long)] = by_ep[entry[K.PLACEMENT_RANK]]
            return full
        tp = self.files.tp_size
        if len(locals_) == 1 and (tp == 1 or len(locals_[0][1]) > 1):
            return locals_[0][0]  # one ZeRO copy spread over every rank: already whole (and a fresh tensor)
        by_tp = {next(iter(tps)): t for t, tps, _ in locals_}
        shards = [by_tp[r] for r in range(tp)]
        if _matches(self.uc.get(K.TP_REPLICATED, []), name):
            if not meta and not all(torch.equal(shards[0], s) for s in shards[1:]):
                raise ValueError(
                    f"{name}: the TP ranks' copies of a replicated parameter differ (was the model "
                    "built on every rank from the same seed?)"
                )
            full = shards[0]
        elif _matches(self.uc.get(K.ROW_PARALLEL, []), name):
            full = torch.cat(shards, dim=1)
        else:
            full = torch.cat(shards, dim=0)
        if _matches(self.uc.get(K.VOCABULARY, []), name) and K.ORIGINAL_VOCAB_SIZE in self.uc:
            full = full[: self.uc[K.ORIGINAL_VOCAB_SIZE]]
        return full


def to_hf_names(
    group: dict[str, torch.Tensor], autoep: dict, ref_shapes: dict, preset: AutoEPPreset | None
) -> dict[str, torch.Tensor]:
    """AutoEP's names inside one group -> the replaced MoE block's (same rules as the live gather)."""
    out = dict(group)
    gate_name, down_name, up_name = K.EXPERT_TENSORS
    for prefix, layer in autoep.items():
        if f"{prefix}.{gate_name}" not in out:
            continue
        module = layer[K.MODULE_PATH]
        w1, w2, w3 = (out.pop(f"{prefix}.{w}") for w in (gate_name, down_name, up_name))
        experts = f"{module}.{preset.experts}"
        gate_up = torch.cat([w1, w3], dim=1)
        if tuple(ref_shapes[f"{experts}.{preset.expert_w1}"]) == tuple(gate_up.shape):
            out[f"{experts}.{preset.expert_w1}"], out[f"{experts}.{preset.expert_w2}"] = gate_up, w2
        else:
            out[f"{experts}.{preset.expert_w1}"] = gate_up.transpose(1, 2).contiguous()
            out[f"{experts}.{preset.expert_w2}"] = w2.transpose(1, 2).contiguous()
        for suffix in ("weight", "bias"):
            if f"{module}.{K.ROUTER_GATE}.{suffix}" in out:
                out[f"{module}.{preset.router}.{suffix}"] = out.pop(f"{module}.{K.ROUTER_GATE}.{suffix}")
        if f"{module}.{K.ROUTER_SCORE_BIAS}" in out:
            target = next(n for n in ref_shapes if n.startswith(module + ".") and n.endswith("e_score_correction_bias"))
            out[target] = out.pop(f"{module}.{K.ROUTER_SCORE_BIAS}")
    return out
