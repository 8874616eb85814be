"""The warm rank servers the suite's launches use (tests.support.warm_ranks): a rank forked from them must look to
its script and to the elastic agent like the fresh `python -u script.py` torchrun would have started. Each case runs
warm_python.py as torchrun does (`PYTHON_EXEC -u SCRIPT ARGS`, RANK set) on a small probe script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.support import cpu_time
from tests.support.launch import launched_ranks_env
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

PROBE = str(REPO / "tests" / "distributed" / "workers" / "warm_probe_worker.py")


@pytest.fixture
def client(warm_ranks):
    if warm_ranks is None:
        pytest.skip("warm rank servers are off in this session (HF_DIST_RECIPES_WARM_RANKS=0 or no /proc)")
    return warm_ranks.env["PYTHON_EXEC"]


# Ranks 2 and 3, an even and an odd one: the launch counter counts rank 0s, and these probes are not launches.
def _start(client, tmp_path, name, action, rank=2, **env):
    out = tmp_path / f"{name}.json"
    env = dict(launched_ranks_env(os.environ), RANK=str(rank), WARM_PROBE_MARKER=name, **env)
    proc = subprocess.Popen(
        [client, "-u", PROBE, str(out), action], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return proc, out


def _run(client, tmp_path, name, action, rank=2, **env):
    proc, out = _start(client, tmp_path, name, action, rank, **env)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, json.loads(out.read_text()), err.decode()


def test_a_warm_rank_sees_what_a_fresh_one_would(client, tmp_path):
    runs = [("even", 2), ("odd", 3), ("even-again", 2)]  # the last is a second fork of the first one's server
    seen = {}
    for name, rank in runs:
        code, seen[name], _ = _run(client, tmp_path, name, "exit:0", rank=rank)
        assert code == 0
        assert seen[name]["preloaded"], "the stack was not already imported: the rank did not come from a server"
        assert seen[name]["argv"] == [PROBE, str(tmp_path / f"{name}.json"), "exit:0"]
        assert seen[name]["cwd"] == str(tmp_path) and seen[name]["path0"] == os.path.dirname(PROBE)
        assert seen[name]["marker"] == name
    # A fresh process seeds torch's and numpy's generators and Python's string hash from the OS: no two ranks draw
    # alike. Forks of one server would share all three unless the rank draws new seeds.
    for a, b in (("even", "odd"), ("even", "even-again"), ("odd", "even-again")):
        assert seen[a]["torch"] != seen[b]["torch"] and seen[a]["numpy"] != seen[b]["numpy"], (a, b)
        assert seen[a]["pid"] != seen[b]["pid"]
    if "PYTHONHASHSEED" not in os.environ:  # a seed set for the session is every fresh process's seed too
        assert seen["even"]["hash"] != seen["odd"]["hash"]
    # py-cpuinfo's answer, asked once by the server (a new interpreter per ask otherwise): this host's, as fresh.
    import cpuinfo

    fresh = cpuinfo.get_cpu_info()
    assert seen["even"]["cpuinfo"] == {k: fresh.get(k) for k in ("vendor_id_raw", "brand_raw", "flags")}
    assert seen["even"]["cpuinfo"]["flags"], "no CPU flags: the answer was not this host's"
    # transformers' weight conversions, built once by the server: the table this installation builds.
    from tests.support.warm_ranks import weight_conversions

    assert seen["even"]["conversions"] == weight_conversions("deepseek_v3") != []


def test_the_reaper_charges_the_ranks_cpu_time_to_the_test_that_started_it(client, warm_ranks, request, tmp_path):
    """tests.support.cpu_time: a warm rank is no child of the test's process, so its reaper reports what it used."""
    code, _, _ = _run(client, tmp_path, "spin", "spin:0.4")
    assert code == 0
    charged = cpu_time.warm_by_test(warm_ranks.directory).get(request.node.nodeid, 0.0)
    assert 0.4 <= charged < 5, charged  # the spin, plus the rank's own start (well under a second when warm)


@pytest.mark.parametrize(
    ("action", "expected"),
    [("exit:3", 3), ("raise", 1), (f"signal:{int(signal.SIGKILL)}", -signal.SIGKILL)],
    ids=["exit-code", "uncaught-exception", "killed"],
)
def test_the_agent_sees_how_the_rank_ended(client, tmp_path, action, expected):
    code, seen, err = _run(client, tmp_path, "end", action)
    assert seen["preloaded"]
    assert code == expected
    if action == "raise":
        assert "RuntimeError: the probe raised" in err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(path, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or half written
            assert time.monotonic() < deadline, f"{path} never written"
            time.sleep(0.05)


def test_a_signal_to_the_stand_in_reaches_the_rank(client, warm_ranks, tmp_path):
    proc, out = _start(client, tmp_path, "term", "sleep")
    rank_pid = _wait_for(out)["pid"]
    # The rank behind the stand-in, for what cannot be forwarded (test_preflight_cli's SIGSTOP): the probe's own pid.
    assert warm_ranks.rank_behind(proc.pid) == rank_pid != proc.pid
    assert warm_ranks.rank_behind(os.getpid()) is None  # this process stands in for no rank
    proc.send_signal(signal.SIGTERM)  # what the agent sends the other ranks when one fails
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not _alive(rank_pid)


def test_a_killed_stand_in_takes_its_rank_along(client, tmp_path):
    proc, out = _start(client, tmp_path, "kill", "sleep")
    rank_pid = _wait_for(out)["pid"]
    proc.kill()  # SIGKILL cannot be forwarded: the server's reaper sees the connection close
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank_pid)


