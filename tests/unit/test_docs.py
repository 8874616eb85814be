"""The docs cannot rot: every fenced block, command and file path of README.md and docs/ is checked (as litgpt's
test_readme.py does), and the pages the site generates at build time (CLI reference, error index) render.

- every block names its language (so each is checked as what it is);
- python: compiles, its imports resolve (each imported name exists), and a block that defines every name it uses
  runs, all such blocks in one process of their own with the GPUs hidden (slow where it imports transformers);
- bash: `hf-dist-recipes ...` (also inside `$(...)`) parses with the real parser, `accelerate launch` with
  accelerate's, `torchrun` with torch's; a config file must ship, or be written by an earlier command of the page;
  `make` targets exist; files given to python / `pip -r` exist; any other program is one of KNOWN_PROGRAMS;
- text blocks that start with `hf-dist-recipes` are synopses: every `--flag` exists on that command;
- yaml/json parse; backticked repository paths exist (here, or in the installed upstream package);
- the troubleshooting page quotes messages that occur in the package's source.

About 590 lines: one checker per kind of block above, each small; they share the page parsing at the top.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import glob
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.launch import launched_ranks_env, python_for
from tests.support.paths import REPO

DOCS = REPO / "docs"
HOOKS = DOCS / "hooks"
LANGUAGES = {"python", "bash", "text", "yaml", "json"}
# Programs a bash block may run besides those checked one by one below (each a real, documented tool).
KNOWN_PROGRAMS = {"sbatch", "srun", "tensorboard", "twine", "cd", "export", "mkdir", "ls", "cat", "rm"}
# Scripts of the user's own (placeholders in the docs), never files of this repository.
USER_SCRIPTS = {"train.py"}
PATH_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".toml", ".ipynb", ".lock", ".txt")
# Backticked paths of other projects' repositories (not installed packages), named as sources.
FOREIGN_PATHS = {
    "examples/pytorch/language-modeling/run_clm.py": "transformers' example script (the repository, not the wheel)",
    "docs/performance.md": "torchtitan's performance table",
}
UPSTREAM = ("deepspeed", "transformers", "torch", "accelerate")


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> dict[str, str]:
    """README.md and every page under docs/ (not the hooks), by path relative to the repository."""
    pages = {"README.md": (REPO / "README.md").read_text()}
    for path in sorted(DOCS.rglob("*.md")):
        if HOOKS not in path.parents:
            pages[str(path.relative_to(REPO))] = path.read_text()
    return pages


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"


def _blocks(page: str, text: str) -> list[Block]:
    found, inside, start, lang, body = [], False, 0, "", []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if not inside:
                inside, start, lang, body = True, number, stripped[3:].strip(), []
            else:
                inside = False
                found.append(Block(page, start, lang, textwrap.dedent("\n".join(body))))
        elif inside:
            body.append(line)
    assert not inside, f"{page}:{start}: a fence is never closed"
    return found


PAGES = _pages()
BLOCKS = [block for page, text in PAGES.items() for block in _blocks(page, text)]


def _of(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


def test_the_pages_and_blocks_are_found():
    # Guards the extraction itself: an empty list would make every test below pass vacuously.
    assert {"README.md", "docs/index.md", "docs/getting-started.md", "docs/troubleshooting.md"} <= set(PAGES)
    assert len(_of("python")) >= 10 and len(_of("bash")) >= 8 and len(_of("text")) >= 15


def test_every_block_names_its_language():
    unnamed = [str(b) for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unnamed, f"blocks without one of {sorted(LANGUAGES)}: {unnamed}"


# ---- python ---------------------------------------------------------------------------------------------------


def _free_names(tree: ast.AST) -> set[str]:
    """Names a snippet reads but never binds (imports, assignments, defs, arguments, comprehensions)."""
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


@pytest.mark.parametrize("block", _of("python"), ids=str)
def test_python_block_compiles_and_its_imports_resolve(block):
    tree = ast.parse(block.body, str(block))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{block}: {node.module} has no {missing}"


# A block that names the user's own files (path/to/...) runs where a test gives it files: the quicktour's script in
# tests/unit/test_quicktour.py.
RUNNABLE = [b for b in _of("python") if not _free_names(ast.parse(b.body)) and "path/to/" not in b.body]


def test_some_python_blocks_are_runnable():
    assert len(RUNNABLE) >= 5, [str(b) for b in RUNNABLE]


@pytest.mark.slow
def test_runnable_python_blocks_run(tmp_path):
    """Every block that defines all it uses, each in its own folder and namespace, in one CPU-only process of its
    own."""
    runner = textwrap.dedent(
        """
        import json, os, sys, traceback
        failures = []
        for i, (name, code) in enumerate(json.load(sys.stdin)):
            os.makedirs(f"block{i}")
            os.chdir(f"block{i}")
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            except BaseException:
                failures.append(name + "\\n" + traceback.format_exc())
            os.chdir("..")
        print("\\n".join(failures))
        sys.exit(1 if failures else 0)
        """
    )
    (tmp_path / "runner.py").write_text(runner)
    # GPUs hidden and the explicit CPU request (a GPU host too), the checkout on PYTHONPATH: a launched rank's
    # environment, so forked warm in a session that launches (tests.support.launch.python_for).
    env = launched_ranks_env(os.environ)
    done = subprocess.run(
        [*python_for(env), str(tmp_path / "runner.py")],
        input=json.dumps([(str(b), b.body) for b in RUNNABLE]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


# ---- bash -----------------------------------------------------------------------------------------------------


def _commands(body: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped, split at && ; |."""
    joined = re.sub(r"\\\n\s*", " ", body)
    commands = []
    for line in joined.splitlines():
        words = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        words.whitespace_split = True
        words.commenters = "#"
        current: list[str] = []
        for word in words:
            if word in {"&&", ";", "|", "||"}:
                commands.append(shlex.join(current))
                current = []
            else:
                current.append(word)
        if current:
            commands.append(shlex.join(current))
    return [c for c in commands if c]


