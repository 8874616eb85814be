"""Offline export: a DeepSpeed training checkpoint (ZeRO-3, with or without AutoTP and AutoEP) to a HuggingFace
checkpoint, in one plain process, no launch -- for the job that died between two `save_model` calls.

DeepSpeed 0.19.8's own tools cover only part of this (measured on CPU checkpoints of the three layouts):
`zero_to_fp32` merges ZeRO-3 alone but refuses AutoTP ("Expected 1 of '*_optim_states.pt'") and AutoEP;
`ds_to_universal` fails on ZeRO-3 + AutoTP when the model was built under zero.Init and refuses AutoEP + AutoTP
("not supported yet"); `autoep_universal` needs per-expert files that ZeRO-3 never writes.

What is on disk, in `checkpoint-N/global_stepN/`, one pair per rank (global rank = D x tp + T):
`zero_pp_rank_{D}_mp_rank_{T}_model_states.pt` -- `param_shapes` (per optimizer sub-group, name -> TP/EP-local
shape, in flat order), persistent buffers whole in `module`, AutoTP's `universal_checkpoint_info` (row-parallel,
replicated and vocabulary patterns), AutoEP's `ds_autoep_layers` (ep_rank, expert placement);
`..._optim_states.pt` -- `fp32_flat_groups`: per sub-group this rank's slice `flat[r*ceil(n/P):(r+1)*ceil(n/P)]` of
every parameter, P the sub-group's partition size (`ds_zero_partition_groups` when AutoEP is on; otherwise inferred
from the flat size, because parameters that AutoTP keeps whole are partitioned by zero.Init over the whole world).

Files are memory-mapped and tensors are rebuilt one group (decoder layer) at a time, so the export reads each
weight byte once and holds one layer plus the writer's shard buffer; the Adam moments are never read.

`workers` > 1: the shard plan is made first from metadata alone (the same rebuild on meta tensors, nothing read),
then `workers` forked processes each rebuild only the groups holding a tensor of their block of shards and
write those files; the parent writes the index, the config and `shard_writers.json`. Same files, byte for byte, as
one process; a group that spans two writers' shards is rebuilt by both.
"""

from __future__ import annotations

import math
import os
import re
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hf_dist_recipes.checkpoint.gather import group_key
from hf_dist_recipes.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, ExportResult

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_tag_dir(path: str) -> str:
    """`checkpoint-N` (its `latest` names the tag) or the `global_stepN` folder itself."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such directory; pass a Trainer checkpoint folder (checkpoint-N)")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            path = os.path.join(path, f.read().strip())
    if not any(_RANK_FILE.match(n) for n in os.listdir(path)):
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
            m = _RANK_FILE.match(name)
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


def _fragments(files: RankFiles, dtype_key: str = "fp32_flat_groups"):
    """name -> {partition group (tuple of ranks): {partition rank: _Fragment}}, without reading any tensor."""
    world = files.tp_size * files.dp_size
    meta = files.model[(0, 0)]
    experts = {e["expert_key_prefix"] for e in meta.get("ds_autoep_layers") or []}
    out: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for (d, t), model in sorted(files.model.items()):
        osd = files.optim[(d, t)]["optimizer_state_dict"]
        groups = osd.get("ds_zero_partition_groups") or []
        ep_rank = {e["expert_key_prefix"]: e["ep_rank"] for e in model.get("ds_autoep_layers") or []}
        global_rank = d * files.tp_size + t
        for i, shapes in enumerate(model["param_shapes"]):
            flat = osd[dtype_key][i]
            if i < len(groups):
                size, prank, ranks = (
                    groups[i]["partition_count"],
                    groups[i]["partition_rank"],
                    tuple(groups[i]["partition_ranks"]),
                )
            else:
                size = _partition_size(
                    list(shapes.values()), flat.numel(), sorted({files.dp_size, world, osd["partition_count"]})
                )
                if size == world and world != files.dp_size:  # zero.Init's world group: rank = global rank
                    prank, ranks = global_rank, tuple(range(world))
                else:  # the data-parallel group of this TP rank
                    prank, ranks = d, tuple(x * files.tp_size + t for x in range(files.dp_size))
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


class _Rebuilder:
    """Full tensors under DeepSpeed's module names, one parameter at a time."""

    def __init__(self, files: RankFiles):
        self.files = files
        meta = files.model[(0, 0)]
        self.uc = meta.get("universal_checkpoint_info") or {}
        self.autoep = {e["expert_key_prefix"]: e for e in meta.get("ds_autoep_layers") or []}
        self.fragments = _fragments(files)
        self.buffers = {k: meta["module"][k] for k in meta.get("buffer_names", []) if k in meta["module"]}
        self.shared = dict(meta.get("shared_params") or {})

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
                (layer["num_experts"], *by_ep[0].shape[1:]), dtype=by_ep[0].dtype, device=by_ep[0].device
            )
            for entry in layer["expert_placement"]["ranks"]:
                full[torch.tensor(entry["experts"], dtype=torch.long)] = by_ep[entry["rank"]]
            return full
        tp = self.files.tp_size
        if len(locals_) == 1 and (tp == 1 or len(locals_[0][1]) > 1):
            return locals_[0][0]  # one ZeRO copy spread over every rank: already whole (and a fresh tensor)
        by_tp = {next(iter(tps)): t for t, tps, _ in locals_}
        shards = [by_tp[r] for r in range(tp)]
        if _matches(self.uc.get("tp_replicated_parameter_patterns", []), name):
            if not meta and not all(torch.equal(shards[0], s) for s in shards[1:]):
                raise ValueError(
                    f"{name}: the TP ranks' copies of a replicated parameter differ (was the model "
                    "built on every rank from the same seed?)"
                )
            full = shards[0]
        elif _matches(self.uc.get("parameter_with_row_parallelism_patterns", []), name):
            full = torch.cat(shards, dim=1)
        else:
            full = torch.cat(shards, dim=0)
        if _matches(self.uc.get("vocabulary_parameter_patterns", []), name) and "original_vocab_size" in self.uc:
            full = full[: self.uc["original_vocab_size"]]
        return full


