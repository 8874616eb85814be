"""A checkpoint is complete, or it is not used: the manifest written last into every `checkpoint-N`, and the reading
that tells a complete checkpoint from one that a crash, a full disk, a lost rank or a flipped disk block left behind.

Writing (`complete_checkpoint`, called by RecipeTrainer after the Trainer's save, on every rank): once every rank has
written, each rank hashes its share of the files (`share`: about 1/world of the bytes, so the ranks read in parallel;
the pages just written are still in the host's page cache, so on one node this reads memory, not the disk: sha256
took 0.78 s per GiB there on the 2-core build machine, 0.79 x a torch.save into the page cache,
benchmarks/checkpoint_digests.py) and the first rank of each node fsyncs every file (a file's unwritten pages live in
the page cache of the host that wrote them, whichever process wrote them, so one pass per host flushes every rank's
share); then rank 0 lists every file with its size and sha256 into `hf_dist_recipes_manifest.json`, durably and
atomically. So a manifest exists only once every rank's files are on disk. The digests are not taken inside the
writers' own streams: DeepSpeed's and the Trainer's writers are handed a path (torch.save, safetensors), and reaching
into them would be a patch on each; a read right after the write costs the hashing, not a second trip to the disk.
The files are listed as rank 0 sees them: a checkpoint directory on a file system every node shares.

Reading: `check_checkpoint(path)` names each problem the sizes show (no manifest, a file missing or cut short: cheap,
the rotation uses it); `verify_digests` re-hashes a share of the files against the manifest (same-size corruption:
issue 41); `newest_complete_checkpoint(output_dir)` is the newest checkpoint that passes both, with the newer ones it
passed over and why (`ResumeChoice`), every rank hashing its share when called on every rank of a job. A format-1
manifest (sizes only, from a version before the digests) is still read, and checked by its sizes. Rotation:
`rotate_complete_checkpoints` keeps `save_total_limit` complete checkpoints, the newest complete one always, and
neither counts nor deletes an incomplete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_dist_recipes.core.files import write_atomically
from hf_dist_recipes.core.gather import gather_objects

MANIFEST_NAME = "hf_dist_recipes_manifest.json"
FORMAT = 2  # 2: a sha256 per file; 1: sizes only (still read)
DIGEST = "sha256"  # hashlib's name; `sha256sum` checks the same digests by hand
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
    """What a complete checkpoint holds: its step, the layout, every file (relative POSIX path -> bytes) and its
    sha256 (relative POSIX path -> hex digest; {} in a format-1 manifest)."""

    step: int
    layout: CheckpointLayout
    files: dict[str, int]
    digests: dict[str, str] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") not in (1, FORMAT):
            raise ValueError(f"manifest format {data.get('format')!r}, this version reads 1 and {FORMAT}")
        return cls(
            step=int(data["step"]),
            layout=CheckpointLayout(**data["layout"]),
            files={str(k): int(v) for k, v in data["files"].items()},
            digests={str(k): str(v) for k, v in data.get("digests", {}).items()},
            format=int(data["format"]),
        )


def read_manifest(checkpoint: str | os.PathLike) -> Manifest:
    """The manifest of `checkpoint` (OSError without one, ValueError when it cannot be read)."""
    return Manifest.from_json((Path(checkpoint) / MANIFEST_NAME).read_text(encoding="utf-8"))


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in one streamed pass."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, DIGEST).hexdigest()
        return f.tell(), digest


def share(files: dict[str, int], rank: int, world: int) -> list[str]:
    """The files (of a relative path -> bytes listing) that `rank` of `world` hashes: the largest file first to the
    rank with the fewest bytes so far (ties: the lower rank), so every rank reads about 1/world of the bytes; the same
    on every rank given the same listing."""
    loads, mine = [0] * world, []
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        least = min(range(world), key=lambda r: (loads[r], r))
        loads[least] += size
        if least == rank:
            mine.append(name)
    return sorted(mine)


def digest_files(checkpoint: str | os.PathLike, names: list[str]) -> dict[str, tuple[int, str]]:
    """Each of `names` under `checkpoint`: relative path -> (bytes, sha256 hex)."""
    return {name: file_digest(Path(checkpoint) / name) for name in names}


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


def write_manifest(
    checkpoint: str | os.PathLike,
    step: int,
    layout: CheckpointLayout,
    digests: dict[str, tuple[int, str]] | None = None,
) -> Manifest:
    """Write the manifest of `checkpoint`, durably (call once every rank's files are): `digests` (relative path ->
    (bytes, sha256)) as the ranks hashed them; None: every file under it, hashed here."""
    if digests is None:
        digests = digest_files(checkpoint, list(checkpoint_files(checkpoint)))
    files = {name: size for name, (size, _) in sorted(digests.items())}
    manifest = Manifest(step, layout, files, {name: digest for name, (_, digest) in sorted(digests.items())})
    write_atomically(Path(checkpoint) / MANIFEST_NAME, manifest.to_json(), durable=True)
    _fsync(os.fspath(checkpoint))  # the manifest's name, after its bytes
    return manifest


def complete_checkpoint(
    checkpoint: str | os.PathLike, step: int, layout: CheckpointLayout, *, rank: int, world: int, flushes: bool
) -> Manifest | None:
    """On every rank, after the Trainer's save: once every rank has written, each hashes its `share` of rank 0's
    listing, `flushes` (the first rank of each node) fsyncs every file, then rank 0 writes the manifest with every
    rank's digests, which it returns (None elsewhere)."""
    _barrier()
    listing = _agreed(checkpoint_files(checkpoint) if rank == 0 else None, world)
    mine = digest_files(checkpoint, share(listing, rank, world))
    if flushes:
        fsync_tree(checkpoint)
    digests = {name: value for part in _gathered(mine, world) for name, value in part.items()}
    return write_manifest(checkpoint, step, layout, digests) if rank == 0 else None


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


