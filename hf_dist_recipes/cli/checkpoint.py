"""`hf-dist-recipes checkpoint export`: a DeepSpeed training checkpoint (ZeRO-3, with or without AutoTP and AutoEP)
to a HuggingFace checkpoint that `from_pretrained` loads, in one process on one machine, without a launch.
`hf-dist-recipes checkpoint dequantize`: an FP8 block-scaled checkpoint (DeepSeek-V3's published weights) to bf16,
the checkpoint a fine-tune starts from.

For the job that died between two saves: point it at the last `checkpoint-N` the Trainer wrote. The weights are
the fp32 master copies DeepSpeed checkpointed, written in the training dtype (or --dtype), per-expert layout as
`save_pretrained` writes it, in shards of at most --max-shard-size; with --workers N, N processes write their share
of the files (the same files)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict

from hf_dist_recipes.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from hf_dist_recipes.core.sizes import format_size, parse_size
from hf_dist_recipes.core.user_values import writable_dir


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "checkpoint",
        help="turn a DeepSpeed training checkpoint (ZeRO-3, TP, EP) into a HuggingFace checkpoint",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = sub.add_parser(
        "export",
        help="write a from_pretrained-loadable checkpoint from a checkpoint-N folder",
        description=__doc__,
        epilog="Example: hf-dist-recipes checkpoint export runs/job/checkpoint-1200 --output runs/job/hf-1200",
    )
    export.add_argument("checkpoint", help="a Trainer checkpoint-N folder (or its global_stepN folder)")
    export.add_argument("--output", required=True, help="directory to write the HuggingFace checkpoint into")
    export.add_argument("--config", help="directory with the model's config.json (default: the checkpoint folder)")
    export.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="dtype of the written weights (default: auto, the training dtype)",
    )
    export.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest weight file, e.g. 5GB, 500MB; bounds the memory held (%(default)s)",
    )
    export.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes writing the shard files, each a contiguous block; the files are the same as with 1 "
        "(default %(default)s)",
    )
    export.add_argument("--json", action="store_true", help="print the result as JSON")
    export.set_defaults(run=run_export)

    dequantize = sub.add_parser(
        "dequantize",
        help="turn an FP8 block-scaled checkpoint (DeepSeek-V3's published weights) into bf16 safetensors",
        description="Every FP8 weight times the scale of its block (the config's weight_block_size, partial last "
        "blocks included, as DeepSeek's weight_dequant), written shard by shard under the same file and tensor "
        "names, without the scales; config.json without its quantization_config; the other files copied.",
        epilog="Example: hf-dist-recipes checkpoint dequantize DeepSeek-V3 --output DeepSeek-V3-bf16 --workers 8",
    )
    dequantize.add_argument("source", help="the folder of the FP8 checkpoint (config.json and its safetensors)")
    dequantize.add_argument("--output", required=True, help="directory to write the bf16 checkpoint into")
    dequantize.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="dtype written (%(default)s)")
    dequantize.add_argument(
        "--workers", type=int, default=1, help="processes, each converting a share of the files (%(default)s)"
    )
    dequantize.add_argument("--json", action="store_true", help="print the result as JSON")
    dequantize.set_defaults(run=run_dequantize)

    verify = sub.add_parser(
        "verify",
        help="check a checkpoint's files against its manifest (sizes and sha256), as a resume does",
        description="A checkpoint-N folder: every file's size and sha256 held to its manifest (exit 1 on a "
        "difference). An output folder: its checkpoints newest first, as auto_resume takes them, until one holds; "
        "exit 1 when none does. One process reads every byte once (sha256 from the disk: 1.7 s per GiB on the "
        "2-core build machine).",
        epilog="Example: hf-dist-recipes checkpoint verify runs/job  (before sbatch of a long job)",
    )
    verify.add_argument("path", help="a checkpoint-N folder, or an output_dir holding checkpoint-N folders")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.set_defaults(run=run_verify)


def run_dequantize(args: argparse.Namespace) -> int:
    from hf_dist_recipes.checkpoint.dequantize import dequantize_checkpoint

    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: use 1 or more processes")
    writable_dir(args.output, "--output", "DeepSeek-V3-bf16")
    start = time.perf_counter()
    with _progress_bar("dequantizing", "file", quiet=args.json) as progress:
        result = dequantize_checkpoint(
            args.source, args.output, dtype=args.dtype, workers=args.workers, progress=progress
        )
    data = {**asdict(result), "source": args.source, "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(
            f"wrote {data['output_dir']}: {data['dequantized']} weights dequantized (blocks of {data['block'][0]} x "
            f"{data['block'][1]}), {data['kept']} kept, {format_size(data['bytes'])} in {len(data['files'])} file(s), "
            f"{data['seconds']:.1f} s\n  load it: AutoModelForCausalLM.from_pretrained({data['output_dir']!r})"
        )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from hf_dist_recipes.checkpoint.manifest import verification

    start = time.perf_counter()
    data = {**asdict(verification(args.path)), "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for skipped in data["skipped"]:
            print(f"{skipped['checkpoint']}: {'; '.join(skipped['problems'])}")
        found = data["checkpoint"]
        print(
            f"{found}: complete, {data['files']} file(s), {format_size(data['bytes'])} read in {data['seconds']:.1f} s"
            if found
            else f"{args.path}: no complete checkpoint"
        )
    return 0 if data["checkpoint"] else 1


@contextlib.contextmanager
def _progress_bar(desc: str, unit: str, *, quiet: bool):
    """A tqdm bar, and the `progress(done, total)` callback the checkpoint writers call, which moves it."""
    from tqdm import tqdm

    with tqdm(desc=desc, unit=unit, disable=quiet) as bar:

        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        yield progress


def run_export(args: argparse.Namespace) -> int:
    from hf_dist_recipes.checkpoint.offline import export_checkpoint, resolve_tag_dir

    max_shard = parse_size(args.max_shard_size, "--max-shard-size")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: use 1 or more writer processes")
    # A wrong path is one line, before any progress bar.
    writable_dir(args.output, "--output", "runs/job/hf-1200")
    resolve_tag_dir(args.checkpoint)
    start = time.perf_counter()
    with _progress_bar("exporting", "group", quiet=args.json) as progress:
        result = export_checkpoint(
            args.checkpoint,
            args.output,
            config_dir=args.config,
            dtype=args.dtype,
            max_shard_bytes=max_shard,
            progress=progress,
            workers=args.workers,
        )
    data = {**asdict(result), "checkpoint": args.checkpoint, "seconds": round(time.perf_counter() - start, 3)}
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def render(data: dict) -> str:
    return (
        f"wrote {data['output_dir']}: {data['parameters']:,} parameters in {data['tensors']} tensors, "
        f"{format_size(data['bytes'])} in {len(data['files'])} file(s), {data['seconds']:.1f} s"
        + (f" ({len(data['written_by'])} writers)" if data.get("written_by") else "")
        + "\n"
        f"  load it: AutoModelForCausalLM.from_pretrained({data['output_dir']!r})"
    )
