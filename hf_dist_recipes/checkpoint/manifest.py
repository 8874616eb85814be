"""A checkpoint is complete, or it is not used: the manifest written last into every `checkpoint-N`, and the reading
that tells a complete checkpoint from one that a crash, a full disk or a lost rank left half-written.

Writing (`complete_checkpoint`, called by RecipeTrainer after the Trainer's save, on every rank): the first rank of
each node fsyncs every file under the checkpoint (a file's unwritten pages live in the page cache of the host that
wrote them, whichever process wrote them, so one pass per host flushes every rank's share), then a barrier, then
rank 0 lists every file with its size into `hf_dist_recipes_manifest.json`, durably and atomically. So a manifest
exists only once every rank's files are on disk. No checksum: reading back a checkpoint's optimizer states (12 bytes
a parameter and more) costs as long as writing them; the sizes catch what a crash leaves (a file missing or cut
short). The files are listed as rank 0 sees them: a checkpoint directory on a file system every node shares.

Reading: `check_checkpoint(path)` names each problem (no manifest, a file missing, a size that differs);
`newest_complete_checkpoint(output_dir)` is the newest checkpoint without one, with the newer ones it passed over and
why (`ResumeChoice`). Rotation: `rotate_complete_checkpoints` keeps `save_total_limit` complete checkpoints, the
newest complete one always, and neither counts nor deletes an incomplete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_dist_recipes.core.files import write_atomically

MANIFEST_NAME = "hf_dist_recipes_manifest.json"
FORMAT = 1
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # the Trainer's `checkpoint-<global step>` folders


@dataclass(frozen=True)
class CheckpointLayout:
    """How the job that wrote a checkpoint was split: its processes, TP and EP degrees, ZeRO stage (0: none)."""

    world_size: int
    tp: int = 1
    ep: int = 1
    zero_stage: int = 0


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds: its step, the layout, every file (relative POSIX path -> bytes)."""

    step: int
    layout: CheckpointLayout
    files: dict[str, int]
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"manifest format {data.get('format')!r}, this version reads {FORMAT}")
        return cls(
            step=int(data["step"]),
            layout=CheckpointLayout(**data["layout"]),
            files={str(k): int(v) for k, v in data["files"].items()},
        )


def checkpoint_files(checkpoint: str | os.PathLike) -> dict[str, int]:
    """Every file under `checkpoint` (relative POSIX path -> bytes), without the manifest and the temporary files
    of a write in progress (`core.files.write_atomically`)."""
    root = Path(checkpoint)
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name == MANIFEST_NAME or (name.startswith(".") and name.endswith(".tmp")):
                continue
            path = Path(folder) / name
            out[path.relative_to(root).as_posix()] = path.stat().st_size
    return dict(sorted(out.items()))


def fsync_tree(checkpoint: str | os.PathLike) -> None:
    """fsync every file and folder under `checkpoint` (the folders too: a new file's name is durable only once its
    folder is)."""
    for folder, _, names in os.walk(checkpoint):
        for name in names:
            _fsync(os.path.join(folder, name))
        _fsync(folder)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(checkpoint: str | os.PathLike, step: int, layout: CheckpointLayout) -> Manifest:
    """List the files under `checkpoint` into its manifest, durably (call after every rank's files are)."""
    manifest = Manifest(step=step, layout=layout, files=checkpoint_files(checkpoint))
    write_atomically(Path(checkpoint) / MANIFEST_NAME, manifest.to_json(), durable=True)
    _fsync(os.fspath(checkpoint))  # the manifest's name, after its bytes
    return manifest


def complete_checkpoint(
    checkpoint: str | os.PathLike, step: int, layout: CheckpointLayout, *, flushes: bool, writes: bool
) -> Manifest | None:
    """On every rank, after the Trainer's save: `flushes` (the first rank of each node) fsyncs the files, every rank
    waits for every other's, then `writes` (rank 0) writes the manifest, which it returns (None elsewhere)."""
    if flushes:
        fsync_tree(checkpoint)
    _barrier()
    return write_manifest(checkpoint, step, layout) if writes else None


def retract_manifest(checkpoint: str | os.PathLike, *, writes: bool) -> None:
    """On every rank, before the Trainer writes into `checkpoint`: a folder saved into again (after a roll-back to
    an older checkpoint) is incomplete from its first new byte, so `writes` (rank 0) removes its old manifest, durably,
    and no rank writes before that (issue 41: a kill mid-save left two runs' files under one complete manifest)."""
    if writes and (path := Path(checkpoint) / MANIFEST_NAME).is_file():
        path.unlink()
        _fsync(str(checkpoint))
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def check_checkpoint(checkpoint: str | os.PathLike) -> list[str]:
    """What keeps `checkpoint` from being resumed, one phrase each; [] when it is complete."""
    path = Path(checkpoint) / MANIFEST_NAME
    if not path.is_file():
        return [f"no {MANIFEST_NAME} (its save did not finish)"]
    try:
        manifest = Manifest.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, KeyError, TypeError) as error:
        return [f"{MANIFEST_NAME} unreadable: {error}"]
    problems = []
    for name, size in manifest.files.items():
        file = Path(checkpoint) / name
        if not file.is_file():
            problems.append(f"{name} missing")
        elif (actual := file.stat().st_size) != size:
            problems.append(f"{name} has {actual} bytes, the manifest says {size}")
    return problems


def checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """The `checkpoint-N` folders in `output_dir`, oldest step first ([] when it does not exist)."""
    if not os.path.isdir(output_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (m := CHECKPOINT_DIR.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return [path for _, path in sorted(found)]


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over, and why."""

    checkpoint: str
    problems: list[str]

    def line(self) -> str:
        return f"{self.checkpoint} is incomplete, not resumed from: {'; '.join(self.problems)}"


@dataclass(frozen=True)
class ResumeChoice:
    """The newest complete checkpoint of an output folder (None: there is none) and the newer ones skipped."""

    checkpoint: str | None
    skipped: list[Skipped] = field(default_factory=list)


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> ResumeChoice:
    """The newest checkpoint of `output_dir` that `check_checkpoint` finds complete, and every newer one, skipped."""
    skipped = []
    for checkpoint in reversed(checkpoints(output_dir)):
        problems = check_checkpoint(checkpoint)
        if not problems:
            return ResumeChoice(checkpoint, skipped)
        skipped.append(Skipped(checkpoint, problems))
    return ResumeChoice(None, skipped)


def rotate_complete_checkpoints(output_dir: str | os.PathLike, limit: int | None, best: str | None = None) -> list[str]:
    """Delete the oldest complete checkpoints beyond `limit` (`save_total_limit`; None or <= 0: none), as transformers
    does, but counting complete ones only: the newest complete one and `best` (the best model's, when complete) are
    always kept, and an incomplete one is neither counted nor deleted (it is what a crash left: named on resume, kept
    for a look). Returns the deleted folders."""
    if not limit or limit <= 0:
        return []
    complete = [c for c in checkpoints(output_dir) if not check_checkpoint(c)]
    if not complete:
        return []
    kept = {complete[-1]}
    if best is not None and os.path.normpath(best) in map(os.path.normpath, complete):
        kept.add(next(c for c in complete if os.path.normpath(c) == os.path.normpath(best)))
    for checkpoint in reversed(complete):
        if len(kept) >= limit:
            break
        kept.add(checkpoint)
    deleted = [c for c in complete if c not in kept]
    for checkpoint in deleted:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return deleted
