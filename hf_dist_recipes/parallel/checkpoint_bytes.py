"""Checkpoint bytes per save, per rank and in total, and how long a save may keep the other ranks waiting.

What a `save_steps` save writes under DeepSpeed (`checkpoint-N/global_stepN/`), every rank at once:
- `*_optim_states.pt`: the rank's ZeRO partition of the fp32 master weights and Adam's two moments, 12 bytes per
  partitioned element whatever the training precision (DeepSpeed writes the fp32 flat groups beside the moments);
- `*_model_states.pt`: under ZeRO-3 placeholders and buffers (counted as 0 here); below stage 3 the data-parallel
  rank 0 of each TP rank writes its whole TP-local weights in the training precision.
The `from_pretrained` copy (`save_model`, `checkpoint export`, or each checkpoint with
`hf_weights_in_checkpoints=True`): every parameter once in the training precision, in shards of `max_shard_bytes`
that the ranks write in contiguous blocks (`hf_dist_recipes.checkpoint.shard_plan`), so the busiest rank writes
ceil(shards / ranks) shards.

DeepSeek-V3 (671B parameters, bf16) on 64 ranks: 8.05 TB of engine files (126 GB per rank), and 1.34 TB for the HF
copy (269 files of 5 GB: at most 5, 25 GB, per rank shared; the whole 1.34 TB on rank 0 before shared writing).

The save bound: a save is not a hang. While ranks write, the others wait in the next collective (the save's final
barrier, or the gathers of the HF copy between two shards), so the collective timeout during a save is raised to
`save_timeout_s`: the step timeout plus the busiest rank's bytes at `ASSUMED_WRITE_BYTES_PER_S` per rank. A rank
that writes slower than that for a whole save is reported as stuck, as a stuck step would be. The heartbeat needs no
change: its thread beats while the main thread writes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hf_dist_recipes.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from hf_dist_recipes.core.sizes import MIB, format_size

ENGINE_BYTES_PER_ELEMENT = 12  # fp32 master + Adam exp_avg + exp_avg_sq, per partitioned element
# Per rank, sustained, to the checkpoint folder: a conservative figure for a shared parallel file system with 8 ranks
# of a node writing at once (local NVMe gives GB/s). Only the timeout during a save depends on it.
ASSUMED_WRITE_BYTES_PER_S = 100 * MIB
# Rank 0 reading the HF checkpoint alone under ZeRO-3 (`from_pretrained` in zero.Init: the others wait in its
# broadcasts): sustained, from a shared parallel file system. Only the start-up timeout depends on it.
ASSUMED_READ_BYTES_PER_S = 500 * 10**6
DEFAULT_DDP_TIMEOUT = 7200  # RecipeTrainingArguments' ddp_timeout, s; the stock 1800 is short for such a read
# The rest of start-up beside that read, at torch's own collective timeout: DeepSpeed's op builds, the engine.
STARTUP_BASE_S = 1800
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_SHARD_BYTES = DEFAULT_MAX_SHARD_BYTES  # save_shard_size's default, "5GB" = 5e9 bytes


@dataclass(frozen=True)
class SaveBytes:
    """Bytes written by one save. `engine_*`: the engine's files of a `checkpoint-N` (the busiest rank's, all
    ranks'); `hf_*`: the `from_pretrained` copy (the busiest rank's share with shared writing, the whole)."""

    world_size: int
    engine_per_rank: int
    engine_total: int
    hf_per_rank: int
    hf_total: int

    def checkpoint_per_rank(self, hf_copy: bool = False) -> int:
        """The busiest rank's bytes in one `checkpoint-N` (with the HF copy inside when `hf_copy`)."""
        return self.engine_per_rank + (self.hf_per_rank if hf_copy else 0)

    def checkpoint_total(self, hf_copy: bool = False) -> int:
        return self.engine_total + (self.hf_total if hf_copy else 0)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "checkpoint_per_rank": self.checkpoint_per_rank(),
            "checkpoint_total": self.checkpoint_total(),
        }


