"""Offline export: a DeepSpeed training checkpoint (ZeRO-3, with or without AutoTP and AutoEP) to a HuggingFace
checkpoint, in one plain process, no launch -- for the job that died between two `save_model` calls.

DeepSpeed 0.19.8's own tools cover only part of this (measured on CPU checkpoints of the three layouts):
`zero_to_fp32` merges ZeRO-3 alone but refuses AutoTP ("Expected 1 of '*_optim_states.pt'") and AutoEP;
`ds_to_universal` fails on ZeRO-3 + AutoTP when the model was built under zero.Init and refuses AutoEP + AutoTP
("not supported yet"); `autoep_universal` needs per-expert files that ZeRO-3 never writes.

Reading the per-rank files back into full tensors under the HuggingFace model's names is `checkpoint.zero_files`;
this module converts the dtype and writes them. Tensors are rebuilt one group (decoder layer) at a time, so the
export reads each weight byte once and holds one layer plus the writer's shard buffer.

`workers` > 1: the shard plan is made first from metadata alone (the same rebuild on meta tensors, nothing read),
then `workers` forked processes each rebuild only the groups holding a tensor of their block of shards and
write those files; the parent writes the index, the config and `shard_writers.json`. Same files, byte for byte, as
one process; a group that spans two writers' shards is rebuilt by both.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict

import torch

from hf_dist_recipes._compat.deepspeed import ZeroCheckpointKeys as K
from hf_dist_recipes._compat.deepspeed import autoep_preset
from hf_dist_recipes.checkpoint.gather import group_key
from hf_dist_recipes.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, ExportResult
from hf_dist_recipes.checkpoint.zero_files import RankFiles, Rebuilder, resolve_tag_dir, to_hf_names
from hf_dist_recipes.core.forked import run_forked

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    rebuilder = Rebuilder(files)
    preset = None
    if rebuilder.autoep:
        preset = autoep_preset(config.model_type)
        if preset is None:
            raise ValueError(
                f"model_type {config.model_type!r} has no DeepSpeed AutoEP preset: is config.json this model's?"
            )
    if dtype == "auto":  # the dtype of the module's (empty) ZeRO placeholders is the training dtype
        module = files.model[(0, 0)][K.MODULE]
        target = next(module[n].dtype for shapes in files.model[(0, 0)][K.PARAM_SHAPES] for n in shapes if n in module)
    elif dtype in _DTYPES:
        target = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    by_group: dict[str, list[str]] = defaultdict(list)
    for name in rebuilder.names():
        if name not in rebuilder.shared:  # tied: stored once, tied again by from_pretrained
            by_group[group_key(name)].append(name)
    order = sorted(by_group, key=lambda key: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)])

    def build(key: str, meta: bool = False) -> dict[str, torch.Tensor]:
        group = to_hf_names({n: rebuilder.tensor(n, meta) for n in by_group[key]}, rebuilder.autoep, ref_shapes, preset)
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
    import functools

    from hf_dist_recipes.checkpoint.export import to_disk_names
    from hf_dist_recipes.checkpoint.shard_plan import PlannedShardWriter, plan_shards, write_index
    from hf_dist_recipes.checkpoint.writer import remove_previous_weights, save_config_files

    disk = {key: to_disk_names(ref, build(key, meta=True)) for key in order}
    plan = plan_shards((disk[key] for key in order), max_shard_bytes)
    owners = {key: plan.owners_of(disk[key], workers) for key in order}
    os.makedirs(output_dir, exist_ok=True)
    remove_previous_weights(output_dir)

    def work(index: int):
        start = time.process_time()
        writer = PlannedShardWriter(output_dir, plan, index, workers)
        for key in order:
            if index in owners[key]:
                writer.add(to_disk_names(ref, build(key)))
        return writer.close(), time.process_time() - start

    results, errors = run_forked([functools.partial(work, index) for index in range(workers)], "export-writer")
    if errors:
        failed = (f"writer {index}: {what}" for index, what in errors.items())
        raise RuntimeError("checkpoint export failed in a writer process:\n" + "\n".join(failed))
    written = {index: files for index, (files, _) in enumerate(results)}
    cpu_seconds = {str(index): seconds for index, (_, seconds) in enumerate(results)}
    result = write_index(output_dir, plan, written)
    result.writer_cpu_seconds = cpu_seconds
    save_config_files(ref.config, output_dir, getattr(ref, "generation_config", None))
    return result
