"""FP8 block-scaled checkpoints (the weights DeepSeek publishes for V3) to bf16 safetensors a fine-tune can start from.

DeepSeek-V3's checkpoint stores most linear weights as float8_e4m3fn with a `<name>_scale_inv` float32 tensor beside
each: one scale per `weight_block_size` block (128 x 128 in `config.json`'s `quantization_config`), the last block of
a row or column partial where the shape is not a multiple of the block (V3's `kv_a_proj_with_mqa` has 576 rows: 4
full blocks of 128 and one of 64). A value is `fp8 * scale_inv` of its block, as DeepSeek's own `weight_dequant`
computes it (the config's block, ceil division of the shape).

transformers 5.24 and 5.25 (`integrations/finegrained_fp8.py` `Fp8Dequantize._dequantize_one`, what `from_pretrained`
does on a CPU host or with `dequantize=True`) derive the block from the scale grid instead (`rows // scale_rows`): a
weight with a partial block is read with the wrong blocks when the division happens to be exact (24 rows, 2 block
rows of 16 -> blocks of 12, silently) and refused otherwise (576 rows, 5 block rows). `dequantize_checkpoint` follows
the config.

It streams: one output shard at a time (each input shard's tensors, bf16, are written to a file of the same name and
dropped), with the scale of a weight read from whichever shard holds it. `workers` processes each take a share of
the shard files. The output has the same tensor names minus the scales, the index rewritten, and `config.json`
without its `quantization_config`; every other file of the folder (tokenizer, generation config) is copied.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

SCALE_SUFFIX = "_scale_inv"  # "<...>.weight" -> "<...>.weight_scale_inv"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class DequantizeResult:
    """What `dequantize_checkpoint` wrote: the folder, its weight files, how many tensors were dequantized and kept
    as they were, the bytes written, and the block size read from the config (rows, columns)."""

    output_dir: str
    files: list[str]
    dequantized: int
    kept: int
    bytes: int
    block: tuple[int, int]
    written_by: dict[str, int] = field(default_factory=dict)


def fp8_block(config: dict, source: str) -> tuple[int, int]:
    """The (rows, columns) block of an FP8 block-scaled `config` (its `quantization_config`); ValueError otherwise."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        raise ValueError(
            f"{source}: config.json has no FP8 quantization_config (quant_method "
            f"{quant.get('quant_method')!r}): there is nothing to dequantize; load it with from_pretrained as it is"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def dequantize_weight(weight, scale_inv, block: tuple[int, int], dtype=None):
    """`weight` (float8, rows x columns) times the scale of its block, as `dtype` (default bf16). `scale_inv` holds one
    value per block, ceil(rows / block rows) x ceil(columns / block columns); the last block may be partial."""
    import math

    import torch

    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"a {rows} x {cols} weight in blocks of {block[0]} x {block[1]} needs a {grid[0]} x {grid[1]} scale grid, "
            f"the checkpoint has {tuple(scale_inv.shape)}: the config's weight_block_size does not match the weights"
        )
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scales).to(dtype or torch.bfloat16)


