"""core.launch: the command lines parse as accelerate and torchrun parse them, the ranks' environment imports this
package, and the deadline, `stop()` and Ctrl-C end the whole process tree, a grandchild in a session of its own
that ignores SIGTERM included (as torch elastic starts each rank). Real processes: tiny `python -c` children."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

import hf_dist_recipes
from hf_dist_recipes.core.launch import Launch, free_port, run_launch, run_process

# The child starts two grandchildren that sleep: one in its own session ignoring SIGTERM (a signal to the child's
# process group does not reach it), one in the child's group; prints their pids, then sleeps.
TREE = r"""
import subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
own = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True, stdout=subprocess.PIPE, text=True)
own.stdout.readline()  # SIGTERM is ignored from here on
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("pids", own.pid, same.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """True once `pid` has ended (a zombie has ended: only its exit status waits for its parent to read it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _assert_gone(pids: list[int]) -> None:
    # SIGKILL has been sent when run_process returns; the kernel may take a moment to end the process. Whatever it
    # takes, a living process after a minute is a process the kill missed.
    for _ in range(600):
        if all(map(_gone, pids)):
            return
        time.sleep(0.1)
    alive = [p for p in pids if not _gone(p)]
    for pid in alive:  # do not leave them to the next test
        psutil.Process(pid).kill()
    pytest.fail(f"processes {alive} of the launch's tree survived it")


def _pids(text: str) -> list[int]:
    line = next((ln for ln in text.splitlines() if ln.startswith("pids ")), None)
    assert line, f"the child never started its grandchildren:\n{text}"
    return [int(x) for x in line.split()[1:]]


def test_accelerate_argv_is_what_accelerate_parses():
    from accelerate.commands.launch import launch_command_parser

    launch = Launch(
        module="hf_dist_recipes.demo.train",
        args=("--max-steps", "2"),
        config_file=Path("cfg.yaml"),
        num_processes=2,
        machine_rank=1,
        main_address="10.0.0.1",
        main_port=12345,
    )
    argv = launch.argv()
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    parsed = launch_command_parser().parse_args(argv[3:])
    assert (parsed.config_file, parsed.num_processes, parsed.machine_rank) == ("cfg.yaml", 2, 1)
    assert (parsed.main_process_ip, parsed.main_process_port) == ("10.0.0.1", 12345)
    assert parsed.module and parsed.training_script == "hf_dist_recipes.demo.train"
    assert parsed.training_script_args == ["--max-steps", "2"]


def test_a_script_launch_leaves_the_configs_values_alone():
    from accelerate.commands.launch import launch_command_parser

    launch = Launch.of(["worker.py", "out", "3"], config_file=Path("cfg.yaml"))
    parsed = launch_command_parser().parse_args(launch.argv()[3:])
    assert not parsed.module and parsed.training_script == "worker.py" and parsed.training_script_args == ["out", "3"]
    # None on the command line: accelerate takes these from the YAML.
    assert (parsed.num_processes, parsed.machine_rank, parsed.main_process_port) == (None, None, None)
    assert Launch.of(["-m", "pkg.mod", "x"], config_file=Path("c.yaml")).program() == ["-m", "pkg.mod", "x"]


def test_torchrun_argv_is_what_torchrun_parses():
    from torch.distributed.run import get_args_parser

    argv = Launch(
        module="hf_dist_recipes.comm.commbench", args=("--iters", "3"), launcher="torchrun", num_processes=4
    ).argv()
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(argv[3:])
    assert (parsed.nproc_per_node, parsed.master_addr) == ("4", "127.0.0.1")
    assert parsed.module and parsed.training_script == "hf_dist_recipes.comm.commbench"
    assert parsed.training_script_args == ["--iters", "3"]
    with socket.socket() as s:  # the port picked was free: nothing listens there
        s.bind(("127.0.0.1", parsed.master_port))


def test_a_free_port_can_be_bound():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


@pytest.mark.parametrize(
    "fields",
    [
        dict(config_file=Path("c.yaml")),
        dict(module="m", script="s.py", config_file=Path("c.yaml")),
        dict(module="m"),
        dict(module="m", launcher="torchrun"),
        dict(module="m", config_file=Path("c.yaml"), timeout_s=0),
    ],
)
def test_an_impossible_launch_is_refused(fields):
    with pytest.raises(ValueError, match=r"e\.g\.|got"):
        Launch(**fields)


def test_child_env_puts_the_package_first_on_pythonpath():
    root = str(Path(hf_dist_recipes.__file__).resolve().parent.parent)
    launch = Launch(
        module="m",
        config_file=Path("c.yaml"),
        env={"HF_HUB_OFFLINE": "1"},
        env_defaults={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        python_path=("/caller/code",),
    )
    env = launch.child_env({"PYTHONPATH": "/user/lib", "OMP_NUM_THREADS": "4"})
    assert [str(Path(p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep)[:1]] == [root]
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/caller/code", "/user/lib"]
    # A default yields to the caller's value; an override does not.
    assert (env["OMP_NUM_THREADS"], env["PYTHONUNBUFFERED"], env["HF_HUB_OFFLINE"]) == ("4", "1", "1")


def test_the_child_imports_the_package_through_pythonpath_alone(tmp_path):
    # -S: no site-packages, so no installed copy or editable finder; only PYTHONPATH can find the package.
    env = Launch(module="m", config_file=Path("c.yaml")).child_env({"PATH": os.environ.get("PATH", "")})
    code = "import hf_dist_recipes, os; print(os.path.dirname(hf_dist_recipes.__file__))"
    result = run_process([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == Path(hf_dist_recipes.__file__).resolve().parent


def test_output_is_captured_apart_merged_relayed_and_logged(tmp_path):
    code = "import sys; print('out 1'); print('err 1', file=sys.stderr); sys.exit(3)"
    apart = run_process([sys.executable, "-c", code], output="capture")
    assert (apart.returncode, apart.stdout, apart.stderr) == (3, "out 1\n", "err 1\n")
    assert not apart.ok and apart.describe() == "ended with exit code 3"
    lines: list[str] = []
    log = tmp_path / "launch.log"
    merged = run_process([sys.executable, "-c", code], output="merged", on_line=lines.append, log_path=log)
    assert sorted(lines) == ["err 1", "out 1"] and log.read_text().splitlines() == lines
    assert merged.stderr == "" and merged.stdout.splitlines() == lines


def test_run_launch_logs_to_the_launchs_output_path(tmp_path):
    log = tmp_path / "log.txt"
    launch = Launch(module="m", config_file=Path("c.yaml"), output=log, cwd=tmp_path)
    with pytest.raises(ValueError, match="log file needs output"):
        run_launch(launch, output="inherit")
    assert not log.exists()


def test_the_deadline_kills_the_whole_tree():
    result = run_process([sys.executable, "-c", TREE], timeout_s=6, kill_grace_s=1)
    assert result.timed_out and not result.stopped and result.returncode != 0
    assert "timeout of 6 s" in result.describe()
    _assert_gone(_pids(result.stdout))


def test_stop_kills_the_whole_tree():
    seen: list[str] = []
    result = run_process(
        [sys.executable, "-c", TREE],
        output="merged",
        on_line=seen.append,
        stop=lambda: any(line.startswith("pids ") for line in seen),
    )
    assert result.stopped and not result.timed_out
    _assert_gone(_pids(result.stdout))


def test_ctrl_c_kills_the_whole_tree_and_is_raised_again():
    seen: list[str] = []

    def interrupt() -> bool:
        if any(line.startswith("pids ") for line in seen):
            raise KeyboardInterrupt  # where a Ctrl-C lands: in the wait
        return False

    with pytest.raises(KeyboardInterrupt):
        run_process([sys.executable, "-c", TREE], output="merged", on_line=seen.append, stop=interrupt, kill_grace_s=1)
    _assert_gone(_pids("\n".join(seen)))