def _to_hf_names(group: dict[str, torch.Tensor], autoep: dict, ref_shapes: dict, preset) -> dict[str, torch.Tensor]:
    """AutoEP's names inside one group -> the replaced MoE block's (same rules as the live gather)."""
    out = dict(group)
    for prefix, layer in autoep.items():
        if f"{prefix}.w1" not in out:
            continue
        module = layer["module_path"]
        w1, w2, w3 = (out.pop(f"{prefix}.{w}") for w in ("w1", "w2", "w3"))
        experts = f"{module}.{preset.experts_pattern}"
        gate_up = torch.cat([w1, w3], dim=1)
        if tuple(ref_shapes[f"{experts}.{preset.expert_w1}"]) == tuple(gate_up.shape):
            out[f"{experts}.{preset.expert_w1}"], out[f"{experts}.{preset.expert_w2}"] = gate_up, w2
        else:
            out[f"{experts}.{preset.expert_w1}"] = gate_up.transpose(1, 2).contiguous()
            out[f"{experts}.{preset.expert_w2}"] = w2.transpose(1, 2).contiguous()
        for suffix in ("weight", "bias"):
            if f"{module}.router.gate.{suffix}" in out:
                out[f"{module}.{preset.router_pattern}.{suffix}"] = out.pop(f"{module}.router.gate.{suffix}")
        if f"{module}.router.e_score_correction_bias" in out:
            target = next(n for n in ref_shapes if n.startswith(module + ".") and n.endswith("e_score_correction_bias"))
            out[target] = out.pop(f"{module}.router.e_score_correction_bias")
    return out


