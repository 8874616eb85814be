"""Fixtures and pytest hooks only; the helpers tests import live in tests/support/ (`from tests.support.launch
import accelerate_launch`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import cpu_time
from tests.support.launch import launched_ranks_env
from tests.support.launch_count import COUNTER as LAUNCHES
from tests.support.paths import environment_first_on_path

WARM_SERVERS = pytest.StashKey()  # the warm rank servers this process started (the xdist controller's, or its own)
CPU_BY_TEST: dict[str, dict[str, float]] = {}  # tests.support.cpu_time's "own" and "fresh", by node id

# One OpenMP thread in this process and the processes it starts (launched ranks get 1 from accelerate anyway):
# on 2 busy cores two threads spin against each other. A tiny-deepseek-v3 step took 7.7 s with 2 threads and 0.24 s
# with 1 (load 9); test_expert_load's balancer test 92 s against 19 s. A value the user set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: the variable came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Nothing is downloaded (the suite builds models from configs and reads local text), and every process of the session
# knows it, as in .ci/run: the warm rank servers import with these set (tests.support.launch.LAUNCH_ENV), so a launch
# whose environment lacked them started its ranks fresh (10 ranks of a local `make test`, about 5 s of one core each).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# This environment's executables first on PATH, as in an activated environment (tests.support.slurm does the same for
# its jobs). `make test` runs .venv/bin/python without activating, so launches started here found the system's ninja
# (1.11) while the Slurm jobs found the pinned one (1.13): each took the other's
# .ninja_log entries for a changed command and DeepSpeed rebuilt its shm op, ~25 s of both cores, about every other
# launch (seen in .ninja_log: identical compile commands, alternating hashes).
environment_first_on_path()


@pytest.fixture(autouse=True, scope="session")
def no_stale_deepspeed_locks():
    """Fail at once, naming the files, instead of letting every DeepSpeed launch hang on a stale build lock."""
    from hf_dist_recipes.doctor.op_builds import check_no_stale_locks

    try:
        check_no_stale_locks()
    except ValueError as err:
        pytest.exit(str(err), returncode=3)


def _warm_ranks_wanted() -> bool:
    return os.environ.get("HF_DIST_RECIPES_WARM_RANKS") != "0" and LAUNCHES.available()


def pytest_configure(config):
    """pytest-xdist's controller starts the session's one pair of warm rank servers (tests.support.warm_ranks) before
    its workers start, so that they import while the workers collect; every worker attaches to them. The controller
    cannot see which tests the workers will run: a session of unit tests under -n pays two imports in the
    background."""
    controller = getattr(config, "workerinput", None) is None and config.pluginmanager.hasplugin("xdist")
    if controller and config.getoption("numprocesses", None) and _warm_ranks_wanted():
        from tests.support import warm_ranks

        directory = Path(tempfile.mkdtemp(prefix="hf-dist-recipes-warm-"))
        config.stash[WARM_SERVERS] = warm_ranks.WarmServers(directory, launched_ranks_env(os.environ))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    servers = node.config.stash.get(WARM_SERVERS, None)
    if servers is not None:
        node.workerinput["warm_servers"] = servers.handover()


def pytest_unconfigure(config):
    servers = config.stash.get(WARM_SERVERS, None)
    if servers is not None:
        servers.stop()
        shutil.rmtree(servers.directory, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def warm_ranks(request, tmp_path_factory):
    """Ranks forked from interpreters that imported the stack once (tests.support.warm_ranks), for a session that
    launches anything: the controller's servers under xdist, this process's own in a serial run;
    HF_DIST_RECIPES_WARM_RANKS=0 starts every rank fresh instead."""
    from tests.support import warm_ranks
    from tests.support.warm_python import start_launchers_warm

    launching = any(item.get_closest_marker("distributed") for item in request.session.items)
    handed = getattr(request.config, "workerinput", {}).get("warm_servers")
    if not launching or not (handed or _warm_ranks_wanted()):
        yield None
        return
    if handed:
        servers = warm_ranks.WarmServers.attach(handed)
    else:
        servers = warm_ranks.WarmServers(tmp_path_factory.mktemp("warm"), launched_ranks_env(os.environ))
        request.config.stash[WARM_SERVERS] = servers  # counted and stopped at the end, as the controller's are
    LAUNCHES.excluded.update(servers.pids)
    servers.wait_ready()  # about 5 s once; a rank that came before would start fresh
    saved = dict(os.environ)
    os.environ.update(servers.env)
    undo = start_launchers_warm()  # the launchers of commands run in this process (cli_main(["demo", ...]))
    yield servers
    undo()
    os.environ.clear()
    os.environ.update(saved)


def _environment_kept():
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def keep_process_environment():
    """Each test leaves this process's environment as it found it. Creating RecipeTrainingArguments exports what a
    job's later processes need (PYTHONHASHSEED from `seed_everything`, the flight recorder's and NCCL's defaults,
    TORCH_EXTENSIONS_DIR): left behind, they reach every later launch of the same pytest worker, whose ranks then
    see them as the user's own (the process-setup tests found them not applied) and a warm server (one hash seed of
    its own) cannot serve them."""
    yield from _environment_kept()


@pytest.fixture(autouse=True, scope="module")
def keep_module_environment():
    """The same for a test file's module fixtures, which set up before the first test's snapshot and tear down after
    the last: one that trains (test_trainer's `trained`) left PYTHONHASHSEED to every later file of its pytest worker,
    and each of their processes then started fresh instead of warm (seen: 15 of them, about 4.5 s of one core each)."""
    yield from _environment_kept()


@pytest.fixture(autouse=True, scope="session")
def count_launches():
    """Count the session's multi-process launches (tests.support.launch_count), printed in the summary."""
    LAUNCHES.start()
    yield
    LAUNCHES.stop()


def pytest_runtest_logstart(nodeid, location):
    LAUNCHES.current = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU time in this process and in the subprocesses it waited for (tests.support.cpu_time)."""
    own, fresh = cpu_time.usage()
    yield
    own_after, fresh_after = cpu_time.usage()
    CPU_BY_TEST[item.nodeid] = {"own": own_after - own, "fresh": fresh_after - fresh}


def pytest_terminal_summary(terminalreporter):
    from tests.support.warm_ranks import summary_line

    servers = terminalreporter.config.stash.get(WARM_SERVERS, None)
    counts = servers.counts() if servers is not None else None  # every rank, whichever worker launched it
    for line in LAUNCHES.summary_lines() + ([summary_line(counts)] if counts else []):
        terminalreporter.write_line(line)
    warm = cpu_time.warm_by_test(servers.directory) if servers is not None else {}
    if CPU_BY_TEST:
        terminalreporter.write_line(cpu_time.summary_line(cpu_time.by_file(CPU_BY_TEST, warm)))
        if report := os.environ.get(cpu_time.REPORT_ENV):
            Path(report).write_text(json.dumps(cpu_time.by_test(CPU_BY_TEST, warm), indent=1, sort_keys=True))


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its launches go to the controller's summary
        workeroutput["launches_by_test"] = dict(LAUNCHES.by_test)
        workeroutput["cpu_by_test"] = dict(CPU_BY_TEST)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.support.parallel_runs import ByFile

    return ByFile(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    LAUNCHES.by_test.update(output.get("launches_by_test", {}))
    CPU_BY_TEST.update(output.get("cpu_by_test", {}))


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        from tests.support.parallel_runs import launching_first

        launching_first(items)
