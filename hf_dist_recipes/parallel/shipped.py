"""The configs shipped in accelerate_configs/: regenerated from accelerate_configs/manifest.json.

Each manifest entry holds `config generate` flags; they are read by the same parser and written by the same
function as the command line's (`hf_dist_recipes.parallel.generate`), without going through the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_dist_recipes.parallel.generate import generate_from_args, generate_parser


def manifest(configs_dir: str | Path) -> list[dict]:
    """Entries of `<configs_dir>/manifest.json`: {"name": stem, "args": generate flags}."""
    return json.loads((Path(configs_dir) / "manifest.json").read_text())["configs"]


def regenerate(configs_dir: str | Path = "accelerate_configs") -> list[Path]:
    """Write every manifest entry into `configs_dir` (paths inside the YAMLs are as given: run from the repository
    root with the default). Returns the files written."""
    parser = generate_parser()
    written = []
    for entry in manifest(configs_dir):
        # The YAML header records these as the `config generate` command line that writes the same files.
        argv = [*entry["args"], "--name", entry["name"], "--output", str(configs_dir)]
        written.append(generate_from_args(parser.parse_args(argv), argv).yaml_file)
    return written


if __name__ == "__main__":
    for path in regenerate():
        print(f"wrote {path}")
