"""Run on every rank by tests/distributed/test_launch_scripts_two_nodes.py, under a generated launch script.

    launch_script_worker.py OUTPUT_DIR STEPS MODEL

Writes the environment the script, the stand-in srun and the launcher gave this rank (the scheduler's variables,
the launcher's rank variables, the NCCL settings the script exports, the DeepSpeed hand-over) to
OUTPUT_DIR/env/rank<RANK>.json, then trains as probe_worker.py does (RecipeTrainer, the DeepSpeed config the
launcher hands over) and writes OUTPUT_DIR/probe/rank<N>.json.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from probe_worker import main  # noqa: E402

PREFIXES = ("SLURM_", "TORCH_NCCL_", "TORCH_FR_", "NCCL_", "GLOO_", "ACCELERATE_USE_", "ACCELERATE_DEEPSPEED_")
NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "HF_DIST_RECIPES_USE_CPU")

if __name__ == "__main__":
    output_dir, steps, model = sys.argv[1:4]
    seen = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES) or k in NAMES}
    env_dir = Path(output_dir) / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    (env_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen, indent=1, sort_keys=True))
    main(output_dir, int(steps), "recipe", model)