def test_ranks_that_import_differently_start_fresh(client, tmp_path):
    (tmp_path / "numpy").mkdir()  # another copy of a module the servers imported, first on this rank's path
    (tmp_path / "numpy" / "__init__.py").write_text("")
    cases = {
        "threads": {"OMP_NUM_THREADS": "3"},
        "interpreter-flag": {"PYTHONFAULTHANDLER": "1"},
        # read when torch._inductor is imported, which the servers do (DeepSpeed's Muon optimizer, warm_ranks.py)
        "compile-config": {"TORCHINDUCTOR_COMPILE_THREADS": "3"},
        # datasets.config takes its cache folder at import: a warm fork would write to the servers' one
        "datasets-cache": {"HF_DATASETS_CACHE": str(tmp_path / "datasets")},
        "shadowing-path": {"PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(tmp_path)])},
    }
    for name, env in cases.items():
        code, seen, _ = _run(client, tmp_path, name, "exit:0", **env)
        assert code == 0 and not seen["preloaded"], name
        assert seen["cwd"] == str(tmp_path) and seen["marker"] == name


def test_a_folder_that_cannot_shadow_keeps_the_rank_warm(client, tmp_path):
    # A folder named like an imported package but without __init__.py (accelerate puts the launch's working directory
    # on PYTHONPATH, and tests keep a `deepspeed/` folder of JSON there) is a namespace portion: a fresh interpreter
    # still imports the installed package, so the rank need not start fresh. A file named like a module does shadow.
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "zero3.json").write_text("{}")
    (tmp_path / "numpy.json").write_text("{}")
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(tmp_path)])
    code, seen, _ = _run(client, tmp_path, "namespace-folder", "exit:0", PYTHONPATH=path)
    assert code == 0 and seen["preloaded"], "a folder without __init__.py made the rank start fresh"
    (tmp_path / "torch.py").write_text("")
    code, seen, _ = _run(client, tmp_path, "module-file", "exit:0", PYTHONPATH=path)
    assert code == 0 and not seen["preloaded"], "torch.py first on the rank's path did not make it start fresh"


def test_a_rank_naming_the_accelerator_the_servers_chose_stays_warm(client, tmp_path):
    # `hf-dist-recipes demo` names DeepSpeed's accelerator where there is no CUDA device (DS_ACCELERATOR=cpu): the
    # one the servers' DeepSpeed detected while importing, under the suite's hidden GPUs, so the rank would import
    # the same state. Another name is another import.
    code, seen, _ = _run(client, tmp_path, "same-accelerator", "exit:0", DS_ACCELERATOR="cpu")
    assert code == 0 and seen["preloaded"], "DS_ACCELERATOR=cpu, the servers' own choice, made the rank start fresh"
    code, seen, _ = _run(client, tmp_path, "other-accelerator", "exit:0", DS_ACCELERATOR="cuda")
    assert code == 0 and not seen["preloaded"], "DS_ACCELERATOR=cuda did not make the rank start fresh"


def test_a_commands_own_launcher_is_started_through_the_client_unless_its_environment_is_fresh(client):
    """What `start_launchers_warm` rewrites in a process of the suite: only a launcher module run by this interpreter
    in an environment naming the client (`fresh_env` drops it: a test that looks for the launch's processes in its
    own tree keeps a fresh launcher)."""
    import sys

    from tests.support.launch import fresh_env
    from tests.support.warm_python import warm_launcher_argv

    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "train.py"]
    env = dict(os.environ)
    assert warm_launcher_argv(launch, env) == [client, "-u", *launch[1:]]
    assert warm_launcher_argv(launch, None) == [client, "-u", *launch[1:]]  # this process's environment
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"]
    assert warm_launcher_argv(torchrun, env)[:2] == [client, "-u"]
    assert warm_launcher_argv(launch, fresh_env(env)) == launch
    for other in ([sys.executable, "-m", "pip", "list"], ["/usr/bin/python3", *launch[1:]], "accelerate launch x"):
        assert warm_launcher_argv(other, env) == other
    # And the rewrite is in force in this process: the command line a Popen records is the client's.
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--help"],
        env=launched_ranks_env(os.environ),  # as a command's launch of a CPU config: forked warm
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.args[:2] == [client, "-u"] and proc.returncode == 0 and b"--config_file" in out