def _weight_files(source: str) -> dict[str, str]:
    """Tensor name -> the file holding it, from the index or the single file."""
    index = os.path.join(source, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(source, SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise ValueError(f"{source}: no {INDEX} or {SINGLE}; point it at the folder holding the FP8 checkpoint")


def _convert_file(source: str, output_dir: str, name: str, where: dict[str, str], block, dtype) -> tuple[int, int, int]:
    """Write `output_dir/name` from `source/name`: every FP8 weight dequantized, every scale dropped, the rest as is.
    Returns (dequantized, kept, bytes)."""
    from contextlib import ExitStack

    import torch
    from safetensors import safe_open

    from hf_dist_recipes.checkpoint.writer import write_safetensors

    out: dict[str, torch.Tensor] = {}
    dequantized = kept = 0
    with ExitStack() as files:
        opened: dict[str, object] = {}

        def reader(file: str):
            if file not in opened:
                opened[file] = files.enter_context(safe_open(os.path.join(source, file), framework="pt"))
            return opened[file]

        for key in [k for k, f in where.items() if f == name]:
            if key.endswith(SCALE_SUFFIX):
                continue
            tensor = reader(name).get_tensor(key)
            scale_key = key + SCALE_SUFFIX
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                if scale_key not in where:
                    raise ValueError(f"{source}: {key} is {tensor.dtype} but the checkpoint has no {scale_key}")
                tensor = dequantize_weight(tensor, reader(where[scale_key]).get_tensor(scale_key), block, dtype)
                dequantized += 1
            else:
                kept += 1
            out[key] = tensor
    write_safetensors(os.path.join(output_dir, name), out, {"format": "pt"})
    return dequantized, kept, sum(t.numel() * t.element_size() for t in out.values())


def dequantize_checkpoint(
    source: str,
    output_dir: str,
    *,
    dtype: str = "bf16",
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> DequantizeResult:
    """Write `output_dir` from the FP8 block-scaled checkpoint folder `source` (see the module docstring). `dtype`:
    "bf16" (default) or "fp32". `workers`: processes, each converting a share of the shard files (default 1).
    `progress(done, total)` after each file (with workers, once at the end)."""
    import torch

    if workers < 1:
        raise ValueError(f"workers={workers}: use 1 or more processes")
    target = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if target is None:
        raise ValueError(f"dtype {dtype!r}: use bf16 or fp32")
    config_path = os.path.join(source, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{source}: no config.json; point it at the folder holding the FP8 checkpoint")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    block = fp8_block(config, source)
    where = _weight_files(source)
    names = sorted(set(where.values()))
    if os.path.abspath(source) == os.path.abspath(output_dir):
        raise ValueError(f"--output {output_dir} is the source folder: write the bf16 checkpoint somewhere else")
    os.makedirs(output_dir, exist_ok=True)

    shares = [names[i::workers] for i in range(min(workers, len(names)))]
    totals = [0, 0, 0]
    written_by: dict[str, int] = {}
    if len(shares) <= 1:
        for done, name in enumerate(names, 1):
            for i, n in enumerate(_convert_file(source, output_dir, name, where, block, target)):
                totals[i] += n
            if progress:
                progress(done, len(names))
    else:
        totals, written_by = _with_workers(source, output_dir, shares, where, block, target)
        if progress:
            progress(len(names), len(names))

    kept_names = {k: f for k, f in where.items() if not k.endswith(SCALE_SUFFIX)}
    if os.path.isfile(os.path.join(source, INDEX)):
        index = {"metadata": {"total_size": totals[2]}, "weight_map": dict(sorted(kept_names.items()))}
        with open(os.path.join(output_dir, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    config.pop("quantization_config")
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "torch_dtype": dtype.replace("bf16", "bfloat16").replace("fp32", "float32")}, f, indent=2)
    for other in os.listdir(source):
        path = os.path.join(source, other)
        if os.path.isfile(path) and not other.endswith(".safetensors") and other not in (INDEX, "config.json"):
            shutil.copy2(path, os.path.join(output_dir, other))
    return DequantizeResult(output_dir, names, totals[0], totals[1], totals[2], block, written_by)


def _with_workers(source, output_dir, shares, where, block, target) -> tuple[list[int], dict[str, int]]:
    """Each share of the files converted by a forked process; their counts summed, who wrote which file recorded."""
    import functools

    from hf_dist_recipes.core.forked import run_forked

    def work(share):
        counts = [0, 0, 0]
        for name in share:
            for i, n in enumerate(_convert_file(source, output_dir, name, where, block, target)):
                counts[i] += n
        return counts

    results, errors = run_forked([functools.partial(work, share) for share in shares], "dequantize")
    if errors:  # each worker's exception in one line, as the CLI prints a ValueError
        raise ValueError(
            "; ".join(f"worker {index}: {what.strip().splitlines()[-1]}" for index, what in errors.items())
        )
    totals = [sum(counts[i] for counts in results) for i in range(3)]
    return totals, {name: index for index, share in enumerate(shares) for name in share}