def _cli_parser():
    from hf_dist_recipes.cli.main import build_parser

    return build_parser()


def _module_exists(name: str) -> bool:
    """Whether `python -m name` would find a module, without the lookup's side effects on this process.

    `importlib.util.find_spec("pip")` runs setuptools' distutils finder, whose `spec_for_pip` switches its own
    distutils override off for the rest of the process: a later first `import setuptools` in the same pytest worker
    then fails its assertion (`distutils/core.py` from the standard library). Looking the top-level package up on
    `sys.path` alone runs no meta-path hook.
    """
    top, _, rest = name.partition(".")
    if importlib.machinery.PathFinder.find_spec(top) is None:
        return False
    return not rest or importlib.util.find_spec(name) is not None


def _parse(parser: argparse.ArgumentParser, argv: list[str], where: str):
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:
        raise AssertionError(f"{where}: {shlex.join(argv)} does not parse (exit {stop.code})") from None


def _shipped_names() -> set[str]:
    return {p.stem for p in (REPO / "accelerate_configs").glob("*.yaml")}


class _Page:
    """What the earlier commands of one page wrote (their --output folders), for the later ones to use."""

    def __init__(self, name: str):
        self.name = name
        self.outputs: set[str] = set()

    def made(self, path: str) -> bool:
        return any(path == out or path.startswith(out.rstrip("/") + "/") for out in self.outputs)

    def check(self, command: str, where: str) -> None:
        # $(hf-dist-recipes config path NAME): checked on its own, then it stands for a shipped config's path
        for inner in re.findall(r"\$\(([^)]*)\)", command):
            self.check(inner, where)
        argv = shlex.split(re.sub(r"\$\([^)]*\)", "SUBSTITUTED.yaml", command))
        program, args = argv[0], argv[1:]
        if program == "hf-dist-recipes":
            parsed = _parse(_cli_parser(), args, where)
            if getattr(parsed, "output", None):
                self.outputs.add(parsed.output)
            if args[:2] in (["config", "path"], ["config", "copy"]):
                assert args[2] in _shipped_names(), f"{where}: no shipped config {args[2]}"
        elif program == "accelerate":
            assert args[0] == "launch", f"{where}: accelerate {args[0]}"
            from accelerate.commands.launch import launch_command_parser

            parsed = _parse(launch_command_parser(), args[1:], where)
            config = parsed.config_file
            assert config == "SUBSTITUTED.yaml" or (REPO / config).is_file() or self.made(config), (
                f"{where}: --config_file {config} neither ships nor is written by an earlier command of {self.name}"
            )
            script = parsed.training_script
            assert script in USER_SCRIPTS or (REPO / script).is_file(), f"{where}: no script {script}"
        elif program == "torchrun":
            from torch.distributed.run import get_args_parser

            _parse(get_args_parser(), args, where)
        elif program == "make":
            targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
            assert set(args) <= targets, f"{where}: make {args}: no such target in the Makefile"
        elif re.fullmatch(r"(\.venv/bin/)?python3?", program):
            if args[:1] == ["-m"]:
                assert _module_exists(args[1]), f"{where}: no module {args[1]}"
            else:
                assert (REPO / args[0]).is_file(), f"{where}: no script {args[0]}"
        elif re.fullmatch(r"(\.venv/bin/)?pip3?", program):
            for flag, value in zip(args, args[1:], strict=False):
                if flag in ("-r", "--requirement"):
                    assert (REPO / value).is_file(), f"{where}: no file {value}"
        else:
            assert program in KNOWN_PROGRAMS, f"{where}: {program} is not a program these docs know"