def _agreed(value, world: int):
    """Rank 0's `value` on every rank (a collective when world > 1)."""
    return gather_objects(value)[0] if world > 1 else value


def _gathered(value, world: int) -> list:
    """Every rank's `value`, in rank order (a collective when world > 1)."""
    return gather_objects(value) if world > 1 else [value]


def check_checkpoint(checkpoint: str | os.PathLike) -> list[str]:
    """What keeps `checkpoint` from being resumed, one phrase each; [] when it is complete."""
    if not (Path(checkpoint) / MANIFEST_NAME).is_file():
        return [f"no {MANIFEST_NAME} (its save did not finish)"]
    try:
        manifest = read_manifest(checkpoint)
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


def verify_digests(checkpoint: str | os.PathLike, rank: int = 0, world: int = 1) -> list[str]:
    """This rank's `share` of the files of a `check_checkpoint`-complete checkpoint, hashed again and held to the
    manifest's sha256: one phrase per file whose content is not what was saved ([] for a format-1 manifest)."""
    manifest = read_manifest(checkpoint)
    if not manifest.digests:
        return []
    problems = []
    for name in share(manifest.files, rank, world):
        try:  # a problem, never an exception: the other ranks are waiting for this one's answer
            size, digest = file_digest(Path(checkpoint) / name)
        except OSError as error:
            problems.append(f"{name} unreadable: {error}")
            continue
        if digest != manifest.digests[name]:
            problems.append(f"{name} is not what was saved: its {DIGEST} differs from the manifest's ({size} bytes)")
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


def newest_complete_checkpoint(output_dir: str | os.PathLike, rank: int = 0, world: int = 1) -> ResumeChoice:
    """The newest checkpoint of `output_dir` that `check_checkpoint` finds complete and whose digests hold
    (`verify_digests`), and every newer one, skipped. With world > 1, call it on every rank: rank 0 lists and checks
    the sizes, every rank hashes its share, and all return the same choice."""
    skipped = []
    for checkpoint in reversed(_agreed(checkpoints(output_dir), world)):
        problems = _agreed(check_checkpoint(checkpoint) if rank == 0 else None, world)
        if not problems:
            problems = [p for part in _gathered(verify_digests(checkpoint, rank, world), world) for p in part]
        if not problems:
            return ResumeChoice(checkpoint, skipped)
        skipped.append(Skipped(checkpoint, problems))
    return ResumeChoice(None, skipped)


@dataclass(frozen=True)
class Verification:
    """`checkpoint verify`: the complete checkpoint found (None: none), the newer ones skipped, and the files and
    bytes of the one found."""

    checkpoint: str | None
    skipped: list[Skipped]
    files: int = 0
    bytes: int = 0


def verification(path: str | os.PathLike) -> Verification:
    """A checkpoint folder (it has a manifest, or its name is checkpoint-N) checked whole, sizes and digests, in this
    process; any other folder as auto_resume reads an output folder (`newest_complete_checkpoint`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such folder; pass a checkpoint-N folder or the output_dir that holds them")
    if (Path(path) / MANIFEST_NAME).is_file() or CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(path))):
        problems = check_checkpoint(path) or verify_digests(path)
        choice = ResumeChoice(None, [Skipped(path, problems)]) if problems else ResumeChoice(path)
    else:
        choice = newest_complete_checkpoint(path)
    if choice.checkpoint is None:
        return Verification(None, choice.skipped)
    files = read_manifest(choice.checkpoint).files
    return Verification(choice.checkpoint, choice.skipped, len(files), sum(files.values()))


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
