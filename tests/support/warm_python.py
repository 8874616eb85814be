"""The interpreter torchrun starts for each rank in the suite (`PYTHON_EXEC`, see tests.support.warm_ranks): it asks
a warm server to fork the rank and stands in for it towards the elastic agent, or, when it cannot, becomes a fresh
`python` itself (exec). Standard library only: it starts in about 30 ms.

Called as torchrun calls an interpreter: `warm_python -u SCRIPT ARGS...` (or `-u -m MODULE ARGS...`);
`warm_ranks.WarmServers` writes it as an executable file with this interpreter in its first line."""

import json
import os
import signal
import socket
import struct
import sys
from importlib.machinery import all_suffixes

SOCKETS = "HF_DIST_RECIPES_WARM_SOCKETS"  # the servers' socket paths, os.pathsep-separated
PYTHON = "HF_DIST_RECIPES_WARM_PYTHON"  # the real interpreter, for the fallback
SERVER_ENV = "HF_DIST_RECIPES_WARM_ENV"  # JSON: the servers' import-time variables and their PYTHONPATH
LOG = "HF_DIST_RECIPES_WARM_LOG"  # a line per rank: "warm SCRIPT" or "fresh WHY SCRIPT"
# Variables an import may read once (interpreter flags, thread pools, device visibility, offline mode): a rank
# that sets any of them differently from the servers gets a fresh interpreter (and those of IMPORT_TIME_PREFIXES).
IMPORT_TIME_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "DS_ACCELERATOR",
    "HF_DATASETS_CACHE",  # datasets.config and huggingface_hub.constants read their cache folders at import
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
    "TRANSFORMERS_OFFLINE",
)
# Families of such variables, by prefix: PYTHON* (interpreter flags), and torch.compile's configs, which
# torch._dynamo and torch._inductor read at import (the servers import them with DeepSpeed's Muon optimizer).
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_")
# Read when used, not at import: PYTHON_EXEC and PYTHONPATH (`_shadowing`), and inductor's cache folder, which torch
# 2.13 `torch._inductor.runtime.cache_dir_utils.cache_dir()` also writes into the environment of the process that
# asks (a pytest process that did hands it to every later launch).
NOT_IMPORT_TIME = ("PYTHON_EXEC", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def import_time_env(env) -> dict:
    """The variables of `env` an import may have read. PYTHONPATH is left to `_shadowing` (accelerate appends the
    working directory to it, so it differs from the servers' in most launches)."""
    return {
        k: v
        for k, v in env.items()
        if k in IMPORT_TIME_ENV or (k.startswith(IMPORT_TIME_PREFIXES) and k not in NOT_IMPORT_TIME)
    }


def _shadowing(rank_path, server_path, modules_file):
    """Entries of the rank's PYTHONPATH the servers lack that hold a module the servers imported: the rank must then
    import its own copy, fresh. Unknown (servers not ready) counts as shadowing."""
    extra = [e for e in rank_path.split(os.pathsep) if e and e not in server_path.split(os.pathsep)]
    if not extra:
        return []
    try:
        with open(modules_file) as f:
            imported = set(f.read().split())
    except OSError:
        return extra
    found = []
    for entry in extra:
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        if any(_module_name(entry, name) in imported for name in names):
            found.append(entry)
    return found


def _module_name(entry, name):
    """The top-level module a fresh interpreter could import from `entry/name`, or None. Only a regular package
    (`name/__init__.py`, `.pyc`, an extension) or a module file shadows the installation's copy. A folder without
    `__init__` (a test's `deepspeed/` folder of JSON files, say) is a namespace portion (PEP 420): the import goes on
    along sys.path to the regular package, and a namespace package the servers imported recomputes its portions from
    the rank's sys.path on next use, as a fresh one would find them."""
    full = os.path.join(entry, name)
    if os.path.isdir(full):
        return name if any(os.path.isfile(os.path.join(full, "__init__" + s)) for s in all_suffixes()) else None
    return next((name[: -len(s)] for s in all_suffixes() if name.endswith(s)), None)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _note(line):
    path = os.environ.get(LOG)
    if path:
        with open(path, "a") as log:
            log.write(line + "\n")


def _fresh(argv, why):
    _note(f"fresh {why} {argv[2] if argv[1:2] == ['-m'] and len(argv) > 2 else ' '.join(argv[1:2])}")
    python = os.environ.get(PYTHON, "python3")
    os.execv(python, [python, *argv])


LAUNCHERS = ("accelerate.commands.launch", "torch.distributed.run")


def warm_launcher_argv(args, env):
    """`args` for a launcher a process of the suite starts itself: `[sys.executable, "-m", LAUNCHER, ...]` (what
    hf_dist_recipes.core.launch builds for `preflight`, `demo`, `calibrate`, `commbench`) becomes the warm client's
    `[PYTHON_EXEC, "-u", "-m", LAUNCHER, ...]` when the environment it starts in (`env`, else this process's) names
    the client; anything else is left as it is. `-u`: a warm fork keeps the servers' unbuffered streams."""
    client = (os.environ if env is None else env).get("PYTHON_EXEC")
    if client and isinstance(args, (list, tuple)) and len(args) > 2:
        if args[0] == sys.executable and args[1] == "-m" and args[2] in LAUNCHERS:
            return [client, "-u", *args[1:]]
    return args


def start_launchers_warm():
    """From now on, this process starts the launchers of its commands forked warm (`warm_launcher_argv`), as the
    tests' own launches start theirs (tests.support.launch): an `accelerate launch` imports torch and DeepSpeed, about
    4 s of one core fresh. Returns the undo. The package's command line is unchanged: the process starts
    `sys.executable`; the suite, not the package, picks the interpreter, as torchrun's PYTHON_EXEC does for a rank."""
    import subprocess

    original = subprocess.Popen

    class Popen(original):
        def __init__(self, args, *rest, **kwargs):
            super().__init__(warm_launcher_argv(args, kwargs.get("env")), *rest, **kwargs)

    subprocess.Popen = Popen

    def undo():
        subprocess.Popen = original

    return undo


def main(argv):
    paths = os.environ.get(SOCKETS, "").split(os.pathsep)
    if not paths[0]:
        _fresh(argv, "no-server")
    script_call = len(argv) >= 2 and argv[0] == "-u" and not argv[1].startswith("-")
    module_call = len(argv) >= 3 and argv[:2] == ["-u", "-m"]
    if not (script_call or module_call):
        _fresh(argv, "not-a-script-call")
    expected = json.loads(os.environ.get(SERVER_ENV) or "{}")
    server_pythonpath = expected.pop("PYTHONPATH", "")
    rank = int(os.environ.get("RANK", "0") or 0)
    path = paths[rank % len(paths)]
    asked = import_time_env(os.environ)
    if "DS_ACCELERATOR" not in expected and asked.get("DS_ACCELERATOR") == _read(path + ".accelerator"):
        del asked["DS_ACCELERATOR"]  # it names the accelerator the servers' DeepSpeed chose (`make demo`: "cpu")
    differing = sorted(set(asked.items()) ^ set(expected.items()))
    if differing:
        _fresh(argv, "env:" + ",".join(sorted({k for k, _ in differing})))
    if _shadowing(os.environ.get("PYTHONPATH", ""), server_pythonpath, path + ".modules"):
        _fresh(argv, "pythonpath-shadows")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        _fresh(argv, "server-not-ready")
    _note(f"warm {argv[1] if script_call else argv[2]}")
    request = json.dumps({"argv": argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
    conn.sendall(request)

    def forward(number, _frame):
        try:
            conn.sendall(b"%d " % number)
        except OSError:
            pass

    for number in FORWARDED:
        signal.signal(number, forward)
    reply = b""
    while not reply.endswith(b"\n"):
        try:
            chunk = conn.recv(256)
        except InterruptedError:
            continue
        if not chunk:
            sys.exit(1)  # the server went away without a word: the rank's fate is unknown
        reply += chunk
    outcome = json.loads(reply)
    if "signal" in outcome:  # end the way the rank ended, so the agent reports the same signal
        if outcome["signal"] not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(outcome["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), outcome["signal"])
    sys.exit(outcome.get("code", 1))


if __name__ == "__main__":
    main(sys.argv[1:])