def hf_share_bytes(hf_total: int, world_size: int, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """The most one of `world_size` writers (contiguous blocks of shards) writes of an `hf_total`-byte checkpoint in
    shards of at most `max_shard_bytes`: ceil(shards / writers) shards (a shard may end early at a layer boundary,
    so this is an upper bound)."""
    shards = max(1, math.ceil(hf_total / max_shard_bytes))
    return min(hf_total, math.ceil(shards / world_size) * max_shard_bytes)


def save_bytes(
    total_params: int,
    world_size: int,
    *,
    precision: str = "bf16",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    engine_elements_per_rank: int | None = None,
    model_states_per_rank: int = 0,
) -> SaveBytes:
    """Bytes per save for a model of `total_params` on `world_size` ranks. `engine_elements_per_rank`: the busiest
    rank's partitioned elements (default: an even split, total_params / world_size, as ZeRO-3 partitions);
    `model_states_per_rank`: bytes of weights in `*_model_states.pt` (0 under ZeRO-3)."""
    if world_size < 1 or total_params < 0:
        raise ValueError(f"world_size={world_size}, total_params={total_params}: need >= 1 rank and >= 0 parameters")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}: use one of {sorted(PRECISION_BYTES)}")
    elements = math.ceil(total_params / world_size) if engine_elements_per_rank is None else engine_elements_per_rank
    engine_per_rank = elements * ENGINE_BYTES_PER_ELEMENT + model_states_per_rank
    hf_total = total_params * PRECISION_BYTES[precision]
    return SaveBytes(
        world_size=world_size,
        engine_per_rank=engine_per_rank,
        engine_total=elements * ENGINE_BYTES_PER_ELEMENT * world_size + model_states_per_rank * world_size,
        hf_per_rank=hf_share_bytes(hf_total, world_size, max_shard_bytes),
        hf_total=hf_total,
    )


def save_timeout_s(bytes_per_rank: int, base_s: float, write_bytes_per_s: float = ASSUMED_WRITE_BYTES_PER_S) -> float:
    """The collective timeout while a save runs: `base_s` (the step timeout) plus the busiest rank's bytes at
    `write_bytes_per_s`, in seconds."""
    if write_bytes_per_s <= 0:
        raise ValueError(f"write_bytes_per_s={write_bytes_per_s}: use a positive bandwidth in bytes per second")
    return base_s + bytes_per_rank / write_bytes_per_s


def load_seconds(hf_total: int, read_bytes_per_s: float = ASSUMED_READ_BYTES_PER_S) -> float:
    """Seconds rank 0 takes to read an `hf_total`-byte checkpoint at `read_bytes_per_s`."""
    if read_bytes_per_s <= 0:
        raise ValueError(f"read_bytes_per_s={read_bytes_per_s}: use a positive bandwidth in bytes per second")
    return hf_total / read_bytes_per_s


def startup_timeout_s(hf_total: int, read_bytes_per_s: float = ASSUMED_READ_BYTES_PER_S) -> int:
    """The collective timeout start-up needs (`ddp_timeout`): STARTUP_BASE_S plus rank 0's read of the weights, in
    whole seconds; `config generate` records it and RecipeTrainingArguments raises a default `ddp_timeout` to it."""
    return math.ceil(STARTUP_BASE_S + load_seconds(hf_total, read_bytes_per_s))


def render_load(b: SaveBytes, ddp_timeout_s: int) -> str:
    """One line for `config estimate`: the weights' load at start-up against `ddp_timeout_s`."""
    need = startup_timeout_s(b.hf_total)
    verdict = (
        f"within ddp_timeout {ddp_timeout_s} s"
        if need <= ddp_timeout_s
        else f"more than ddp_timeout {ddp_timeout_s} s: config generate records {need} s, which "
        "RecipeTrainingArguments sets (the stock Trainer: pass --ddp_timeout)"
    )
    return (
        f"loading the weights: rank 0 reads {_gb(b.hf_total)} in about {load_seconds(b.hf_total) / 60:,.0f} min at an "
        f"assumed {_gb(ASSUMED_READ_BYTES_PER_S)}/s; start-up needs {need} s, {verdict}"
    )


def _gb(n: float) -> str:
    return format_size(n, decimal=True)  # decimal units, as the shard sizes


def render(b: SaveBytes) -> str:
    """Two lines for `config estimate`: the bytes of one save, then its time at ASSUMED_WRITE_BYTES_PER_S and the
    disk that kept checkpoints take."""
    return (
        f"checkpoint per save: {_gb(b.engine_per_rank)} per rank, {_gb(b.engine_total)} in all "
        f"(engine files, every rank at once); HF copy (save_model) {_gb(b.hf_total)}, "
        f"at most {_gb(b.hf_per_rank)} per rank\n"
        f"a save takes about {b.engine_per_rank / ASSUMED_WRITE_BYTES_PER_S / 60:,.0f} min at an assumed "
        f"{ASSUMED_WRITE_BYTES_PER_S / MIB:.0f} MiB/s per rank; each checkpoint kept takes {_gb(b.engine_total)}: "
        "set save_total_limit (the Trainer keeps every one)"
    )