def export_checkpoint(
    checkpoint_dir: str,
    output_dir: str,
    *,
    config_dir: str | None = None,
    dtype: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress=None,
    workers: int = 1,
) -> ExportResult:
    """Write the HuggingFace checkpoint of the DeepSpeed checkpoint in `checkpoint_dir` (a Trainer `checkpoint-N`)
    to `output_dir`. `config_dir` holds the model's config.json (default: `checkpoint_dir` itself, where the
    Trainer writes it). `dtype`: "auto" (the training dtype), "fp32", "bf16" or "fp16". `progress(done, total)` is
    called after each group (with `workers` > 1, once at the end). `workers`: processes writing the shard files
    (default 1: this process writes every file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist_recipes.checkpoint.export import write_groups

    if workers < 1:
        raise ValueError(f"workers={workers}: use 1 or more writer processes")
    tag_dir = resolve_tag_dir(checkpoint_dir)
    config_dir = config_dir or checkpoint_dir
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise ValueError(f"{config_dir}: no config.json; pass --config DIR holding the model's config.json")
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(config)
    ref_shapes = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    files = RankFiles.load(tag_dir)
    rebuilder = _Rebuilder(files)
    preset = None
    if rebuilder.autoep:
        from deepspeed.module_inject.auto_ep_presets.registry import get_preset, preset_name_for_hf_model_type

        name = preset_name_for_hf_model_type(config.model_type)
        if name is None:
            raise ValueError(
                f"model_type {config.model_type!r} has no DeepSpeed AutoEP preset: is config.json this model's?"
            )
        preset = get_preset(name)
    if dtype == "auto":  # the dtype of the module's (empty) ZeRO placeholders is the training dtype
        module = files.model[(0, 0)]["module"]
        target = next(module[n].dtype for shapes in files.model[(0, 0)]["param_shapes"] for n in shapes if n in module)
    elif dtype in _DTYPES:
        target = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    by_group: dict[str, list[str]] = defaultdict(list)
    for name in rebuilder.names():
        if name not in rebuilder.shared:  # tied: stored once, tied again by from_pretrained
            by_group[group_key(name)].append(name)
    order = sorted(by_group, key=_natural)

    def build(key: str, meta: bool = False) -> dict[str, torch.Tensor]:
        group = _to_hf_names(
            {n: rebuilder.tensor(n, meta) for n in by_group[key]}, rebuilder.autoep, ref_shapes, preset
        )
        for name, t in group.items():
            if name not in ref_shapes or tuple(t.shape) != ref_shapes[name]:
                raise ValueError(
                    f"rebuilt {name!r} {tuple(t.shape)}, which {type(ref).__name__} does not have "
                    f"({ref_shapes.get(name, 'no such name')}): is config.json this model's?"
                )
        return {n: (t.to(target) if t.is_floating_point() else t) for n, t in group.items()}

    if workers > 1:
        result = _export_with_workers(build, order, ref, output_dir, max_shard_bytes, workers)
        if progress is not None:
            progress(len(order), len(order))
        return result

    def groups():
        for i, key in enumerate(order, start=1):
            # One group alive at a time: the rebuilt tensors go straight into the renaming, nothing else holds them.
            yield build(key)
            if progress is not None:
                progress(i, len(order))

    return write_groups(groups(), ref, output_dir, max_shard_bytes)


def _export_with_workers(build, order: list[str], ref, output_dir: str, max_shard_bytes: int, workers: int):
    """The shard plan from metadata, then `workers` forked processes writing their shards (see the docstring)."""
    import multiprocessing

    from hf_dist_recipes.checkpoint.export import to_disk_names
    from hf_dist_recipes.checkpoint.shard_plan import PlannedShardWriter, plan_shards, write_index
    from hf_dist_recipes.checkpoint.writer import remove_previous_weights, save_config_files

    disk = {key: to_disk_names(ref, build(key, meta=True)) for key in order}
    plan = plan_shards((disk[key] for key in order), max_shard_bytes)
    owners = {key: plan.owners_of(disk[key], workers) for key in order}
    os.makedirs(output_dir, exist_ok=True)
    remove_previous_weights(output_dir)

    def work(index: int, conn) -> None:
        start = time.process_time()
        try:
            # One thread per writer: the work is copies, and an OpenMP pool the parent used is not safe to grow
            # again in a forked child.
            torch.set_num_threads(1)
            writer = PlannedShardWriter(output_dir, plan, index, workers)
            for key in order:
                if index in owners[key]:
                    writer.add(to_disk_names(ref, build(key)))
            conn.send(("ok", (writer.close(), time.process_time() - start)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            conn.close()

    # fork: the children share the parent's memory-mapped rank files and imported modules (no re-import, no copy).
    ctx = multiprocessing.get_context("fork")
    procs = []
    for index in range(workers):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=work, args=(index, child), name=f"export-writer-{index}")
        proc.start()
        child.close()
        procs.append((proc, parent))
    written, cpu_seconds, errors = {}, {}, []
    for index, (proc, conn) in enumerate(procs):
        try:
            status, value = conn.recv()
        except EOFError:
            status, value = "error", "the process ended without a result (killed, out of memory?)"
        proc.join()
        if status == "ok":
            written[index], cpu_seconds[str(index)] = value
        else:
            errors.append(f"writer {index}: {value}")
    if errors:
        raise RuntimeError("checkpoint export failed in a writer process:\n" + "\n".join(errors))
    result = write_index(output_dir, plan, written)
    result.writer_cpu_seconds = cpu_seconds
    save_config_files(ref.config, output_dir, getattr(ref, "generation_config", None))
    return result


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]
