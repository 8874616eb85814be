"""The configs shipped in accelerate_configs/: regenerated from accelerate_configs/manifest.json, and installed with
the package as `hf_dist_recipes/configs/` (in the repository a link to accelerate_configs/).

Each manifest entry holds `config generate` flags; they are read by the same parser and written by the same
function as the command line's (`hf_dist_recipes.planning.generate`), without going through the command line.

The shipped YAMLs name their DeepSpeed JSON relative to the repository root (`accelerate_configs/deepspeed/...`),
which accelerate resolves against the launch directory. `copy_config` writes a YAML whose JSON path is absolute, so
a copy works from any directory; `config_path` is such a copy in a per-user cache directory.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hf_dist_recipes.core.files import write_atomically
from hf_dist_recipes.core.user_values import writable_dir
from hf_dist_recipes.planning.generate import generate_from_args, generate_parser

# How the shipped YAMLs name their JSON and their own launch line (regenerate's output directory).
SHIPPED_PREFIX = "accelerate_configs"


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


def packaged_dir() -> Path:
    """The shipped configs as installed with this package (`hf_dist_recipes/configs`)."""
    root = Path(str(resources.files("hf_dist_recipes"))) / "configs"
    if not (root / "manifest.json").is_file():
        raise ValueError(
            f"the shipped configs are missing from {root}: reinstall hf-dist-recipes (pip install hf-dist-recipes), "
            "or in a checkout restore the hf_dist_recipes/configs link to accelerate_configs/"
        )
    return root


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped config: its name, the `config generate` flags it was made from, and the one-line plan summary
    of its YAML header."""

    name: str
    args: list[str]
    summary: str

    def as_dict(self) -> dict:
        return {"name": self.name, "args": self.args, "summary": self.summary, "generate": self.generate_command}

    @property
    def generate_command(self) -> str:
        import shlex

        return "hf-dist-recipes config generate " + shlex.join(self.args)


def shipped_configs() -> list[ShippedConfig]:
    """Every shipped config, in the manifest's order."""
    root = packaged_dir()
    out = []
    for entry in manifest(root):
        header = (root / f"{entry['name']}.yaml").read_text().splitlines()
        out.append(ShippedConfig(entry["name"], list(entry["args"]), header[1].lstrip("# ") if len(header) > 1 else ""))
    return out


def _shipped(name: str) -> ShippedConfig:
    names = [c.name for c in shipped_configs()]
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if stem not in names:
        raise ValueError(f"no shipped config {name!r}; choose one of: {', '.join(names)} (hf-dist-recipes config list)")
    return next(c for c in shipped_configs() if c.name == stem)


@dataclass(frozen=True)
class CopiedConfig:
    """The files `copy_config` wrote, both absolute."""

    name: str
    yaml_file: Path
    deepspeed_file: Path

    def as_dict(self) -> dict:
        return {"name": self.name, "yaml_file": str(self.yaml_file), "deepspeed_file": str(self.deepspeed_file)}


def copy_config(name: str, output: str | Path, *, flag: str = "--output", example: str = "my_configs") -> CopiedConfig:
    """Write shipped config `name` as `<output>/NAME.yaml` and `<output>/deepspeed/NAME.json`, the YAML naming the
    JSON by its absolute path (launch from any directory). Existing files of that name are replaced. ValueError
    for an unknown name or an output that cannot be written (`flag` names it in the message)."""
    config = _shipped(name)
    out = writable_dir(output, flag, example)
    root = packaged_dir()
    yaml_text = (root / f"{config.name}.yaml").read_text()
    json_text = (root / "deepspeed" / f"{config.name}.json").read_text()
    ds_file = out / "deepspeed" / f"{config.name}.json"
    yaml_file = out / f"{config.name}.yaml"
    shipped_ds = f"{SHIPPED_PREFIX}/deepspeed/{config.name}.json"
    field = f"  deepspeed_config_file: {shipped_ds}\n"
    if field not in yaml_text:  # the generator changed how it writes the field: fail here, not in accelerate
        raise RuntimeError(f"{root / (config.name + '.yaml')} does not name {shipped_ds}: regenerate (make configs)")
    # A JSON string is a YAML double-quoted scalar: any path (spaces, colons, '#') reads back as written.
    path = str(ds_file) if re.fullmatch(r"[\w./+~-]+", str(ds_file)) else json.dumps(str(ds_file))
    yaml_text = yaml_text.replace(field, f"  deepspeed_config_file: {path}\n")
    yaml_text = yaml_text.replace(
        "# Launch from the directory the DeepSpeed path is relative to:\n"
        f"#   accelerate launch --config_file {SHIPPED_PREFIX}/{config.name}.yaml",
        f"# Copied by: hf-dist-recipes config copy {config.name}; the DeepSpeed path is absolute, launch anywhere:\n"
        f"#   accelerate launch --config_file {yaml_file}",
    )
    ds_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(ds_file, json_text)
    write_atomically(yaml_file, yaml_text)
    return CopiedConfig(name=config.name, yaml_file=yaml_file, deepspeed_file=ds_file)


def cache_dir() -> Path:
    """Where `config_path` keeps its copies: `$XDG_CACHE_HOME` (default ~/.cache)/hf-dist-recipes/configs/<version>."""
    from hf_dist_recipes import __version__

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf-dist-recipes" / "configs" / __version__


def config_path(name: str) -> Path:
    """The absolute path of a launchable copy of shipped config `name` (written, or refreshed, in `cache_dir()`):
    `accelerate launch --config_file "$(hf-dist-recipes config path NAME)"` from any directory."""
    return copy_config(name, cache_dir(), flag="XDG_CACHE_HOME", example="$HOME/.cache").yaml_file


if __name__ == "__main__":
    for path in regenerate():
        print(f"wrote {path}")
