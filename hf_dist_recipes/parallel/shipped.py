"""The configs shipped in accelerate_configs/: regenerated from accelerate_configs/manifest.json."""

from __future__ import annotations

import json
from pathlib import Path


def manifest(configs_dir: str | Path) -> list[dict]:
    """Entries of `<configs_dir>/manifest.json`: {"name": stem, "args": generate flags}."""
    return json.loads((Path(configs_dir) / "manifest.json").read_text())["configs"]


def regenerate(configs_dir: str | Path = "accelerate_configs") -> list[Path]:
    """Write every manifest entry into `configs_dir` (paths inside the YAMLs are as given: run from the repository
    root with the default). Returns the files written."""
    from hf_dist_recipes.cli.main import main

    written = []
    for entry in manifest(configs_dir):
        argv = ["config", "generate", *entry["args"], "--name", entry["name"], "--output", str(configs_dir)]
        if main(argv) != 0:
            raise ValueError(f"generating {entry['name']} failed")
        written.append(Path(configs_dir) / f"{entry['name']}.yaml")
    return written


if __name__ == "__main__":
    regenerate()
