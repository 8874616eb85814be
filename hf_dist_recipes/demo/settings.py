"""The demo's settings and command-line flags, shared by the per-rank script and `hf-dist-recipes demo`.

Kept apart from `demo.train` so that the CLI can plan and check a launch without importing transformers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


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
    max_bytes: int = 2_000_000
    data_files: tuple[str, ...] = ()  # the user's text / JSON Lines files; empty: the standard library's source
    text_field: str = "text"
    seed: int = 42
    backend: str | None = None
    allow_gloo_on_cuda: bool = False
    save_final: bool = True


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by this script and `hf-dist-recipes demo`."""
    d = DemoSettings()
    parser.add_argument("--output-dir", default=d.output_dir, help="where logs, summaries and the model go (%(default)s)")
    parser.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per sample (%(default)s)")
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch, help="samples per rank per step (%(default)s)")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate, help="peak learning rate (%(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps (%(default)s)")
    parser.add_argument("--logging-steps", type=int, default=d.logging_steps, help="log every N steps (%(default)s)")
    parser.add_argument("--max-bytes", type=int, default=d.max_bytes,
                        help="bytes of standard-library source to use without --data-files (%(default)s)")
    parser.add_argument("--data-files", nargs="+", metavar="PATH", default=list(d.data_files),
                        help="train on these local files instead of the standard library's source, byte-level (no "
                        "tokenizer): text files (one row per line) or JSON Lines (.json/.jsonl, the text in "
                        "--text-field), not mixed; read with datasets and cached by fingerprint in HF_DATASETS_CACHE")
    parser.add_argument("--text-field", default=d.text_field,
                        help="field of each JSON Lines record that holds the text (%(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for every rank (%(default)s)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="force a backend (default: by host)")
    parser.add_argument("--allow-gloo-on-cuda", action="store_true", help="accept Gloo on a CUDA host")
    parser.add_argument("--no-save", dest="save_final", action="store_false", help="skip saving the final model")


def settings_from(ns: argparse.Namespace) -> DemoSettings:
    values = {k: getattr(ns, k) for k in DemoSettings.__dataclass_fields__}
    values["data_files"] = tuple(values["data_files"] or ())  # argparse gives a list; the settings are frozen
    return DemoSettings(**values)