@pytest.mark.parametrize("page", sorted({b.page for b in _of("bash")}))
def test_bash_commands_parse(page):
    state = _Page(page)
    checked = 0
    for block in (b for b in _of("bash") if b.page == page):
        for command in _commands(block.body):
            state.check(command, str(block))
            checked += 1
    assert checked


def test_command_splitting():
    # The splitter itself: continuation lines, comments, && and $(...).
    body = 'a --x 1 \\\n  --y 2   # note\nb && c "$(d e)" # more\n# only a comment'
    assert _commands(body) == ["a --x 1 --y 2", "b", "c '$(d e)'"]


@pytest.mark.parametrize("lookup", ["_module_exists", "importlib.util.find_spec"])
def test_the_module_check_leaves_setuptools_importable(lookup):
    # The twin with importlib's own find_spec shows the failure this check avoids (a pytest worker that read a page
    # with `python -m pip` before its first `import setuptools`).
    code = (
        "import importlib.util, sys; sys.path.insert(0, 'tests/unit'); import test_docs; "
        f"assert {'test_docs.' if lookup == '_module_exists' else ''}{lookup}('pip'); import setuptools"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if lookup == "_module_exists":
        assert run.returncode == 0, run.stderr
        assert _module_exists("hf_dist_recipes.cli") and not _module_exists("no_such_package.cli")
    else:
        assert run.returncode != 0 and "distutils/core.py" in run.stderr, run.stderr


# ---- synopses (text blocks of a command's usage) ---------------------------------------------------------------


def _command_parser(words: list[str]) -> tuple[list[str], argparse.ArgumentParser]:
    parser, path = _cli_parser(), []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser, path = subs[0].choices[word], path + [word]
    return path, parser


SYNOPSES = [b for b in _of("text") if b.body.startswith("hf-dist-recipes ")]


@pytest.mark.parametrize("block", SYNOPSES, ids=str)
def test_synopsis_flags_exist(block):
    current: argparse.ArgumentParser | None = None
    for line in block.body.splitlines():
        if line.startswith("hf-dist-recipes "):
            path, current = _command_parser(line.split()[1:])
            assert path, f"{block}: {line.split()[1]} is not a command"
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?!\w)", line))
        known = {s for a in current._actions for s in a.option_strings}
        assert flags <= known, f"{block}: {sorted(flags - known)} not options of {current.prog}"


# ---- data blocks, paths, links ---------------------------------------------------------------------------------


def test_data_blocks_equal_the_files_they_show():
    """A YAML block headed `# PATH` equals that file; a JSON block after it equals its deepspeed_config_file."""
    shown, checked = None, 0
    for block in BLOCKS:
        if block.lang == "yaml":
            data = yaml.safe_load(block.body)
            path = block.body.splitlines()[0].removeprefix("# ").strip()
            assert (REPO / path).is_file(), f"{block}: a YAML block starts with the path of the file it shows"
            assert data == yaml.safe_load((REPO / path).read_text()), f"{block} differs from {path}"
            shown, checked = (block.page, data["deepspeed_config"]["deepspeed_config_file"]), checked + 1
        elif block.lang == "json":
            assert shown and shown[0] == block.page, f"{block}: a JSON block follows the YAML naming it"
            expected = json.loads((REPO / shown[1]).read_text())
            assert json.loads(block.body) == expected, f"{block} differs from {shown[1]}"
            checked += 1
    assert checked >= 2


