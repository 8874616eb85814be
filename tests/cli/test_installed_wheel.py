"""The package as a user installs it, outside the checkout: `python -m build` makes an sdist and a wheel from it
that `twine check` passes; the wheel, installed by pip into a fresh virtual environment in a temporary folder, lists,
copies and names the shipped configs and runs the demo from another directory through the environment's own
`hf-dist-recipes` command, with the checkout out of reach (the package imported is the installed one). pip installs
the wheel with its dependencies from no index, so it can change nothing of the stack: its report says so.

The environment's dependencies are the pinned stack already installed in this checkout's .venv, seen through a .pth
file (its one line: that site-packages folder), instead of torch, DeepSpeed and transformers downloaded again (GBs,
and CI runs offline). A path in a .pth file is added to sys.path but the .pth files inside it are not run, so the
checkout's editable install (a .pth finder in .venv) stays out. pip's resolve, from no index, then proves
that the wheel's declared requirements are met by that stack: one that is not fails the resolve ("No matching
distribution") instead of appearing among what it installs. `make test`, and so .ci/run, runs this file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import yaml

from tests.support.launch import LAUNCH_TIMEOUT_S, cpu_only_env
from tests.support.paths import REPO

SHIPPED = REPO / "accelerate_configs"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel built as `python -m build` builds them (the wheel from the unpacked sdist, so the sdist must
    hold everything), with this venv's setuptools instead of a downloaded one (--no-isolation)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> dict:
    """A fresh virtual environment outside the checkout with the wheel installed by pip (no index, no dependencies
    fetched: the stack comes through a .pth file, see the module docstring); the environment and working directory
    that reach it and not the checkout."""
    venv = tmp_path_factory.mktemp("venv")
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = venv / "bin" / "python"
    (site,) = venv.glob("lib/python3*/site-packages")
    stack = Path(sysconfig.get_paths()["purelib"])  # this checkout's .venv: the pinned dependencies
    (site / "_pinned_stack.pth").write_text(f"{stack}\n")
    (wheel,) = dist.glob("*.whl")
    # With its dependencies, as a user installs it, but from no index: every requirement must be met by the stack as
    # it is. pip's report says what its resolve installed (the test below: the wheel alone); one resolve, not a dry
    # run and then the install (each resolve reads the whole stack's metadata: about 2.5 s of one core).
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    report = venv / "install_report.json"
    # No PYTHONPATH: a checkout on it holds the sdist build's hf_dist_recipes.egg-info, which pip would take for an
    # installed hf-dist-recipes 0.1.0 and so install nothing.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    argv = [*pip, "--quiet", "--report", str(report), str(wheel)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=venv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    env = dict(env, PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", XDG_CACHE_HOME=str(elsewhere / "cache"))
    env = cpu_only_env(dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    return {
        "venv": venv,
        "installed_report": json.loads(report.read_text()),
        "python": python,
        "site": site,
        "cwd": elsewhere,
        "env": env,
        "script": venv / "bin" / "hf-dist-recipes",
    }


def _run(installed, *argv, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(installed["script"]), *argv],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_twine_check_passes_and_the_metadata_says_what_a_user_needs(dist):
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    files = [sdist, wheel]
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)], capture_output=True)
    assert proc.returncode == 0, proc.stdout.decode()[-2000:]
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        meta = Parser().parsestr(whl.read("hf_dist_recipes-0.1.0.dist-info/METADATA").decode())
    assert {"dev", "report", "trl"} <= set(meta.get_all("Provides-Extra"))
    assert "Programming Language :: Python :: 3.11" in meta.get_all("Classifier")
    assert meta["Description-Content-Type"] == "text/markdown" and "hf-dist-recipes" in meta.get_payload()
    # Every shipped file travels with the package, under hf_dist_recipes/configs/.
    shipped = {f"hf_dist_recipes/configs/{p.relative_to(SHIPPED)}" for p in SHIPPED.rglob("*") if p.is_file()}
    assert len(shipped) == 15 and shipped <= names, shipped - names


def test_the_installed_package_is_imported_not_the_checkout(installed):
    # The command is the environment's own: its first line runs the new environment's python.
    assert installed["script"].read_text().splitlines()[0] == f"#!{installed['python']}"
    proc = subprocess.run(
        [str(installed["python"]), "-c", "import hf_dist_recipes; print(hf_dist_recipes.__file__)"],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(installed["site"]), proc.stdout


def test_config_list_copy_and_path_work_without_the_repository(installed, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    proc = _run(installed, "config", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((SHIPPED / "manifest.json").read_text())["configs"]
    assert [c["name"] for c in json.loads(proc.stdout)] == [e["name"] for e in manifest]

    proc = _run(installed, "config", "copy", "cpu_zero3_2proc", "--output", str(tmp_path / "mine"))
    assert proc.returncode == 0, proc.stderr
    copied = tmp_path / "mine" / "cpu_zero3_2proc.yaml"
    proc = _run(installed, "config", "path", "zero3_2nodes_8gpu")
    assert proc.returncode == 0, proc.stderr
    cached = Path(proc.stdout.strip())
    assert cached.is_absolute() and cached.is_relative_to(installed["cwd"] / "cache"), cached
    for yaml_file, name in ((copied, "cpu_zero3_2proc"), (cached, "zero3_2nodes_8gpu")):
        # Read by accelerate's own loader from a third directory: the DeepSpeed path is absolute and holds the
        # shipped JSON byte for byte; everything else in the YAML is the shipped one's.
        monkeypatch.chdir(tmp_path)
        cluster = load_config_from_file(str(yaml_file))
        ds = Path(cluster.deepspeed_config["deepspeed_config_file"])
        assert ds.is_absolute() and ds.read_text() == (SHIPPED / "deepspeed" / f"{name}.json").read_text()
        mine, theirs = yaml.safe_load(yaml_file.read_text()), yaml.safe_load((SHIPPED / f"{name}.yaml").read_text())
        mine["deepspeed_config"].pop("deepspeed_config_file"), theirs["deepspeed_config"].pop("deepspeed_config_file")
        assert mine == theirs


@pytest.mark.distributed
def test_demo_runs_from_another_directory(installed):
    """A short demo (2 CPU processes, ZeRO-3) from the installed wheel: its config is the packaged one, copied
    with an absolute DeepSpeed path, and the ranks import the installed package too."""
    out = installed["cwd"] / "run"
    proc = _run(
        installed,
        *("demo", "--json", "--output-dir", "run", "--max-steps", "4", "--warmup-steps", "1"),
        *("--logging-steps", "1", "--max-bytes", "200000", "--no-save"),
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert Path(result["plan"]["config_file"]).is_relative_to(installed["cwd"] / "cache")
    assert result["plan"]["settings"]["output_dir"] == str(out)
    assert result["summary"]["steps"] == 4 and result["summary"]["ranks"] == 2


def test_installing_the_wheel_changes_nothing_of_the_stack_it_lands_in(installed):
    """Issue 31: the package installs into the stack a team already has (here the development lock: torch 2.13.0,
    transformers 5.25.0, ...): pip's install report lists the wheel alone, and after the install torch and
    transformers are the versions the stack had (read in this interpreter, which the new environment sees)."""
    from importlib.metadata import version

    # The resolve from no index succeeded (the fixture asserts it) and installed the wheel alone: every requirement
    # it declares is met by the stack as it is.
    installed_now = [item["metadata"]["name"] for item in installed["installed_report"]["install"]]
    assert installed_now == ["hf-dist-recipes"], installed_now
    code = "from importlib.metadata import version; print(version('torch'), version('transformers'))"
    proc = subprocess.run(
        [str(installed["python"]), "-c", code],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [version("torch"), version("transformers")]
