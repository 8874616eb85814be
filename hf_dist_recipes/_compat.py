"""The only module that relies on upstream details that are not public API.

Each item names the versions it was read from and checked against; `tests/unit/test_compat.py` fails when an
installed upstream no longer behaves as assumed here.

Covered: transformers 5.24, accelerate 1.16, deepspeed 0.19.8.
"""

from __future__ import annotations

import os

from hf_dist_recipes.jsonfile import load_deepspeed_json

COVERED = {"transformers": "5.24", "accelerate": "1.16", "deepspeed": "0.19"}

# Upstream behaviour other modules work around (public API only, so the code lives there; the tests in
# tests/unit/test_compat.py fail when upstream changes):
# - transformers 5.24 `Trainer.get_tp_size` reads the DeepSpeed TP degree only from `args.hf_deepspeed_config`
#   -> arguments.py adopts a launcher TP config into `args.deepspeed`;
# - accelerate 1.16 `DeepSpeedPlugin` refuses mixed_precision & co. beside a deepspeed_config_file
#   -> parallel/accelerate_config.py never writes them, parallel/lint.py reports them.

# accelerate 1.16 `utils/launch.py` exports the YAML's deepspeed_config_file to the ranks under these names, and
# `DeepSpeedPlugin.__post_init__` reads the file back from the second one. transformers 5.24
# `TrainingArguments.__post_init__` builds its DeepSpeed plugin from them when `deepspeed=` is not given.
ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ACCELERATE_DEEPSPEED_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def launcher_deepspeed_config() -> dict | None:
    """The DeepSpeed JSON that `accelerate launch` handed to this rank, or None when it handed none."""
    if os.environ.get(ACCELERATE_USE_DEEPSPEED, "false").lower() not in ("1", "true", "yes"):
        return None
    path = os.environ.get(ACCELERATE_DEEPSPEED_CONFIG_FILE)
    if not path or path == "none":
        return None
    return load_deepspeed_json(path)