def _site_packages() -> Path:
    return Path(importlib.util.find_spec("deepspeed").origin).parents[1]


def _path_exists(path: str) -> bool:
    if (REPO / path).exists() or (REPO / "hf_dist_recipes" / path).exists():
        return True
    site = _site_packages()
    return any((site / package / path).exists() for package in UPSTREAM)


def _backticked_paths(text: str) -> set[str]:
    found = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = re.sub(r"(::\w+|:\d+)$", "", token)
        if "/" in token and token.endswith(PATH_SUFFIXES) and not re.search(r"[<>*{}$]", token):
            if not token.startswith(("/", "~", "DIR/", "dist/")):
                found.add(token)
    return found


@pytest.mark.parametrize("page", sorted(PAGES))
def test_backticked_paths_exist(page):
    missing = sorted(p for p in _backticked_paths(PAGES[page]) - set(FOREIGN_PATHS) if not _path_exists(p))
    assert not missing, f"{page} names paths that exist neither here nor upstream: {missing}"


def test_readme_links_resolve():
    # docs/ links are checked by `mkdocs build --strict`; the README is not part of the site.
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", PAGES["README.md"])
    assert links
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert not missing, missing


def test_layout_names_modules_that_exist():
    """The README's Layout block is the package map newcomers read: every module it names exists in its folder."""
    layout = PAGES["README.md"].split("## Layout", 1)[1]
    block = _blocks("README.md", layout)[0].body
    folder, missing, named = None, [], 0
    for line in block.splitlines()[1:]:
        entry = re.match(r"^  (\w+)(/?)\s", line)
        if entry:
            folder = entry.group(1) if entry.group(2) else None
            if not entry.group(2) and not line.strip().startswith("configs"):
                named += 1
                if not (REPO / "hf_dist_recipes" / f"{entry.group(1)}.py").exists():
                    missing.append(entry.group(1) + ".py")
        if line and not line.startswith(" "):
            folder = None
        if folder:
            for module in re.findall(r"(?<![\w/.])(\w+\.py)\b", line):
                named += 1
                if not list((REPO / "hf_dist_recipes" / folder).rglob(module)):
                    missing.append(f"{folder}/{module}")
    assert named > 40, named
    assert not missing, f"the README's Layout names modules that do not exist: {missing}"


# ---- generated pages, troubleshooting ------------------------------------------------------------------------


def test_cli_reference_covers_every_command():
    cli = _hook("cli_reference")
    page = cli.render()
    paths = [" ".join(path) for path, _ in cli.commands()]
    assert len(paths) > 10
    for path, _ in cli.commands():
        assert "## `" + " ".join(["hf-dist-recipes", *path]) + "`" in page
    assert page.count("```text") == len(paths)
    assert "usage: hf-dist-recipes config generate" in page


