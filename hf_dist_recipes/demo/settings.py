"""The demo's settings and command-line flags, shared by the per-rank script and `hf-dist-recipes demo`.

Kept apart from `demo.train` so that the CLI can plan and check a launch without importing transformers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DemoSettings:
    """Demo hyper-parameters; the defaults train 200 steps in about a minute on 2 CPU cores."""

    output_dir: str = "runs/demo"
    max_steps: int = 200
    seq_len: int = 128
    micro_batch: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    logging_steps: int = 20
    max_bytes: int | None = None  # None: DEFAULT_MAX_BYTES, or one step's bytes when a step needs more (max_bytes_for)
    data_files: tuple[str, ...] = ()  # the user's text / JSON Lines files; empty: the standard library's source
    text_field: str = "text"
    seed: int = 42
    backend: str | None = None
    allow_gloo_on_cuda: bool = False
    save_final: bool = True


DEFAULT_MAX_BYTES = 2_000_000
WARMUP_FRACTION = 0.1  # of --max-steps, when --warmup-steps is not given (the Trainer's warmup_ratio, as a default)
LOGS_PER_RUN = 10  # --logging-steps, when not given: about this many logged steps per run, at most every 20 steps


def default_warmup_steps(max_steps: int) -> int:
    """The warm-up when the user gave none: WARMUP_FRACTION of the run (20 of the default 200 steps). A fixed
    default broke a valid --max-steps (`demo --max-steps 10` stopped on a warm-up of 20 the user never set)."""
    return int(max_steps * WARMUP_FRACTION) if isinstance(max_steps, int) and max_steps > 0 else 0


def default_logging_steps(max_steps: int) -> int:
    """Log every N steps when the user gave no N: about LOGS_PER_RUN logs per run, every 20 steps at most (the
    default 200 steps log every 20), every step at least, so that a short run still logs its losses."""
    if not isinstance(max_steps, int) or max_steps < 1:
        return DemoSettings.logging_steps
    return max(1, min(DemoSettings.logging_steps, max_steps // LOGS_PER_RUN))


def max_bytes_for(s: DemoSettings, processes: int) -> int:
    """--max-bytes, or when not given DEFAULT_MAX_BYTES, raised to one step's blocks (--seq-len x --micro-batch x
    the processes) when a step needs more: a fixed default refused a valid --micro-batch the user asked for."""
    if s.max_bytes is not None:
        return s.max_bytes
    return max(DEFAULT_MAX_BYTES, s.seq_len * s.micro_batch * processes)


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by this script and `hf-dist-recipes demo`."""
    d = DemoSettings()
    parser.add_argument(
        "--output-dir", default=d.output_dir, help="where logs, summaries and the model go (%(default)s)"
    )
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per sample (%(default)s)")
    parser.add_argument(
        "--micro-batch", type=int, default=d.micro_batch, help="samples per rank per step (%(default)s)"
    )
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate, help="peak learning rate (%(default)s)")
    # Defaults that depend on --max-steps are resolved in settings_from, from the --max-steps given.
    parser.add_argument(
        "--warmup-steps",
        type=int,
        help=f"linear warm-up steps (default: {WARMUP_FRACTION:g} of --max-steps, {d.warmup_steps} of {d.max_steps})",
    )
    parser.add_argument(
        "--logging-steps",
        type=int,
        help=f"log every N steps (default: --max-steps / {LOGS_PER_RUN}, at most {d.logging_steps}, at least 1)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        help=f"bytes of standard-library source to use without --data-files (default: {DEFAULT_MAX_BYTES:,}, or "
        "one step's blocks when a step needs more)",
    )
    parser.add_argument(
        "--data-files",
        nargs="+",
        metavar="PATH",
        default=list(d.data_files),
        help="train on these local files instead of the standard library's source, byte-level (no "
        "tokenizer): text files (one row per line) or JSON Lines (.json/.jsonl, the text in "
        "--text-field), not mixed; read with datasets and cached by fingerprint in HF_DATASETS_CACHE",
    )
    parser.add_argument(
        "--text-field", default=d.text_field, help="field of each JSON Lines record that holds the text (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for every rank (%(default)s)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="force a backend (default: by host)")
    parser.add_argument("--allow-gloo-on-cuda", action="store_true", help="accept Gloo on a CUDA host")
    parser.add_argument("--no-save", dest="save_final", action="store_false", help="skip saving the final model")


def check_settings(s: DemoSettings, processes: int) -> None:
    """Raise ValueError, naming the flag and a valid value, for the first setting the ranks would fail on (or
    train nothing with); `processes` is the launch's world size. Cheap: no file is read. The rules are the ones
    `RecipeTrainingArguments` and the data code apply, called with the flag names."""
    from hf_dist_recipes.core.user_values import positive_int, setting
    from hf_dist_recipes.demo.data import validate_seq_len
    from hf_dist_recipes.parallel.batch import validate_micro_batch
    from hf_dist_recipes.reproducibility.seeding import validate_seed
    from hf_dist_recipes.schedules.warmup_cosine import (
        validate_learning_rate,
        validate_total_steps,
        validate_warmup_steps,
    )

    validate_total_steps(s.max_steps, "--max-steps")
    validate_warmup_steps(s.warmup_steps, s.max_steps, ("--warmup-steps", "--max-steps"))
    validate_micro_batch(s.micro_batch, "--micro-batch")
    validate_seq_len(s.seq_len, "--seq-len")
    validate_learning_rate(s.learning_rate, "--learning-rate")
    positive_int(s.logging_steps, "--logging-steps", 20, unit="optimizer steps")
    validate_seed(s.seed, "--seed")
    if not s.data_files:
        # Blocks are dropped unless a whole step's worth exists (dataloader_drop_last): fewer gives no step at all.
        step_bytes = s.seq_len * s.micro_batch * processes
        max_bytes = max_bytes_for(s, processes)
        positive_int(max_bytes, "--max-bytes", max(step_bytes, DEFAULT_MAX_BYTES), unit="bytes")
        if max_bytes < step_bytes:
            raise ValueError(
                f"--max-bytes {max_bytes} gives {max_bytes // s.seq_len} block(s) of {s.seq_len} bytes, fewer "
                f"than one step needs ({s.micro_batch} x {processes} processes); e.g. "
                f"{setting('--max-bytes', step_bytes * 100)}"
            )


def settings_from(ns: argparse.Namespace, processes: int | None = None) -> DemoSettings:
    """The settings of parsed flags, the defaults that follow the run length (warm-up, logging interval) computed
    from --max-steps where the user did not give them; --max-bytes too given `processes` (else left to the launch
    plan, which knows them: `max_bytes_for`)."""
    values = {k: getattr(ns, k) for k in DemoSettings.__dataclass_fields__}
    values["data_files"] = tuple(values["data_files"] or ())  # argparse gives a list; the settings are frozen
    if values["warmup_steps"] is None:
        values["warmup_steps"] = default_warmup_steps(values["max_steps"])
    if values["logging_steps"] is None:
        values["logging_steps"] = default_logging_steps(values["max_steps"])
    settings = DemoSettings(**values)
    return settings if processes is None else replace(settings, max_bytes=max_bytes_for(settings, processes))
