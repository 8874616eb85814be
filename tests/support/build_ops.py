"""Build the DeepSpeed ops the suite's CPU ranks load, once, before the tests: `make ops` (and so `make test`).

    python -m tests.support.build_ops

DeepSpeed JIT-builds an op the first time a process loads it (`deepspeed_shm_comm` at every CPU launch's
`init_distributed`, `cpu_adam` in `hf-dist-recipes calibrate`, every optimizer-offload run and test_compat's CPU
Adam check). Left to the suite, the first test to load one builds it while the tests of the other pytest processes
that load it wait on torch's build lock: measured in clean-clone CI (2026-12-06), the preflight launch's set-up took
100 s against 36 s with the op built, and the calibrate test's 208 s against 60 s. A training image builds them at
install for the same reason (a job killed mid-build leaves the lock that hangs the next one: `doctor/op_builds.py`).
Built here with the ranks' environment (GPUs hidden, so DeepSpeed's CPU builders) into the folder the ranks load
from: `TORCH_EXTENSIONS_DIR`, which the Makefile sets to `.cache/torch_extensions` of the checkout when unset, so
that every process of the suite, launched through `RecipeTrainingArguments` or not, finds the same builds. Loading
an op already built takes about a second.
"""

from __future__ import annotations

import os
import sys
import time

from tests.support.paths import environment_first_on_path

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def main() -> int:
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        print("build_ops: set TORCH_EXTENSIONS_DIR (make ops sets it) to the folder the suite's ranks load from")
        return 2
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")  # as tests.support.launch.cpu_only_env
    # The ninja the suite builds with (tests/conftest.py puts this environment's executables first on PATH): two
    # ninja versions take each other's .ninja_log for a changed command, and the suite rebuilt what `make ops`,
    # run by make with the system's ninja first, had built (seen: cpu_adam rebuilt, 240 s of both cores).
    environment_first_on_path()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in OPS:
        start = time.perf_counter()
        builder = accelerator.create_op_builder(name)
        builder.load(verbose=False)
        print(f"build_ops: {builder.NAME} ready in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