def _source_strings() -> list[str]:
    """Every string literal of the package, f-strings with `{...}` for their values, whitespace collapsed."""
    strings = []
    for path in (REPO / "hf_dist_recipes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts = (v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
                strings.append(" ".join("".join(parts).split()))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(" ".join(node.value.split()))
    return strings


def test_troubleshooting_quotes_occur_in_the_source():
    corpus = _source_strings()
    quotes = [
        line.strip()
        for block in _of("text")
        if block.page == "docs/troubleshooting.md"
        for line in block.body.splitlines()
        if line.strip()
    ]
    assert len(quotes) >= 25
    absent = []
    for quote in quotes:
        for piece in (p.strip() for p in quote.split("...")):
            if piece and not any(piece in s for s in corpus):
                absent.append(piece)
    assert not absent, f"quoted in docs/troubleshooting.md but raised nowhere: {absent}"


def test_error_index_lists_every_raise():
    index = _hook("error_index")
    messages = index.messages()
    raises = sum(
        isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
        and getattr(node.exc.func, "id", getattr(node.exc.func, "attr", None)) in index.RAISED
        for path in (REPO / "hf_dist_recipes").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
    )  # fmt: skip
    assert sum(map(len, messages.values())) == raises > 200
    assert "turns gradient clipping off" in index.render()


def test_run_clm_command_is_the_one_the_test_launches():
    """docs/your-script.md shows the command line tests/distributed/test_run_clm.py launches, flag for flag."""
    from accelerate.commands.launch import launch_command_parser

    from tests.distributed.test_run_clm import YAML, _command

    (block,) = [b for b in _of("bash") if "tests/scripts/run_clm.py" in b.body]
    (command,) = [c for c in _commands(block.body) if c.startswith("accelerate launch")]
    parsed = launch_command_parser().parse_args(shlex.split(command)[2:])
    data = {name: Path("/tmp/clm") / file for name, file in [("tokenizer", "tokenizer"), ("train", "train.txt"),
                                                             ("validation", "validation.txt")]}  # fmt: skip
    expected = _command(data, Path("/tmp/clm/run"))
    assert REPO / parsed.config_file == YAML
    assert REPO / parsed.training_script == Path(expected[0])
    assert parsed.training_script_args == expected[1:]


RUN_COMMANDS = {("config", word) for word in ("list", "copy", "path", "estimate", "generate", "validate")}


def _page_commands(page: str) -> list[tuple[Block, str]]:
    """The page's commands in order, each `$(...)` after the command holding it."""
    found = []
    for block in (b for b in _of("bash") if b.page == page):
        for command in _commands(block.body):
            found += [(block, inner) for inner in re.findall(r"\$\(([^)]*)\)", command)] + [(block, command)]
    return found


def _runs(command: str) -> bool:
    argv = shlex.split(command)
    return argv[0] == "hf-dist-recipes" and tuple(argv[1:3]) in RUN_COMMANDS


CONFIG_PAGES = sorted({b.page for b in _of("bash") if any(_runs(c) for _, c in _page_commands(b.page))})


@pytest.mark.slow
@pytest.mark.parametrize("page", CONFIG_PAGES)
def test_config_commands_run(page, tmp_path, monkeypatch, capsys):
    """The page's `hf-dist-recipes config ...` commands run, in page order, in a fresh folder (each writes where the
    next reads: generate, then validate cfg/*.yaml), and exit 0. A command naming a file nobody wrote (a placeholder
    such as NAME) is only parsed (test_bash_commands_parse)."""
    from hf_dist_recipes.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # `config path` writes its copy there
    (tmp_path / "accelerate_configs").symlink_to(REPO / "accelerate_configs")
    ran = []
    for block, command in _page_commands(page):
        if not _runs(command):
            continue
        argv = shlex.split(command)
        args = [a for word in argv[1:] for a in (sorted(glob.glob(word)) if glob.has_magic(word) else [word])]
        if argv[2] == "validate" and not all(Path(a).exists() for a in args[2:] if not a.startswith("-")):
            continue
        assert main(args) == 0, f"{block}: {command}\n{capsys.readouterr().err[-3000:]}"
        ran.append(command)
    assert ran, f"{page}: none of its config commands ran"


def test_pages_with_config_commands_are_found():
    assert {"README.md", "docs/commands/config.md", "docs/getting-started.md"} <= set(CONFIG_PAGES)


def _dotted_exists(name: str) -> bool:
    """hf_dist_recipes.a.b[.Attr[.attr]]: a module (file or package), then names defined in its source."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            source = module.read_text()
            return all(re.search(rf"^\s*(def|class)\s+{a}\b|^\s*{a}\s*[:=]", source, re.M) for a in parts[cut:])
    return False


@pytest.mark.parametrize("page", sorted(PAGES))
def test_dotted_names_exist(page):
    names = {n for n in re.findall(r"`(hf_dist_recipes(?:\.\w+)+)", PAGES[page]) if not n.endswith("__")}
    missing = sorted(n for n in names if not _dotted_exists(n))
    assert not missing, f"{page} names modules or attributes that do not exist: {missing}"


def test_dotted_name_check():
    assert _dotted_exists("hf_dist_recipes.planning.plan.ParallelPlan")
    assert _dotted_exists("hf_dist_recipes.core.findings")
    assert not _dotted_exists("hf_dist_recipes.planning.plan.NoSuchPlan")
    assert not _dotted_exists("hf_dist_recipes.no_such_module")
