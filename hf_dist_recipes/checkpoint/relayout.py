"""Resume a ZeRO-3 checkpoint in another layout: another world size, TP degree or EP degree than the job that wrote
it (a node lost and no spare; a plan re-made for more nodes), with the optimizer state, not only the weights.

DeepSpeed 0.19.8's `load_checkpoint` reads each rank's files as that rank wrote them: another data-parallel size
mis-slices or fails, and `ds_to_universal` refuses AutoTP + AutoEP (`checkpoint.offline`). So when the manifest's
layout (`checkpoint.manifest.CheckpointLayout`) is not the running one, the engine's load is replaced by this
conversion, per group of tensors (`checkpoint.gather.group_key`: one decoder layer at a time, memory-mapped files):

1. the source rank files are rebuilt into full tensors (`checkpoint.zero_files.Rebuilder`), once for the fp32
   master weights and once per Adam moment (`exp_avg`, `exp_avg_sq`), and renamed to the HuggingFace names
   (`checkpoint.zero_files.to_hf_names`): the layout-independent form;
2. each running parameter's value is cut from it as the running layout holds it -- the experts of this rank's EP
   rank (AutoEP's placement, w1/w3 split from gate_up_proj), this rank's TP shard (AutoTP's patterns: row-parallel
   along dim 1, column-parallel along dim 0, replicated whole) -- and set with DeepSpeed's public ZeRO-3 setters
   `safe_set_full_fp32_param` / `safe_set_full_optimizer_state` (each rank keeps its ZeRO partition of it);
3. the optimizer's step and learning rate, the engine's step counters and the persistent buffers (DeepSeek's
   expert score-correction bias, which the balancing updates) are set, and the module's partitions refreshed.

Memory: every rank holds the full fp32 tensors of one group of one state at a time (the setters take the whole
TP-local tensor): for DeepSeek-V3 a MoE layer, 45 GB (docs/checkpoints.md, "Resume in another layout").

The Trainer then restores what is not the engine's as on any resume: trainer_state.json (step, logs), scheduler.pt,
the data position. RNG: each rank reads `rng_state_<its global rank>.pth` as the Trainer does, so with another world
size rank r takes the state old rank r wrote (a rank beyond the old world keeps its seeding's: the Trainer logs it).
The recipe seeds every rank alike, so the saved states agree (measured: docs/checkpoints.md); a run whose steps draw
no random numbers (no dropout) is unaffected either way. The loss after the resume equals the uninterrupted
run's to fp32 reduction order (measured: tests/distributed/test_resume_other_layout.py).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_dist_recipes._compat import deepspeed as compat_deepspeed
from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes._compat.deepspeed import ZeroCheckpointKeys as K
from hf_dist_recipes.checkpoint.gather import group_key, reference_model
from hf_dist_recipes.checkpoint.manifest import MANIFEST_NAME, CheckpointLayout, Manifest
from hf_dist_recipes.checkpoint.zero_files import RankFiles, Rebuilder, resolve_tag_dir, to_hf_names
from hf_dist_recipes.core.gather import process_rank

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's; a checkpoint whose optimizer holds others is refused


@dataclass(frozen=True)
class Relayout:
    """What a resume converted: the checkpoint, its layout and the running one, the optimizer step (Adam's steps
    taken; 0 for the weights only), the tensors and elements set per state, and the wall time in seconds."""

    checkpoint: str
    source: CheckpointLayout
    target: CheckpointLayout
    step: int
    states: tuple[str, ...]  # "fp32" (master weights) and the moments set; ("fp32",) for the weights only
    tensors: int  # running parameters set (each once per state)
    elements: int  # elements of those parameters as this rank's layout holds them (TP/EP-local)
    seconds: float

    def line(self) -> str:
        """The one line rank 0 says on such a resume."""
        what = " + ".join(("fp32 master weights", *self.states[1:])) + (
            f", optimizer step {self.step}" if len(self.states) > 1 else ", the optimizer fresh"
        )
        return (
            f"{self.checkpoint} was written by {_describe(self.source)}; converted for this run's "
            f"{_describe(self.target)}: {what} ({self.tensors} tensors) in {self.seconds:.1f} s"
        )


def _describe(layout: CheckpointLayout) -> str:
    return f"{layout.world_size} ranks (TP {layout.tp}, EP {layout.ep}, ZeRO-{layout.zero_stage})"


def written_layout(checkpoint: str) -> CheckpointLayout | None:
    """The layout in `checkpoint`'s manifest; None without one (a checkpoint of a job without the recipe)."""
    path = os.path.join(checkpoint, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return Manifest.from_json(f.read()).layout


def needs_conversion(source: CheckpointLayout | None, target: CheckpointLayout) -> bool:
    """Whether a checkpoint written in `source` must be converted to resume in `target`; ValueError naming the fix
    when it differs and cannot be (only ZeRO-3 to ZeRO-3 converts)."""
    if source is None or (source.world_size, source.tp, source.ep) == (target.world_size, target.tp, target.ep):
        return False
    if source.zero_stage != 3 or target.zero_stage != 3:
        raise ValueError(
            f"the checkpoint was written by {_describe(source)} and this run is {_describe(target)}: only a ZeRO-3 "
            "checkpoint resumes in another layout, into a ZeRO-3 run; resume it in the layout that wrote it, or "
            "export its weights (`hf-dist-recipes checkpoint export`) and start from them with a fresh optimizer"
        )
    return True


def install(engine, target: CheckpointLayout, said) -> None:
    """Make `engine.load_checkpoint(path, ...)` (what transformers' resume calls) convert a checkpoint written in
    another layout instead of reading it as its own; `said(relayout)` is called after a conversion. A checkpoint
    of this layout (or without a manifest) is loaded by the engine as before. Idempotent."""
    if getattr(engine.load_checkpoint, "converts_layouts", False):
        return
    load = engine.load_checkpoint

    def load_or_convert(load_dir, *args, load_optimizer_states=True, **kwargs):
        if not needs_conversion(written_layout(load_dir), target):
            return load(load_dir, *args, load_optimizer_states=load_optimizer_states, **kwargs)
        said(convert(engine, load_dir, target, load_optimizer_states))
        return load_dir, {}  # transformers checks only that the path is not None

    load_or_convert.converts_layouts = True
    engine.load_checkpoint = load_or_convert


def convert(engine, checkpoint: str, target: CheckpointLayout, load_optimizer_states: bool = True) -> Relayout:
    """Set the running ZeRO-3 `engine`'s weights (and with `load_optimizer_states` its Adam state) from
    `checkpoint`, written in another layout (module docstring). Every rank calls it (the setters' partitions are
    per rank; no collective is needed: every rank reads the files itself)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    start = time.perf_counter()
    with open(os.path.join(checkpoint, MANIFEST_NAME), encoding="utf-8") as f:
        manifest = Manifest.from_json(f.read())
    files = RankFiles.load(resolve_tag_dir(checkpoint))
    torch_state = files.optim[(0, 0)][K.OPTIMIZER_STATE][K.TORCH_OPTIMIZER]
    saved = torch_state[K.STATE].get(0, {})
    if load_optimizer_states and set(saved) != {"step", *MOMENTS}:
        raise ValueError(
            f"{checkpoint}: its optimizer holds {sorted(saved)}, not Adam's step, exp_avg and exp_avg_sq; only an "
            "Adam/AdamW checkpoint converts to another layout with its optimizer state (resume it in the layout "
            "that wrote it, or load the weights only: load_checkpoint(load_optimizer_states=False))"
        )
    module = engine.module
    states = ("fp32", *MOMENTS) if load_optimizer_states else ("fp32",)
    if load_optimizer_states:
        compat_deepspeed.create_zero3_optimizer_states(engine, saved["step"], MOMENTS)
    live = _LiveLayout(module, target)
    ref_shapes = {n: tuple(t.shape) for n, t in reference_model(module).state_dict().items()}
    tensors = elements = 0
    for state in states:
        rebuilder = Rebuilder(files, None if state == "fp32" else state)
        by_group = defaultdict(list)
        for name in rebuilder.names() if state == "fp32" else rebuilder.fragments:
            if name not in rebuilder.shared:  # a tied weight: set once, through the name it is stored under
                by_group[group_key(name)].append(name)
        unset = set(live.params)
        for key, names in by_group.items():
            full = to_hf_names({n: rebuilder.tensor(n) for n in names}, rebuilder.autoep, ref_shapes, live.preset)
            for name, value in live.values(key, full).items():
                if name in live.buffers:
                    if state == "fp32":
                        live.buffers[name].data.copy_(value)
                    continue
                param = live.params[name]
                unset.discard(name)
                if compat_deepspeed.zero3_partition_padded(param):
                    compat_deepspeed.set_zero3_partition_padded(param, value, None if state == "fp32" else state)
                elif state == "fp32":
                    safe_set_full_fp32_param(param, value)
                else:
                    safe_set_full_optimizer_state(param, value, state)
                tensors += 1
                elements += value.numel()
        if unset:
            raise ValueError(f"{checkpoint}: nothing in it for {sorted(unset)} of the running model")
    compat_deepspeed.refresh_zero3_module_partitions(engine)
    # The rate belongs to the schedule, not to the optimizer's state: set for the weights-only load too.
    _set_learning_rates(engine, torch_state[K.PARAM_GROUPS], checkpoint)
    # The engine counts the Trainer's steps (the manifest's); Adam's own step skips what a non-finite step skipped.
    compat_deepspeed.set_engine_step(engine, manifest.step, manifest.step * engine.train_batch_size())
    return Relayout(
        os.path.basename(os.path.normpath(checkpoint)),
        manifest.layout,
        target,
        int(saved["step"]) if load_optimizer_states else 0,
        states,
        tensors // len(states),
        elements // len(states),
        time.perf_counter() - start,
    )


def _set_learning_rates(engine, saved_groups: list[dict], checkpoint: str) -> None:
    """The learning rate the checkpoint's next step would use: the scheduler's state (scheduler.pt, which the
    Trainer loads after this) moves it only at the next step. Groups by position when they match; otherwise the one
    rate every saved group shares (one schedule), else ValueError."""
    groups = compat_deepspeed.optimizer_param_groups(engine)
    if len(groups) != len(saved_groups):
        if len({g["lr"] for g in saved_groups}) != 1:
            raise ValueError(
                f"{checkpoint}: {len(saved_groups)} optimizer groups with different learning rates, this run has "
                f"{len(groups)}: resume it in the layout that wrote it"
            )
        saved_groups = [saved_groups[0]] * len(groups)
    for group, saved in zip(groups, saved_groups, strict=True):
        for key in ("lr", "initial_lr"):
            if key in saved:
                group[key] = saved[key]


class _LiveLayout:
    """The running model's parameters and persistent buffers by name, and how to cut each from a full HF tensor."""

    def __init__(self, module, target: CheckpointLayout):
        self.params = {}
        seen = set()
        for name, p in module.named_parameters():
            key = compat_deepspeed.zero_param_id(p)
            key = id(p) if key is None else key
            if key not in seen:  # a tied weight once
                seen.add(key)
                self.params[name] = p
        self.buffers = {}
        for owner_name, owner in module.named_modules():
            skipped = compat_torch.non_persistent_buffer_names(owner)
            for name, b in owner.named_buffers(recurse=False):
                if name not in skipped:
                    self.buffers[f"{owner_name}.{name}" if owner_name else name] = b
        layers = module.named_modules()
        self.autoep = {
            n: compat_deepspeed.autoep_layer_parts(m) for n, m in layers if compat_deepspeed.is_autoep_layer(m)
        }
        self.preset = compat_deepspeed.autoep_preset(module.config.model_type)
        self.patterns = compat_deepspeed.autotp_patterns(module)
        rank = process_rank()
        self.tp_rank, self.tp = rank % target.tp, target.tp

    def values(self, key: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Running name -> this rank's value (TP-local, EP-local) for one group of full HF-named tensors."""
        full = dict(full)
        for path, layer in self.autoep.items():
            if group_key(path + ".") == key:
                full.update(self._experts(path, layer, full))
        out = {}
        for name, value in full.items():
            if name in self.buffers:
                out[name] = value
            elif name in self.params:
                out[name] = self._tp_shard(name, value, tuple(compat_deepspeed.zero_full_shape(self.params[name])))
            else:
                raise ValueError(f"{name!r} of the checkpoint is not a parameter or buffer of the running model")
        return out

    def _experts(self, path: str, layer, full: dict) -> dict[str, torch.Tensor]:
        """The AutoEP layer's names from the HF MoE block's (the reverse of `zero_files.to_hf_names`): this EP rank's
        experts of w1/w2/w3 (gate_up_proj split in gate then up), the router's weight and score-correction bias."""
        p = self.preset
        experts = f"{path}.{p.experts}"
        gate_up, down = full.pop(f"{experts}.{p.expert_w1}"), full.pop(f"{experts}.{p.expert_w2}")
        inter = tuple(compat_deepspeed.zero_full_shape(layer.w1))[1]
        if p.expert_w3 is not None:
            w1, w3 = gate_up, full.pop(f"{experts}.{p.expert_w3}")
        elif gate_up.shape[1] == 2 * inter:  # [E, 2I, H]
            w1, w3 = gate_up[:, :inter], gate_up[:, inter:]
        else:  # [E, H, 2I]: the transposed layout
            w1, w3 = gate_up[..., :inter].transpose(1, 2), gate_up[..., inter:].transpose(1, 2)
            down = down.transpose(1, 2)
        ids = torch.tensor(
            compat_deepspeed.autoep_experts_for_rank(layer.placement, dist.get_rank(group=layer.ep_group))
        )
        gate, down_name, up = K.EXPERT_TENSORS
        out = {f"{path}.{p.experts}.{n}": t[ids].contiguous() for n, t in ((gate, w1), (down_name, down), (up, w3))}
        for suffix in ("weight", "bias"):
            if f"{path}.{p.router}.{suffix}" in full:
                out[f"{path}.{K.ROUTER_GATE}.{suffix}"] = full.pop(f"{path}.{p.router}.{suffix}")
        bias = [n for n in full if n.startswith(path + ".") and n.endswith("e_score_correction_bias")]
        for name in bias:
            out[f"{path}.{K.ROUTER_SCORE_BIAS}"] = full.pop(name)
        return out

    def _tp_shard(self, name: str, value: torch.Tensor, local: tuple[int, ...]) -> torch.Tensor:
        """This TP rank's shard of `value`, as AutoTP cut it (equal shards: what the running shapes show)."""
        if tuple(value.shape) == local:
            return value
        dim = 1 if any(re.match(p, name) for p in self.patterns.get(K.ROW_PARALLEL, [])) else 0
        equal_shards = value.dim() > dim and value.shape[dim] == local[dim] * self.tp
        if not equal_shards or math.prod(local) * self.tp != value.numel():
            raise ValueError(
                f"{name}: the checkpoint's full {tuple(value.shape)} is not {self.tp} equal TP shards of the running "
                f"{local} along dim {dim}; this conversion cuts equal shards only"
            )
        return value.narrow(dim, self.tp_rank * local[dim], local[dim]).contiguous()
