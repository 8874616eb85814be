"""What the manifest's digests cost at a save (`hf_dist_recipes.checkpoint.manifest`): a rank's share of a
checkpoint hashed right after it was written, against the save itself.

    python benchmarks/checkpoint_digests.py                  # 1 GiB of optimizer-like state: about 15 s
    python benchmarks/checkpoint_digests.py --mib 256 --repeats 5

Side by side, `--repeats` times on the same file of `--mib` MiB of fp32 tensors: (1) the save, `torch.save` to a
path as DeepSpeed's checkpoint engine and the Trainer call it; (2) its fsync, which the first rank of each node runs;
(3) `manifest.file_digest` right after, the pages still in the page cache, as `complete_checkpoint` reads them;
(4) the same after the file's pages were dropped from the cache (`posix_fadvise(DONTNEED)` after the fsync), the
read a resume makes. Printed: seconds per GiB of each, and the digest's time as a ratio of the save's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def one_round(folder: Path, mib: int) -> dict[str, float]:
    import torch

    from hf_dist_recipes.checkpoint.manifest import file_digest

    path = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {f"state.{i}": torch.randn(2**18) for i in range(mib)}  # 1 MiB of fp32 each
    times = {}
    start = time.perf_counter()
    torch.save(state, path)
    times["save"] = time.perf_counter() - start
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    os.fsync(fd)
    times["fsync"] = time.perf_counter() - start
    start = time.perf_counter()
    size, hot = file_digest(path)
    times["digest_cached"] = time.perf_counter() - start
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    start = time.perf_counter()
    _, cold = file_digest(path)
    times["digest_from_disk"] = time.perf_counter() - start
    assert hot == cold
    path.unlink()
    return {"bytes": size, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="MiB written and hashed per round (%(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is printed (%(default)s)")
    parser.add_argument("--dir", default=None, help="where the file is written (default: a temporary folder)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rounds = [one_round(Path(tmp), args.mib) for _ in range(args.repeats)]
    gib = rounds[0]["bytes"] / 2**30
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "bytes"}
    result = {
        "gib": round(gib, 3),
        "seconds_per_gib": {k: round(v / gib, 3) for k, v in median.items()},
        "digest_over_save": round(median["digest_cached"] / median["save"], 3),
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{gib:.2f} GiB, median of {args.repeats} rounds, seconds per GiB:")
    for key, value in result["seconds_per_gib"].items():
        print(f"  {key:18s} {value:6.3f}")
    print(f"digest (page cache) / save: {result['digest_over_save']:.2f}")


if __name__ == "__main__":
    main()
