"""The host memory a node's ranks may use: MemTotal, or a smaller cgroup limit (v1 and v2 layouts)."""

from pathlib import Path

from hf_dist_recipes.doctor.host_memory import cgroup_limit, host_memory, mem_total

GIB = 2**30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_this_hosts_memtotal_is_what_psutil_reads():
    import psutil

    facts = host_memory()
    assert facts.total == psutil.virtual_memory().total  # two readers of the same kernel figure
    assert facts.usable is not None and facts.usable <= facts.total


def test_meminfo_is_read_in_kib(tmp_path):
    _write(tmp_path / "meminfo", "MemTotal:       24683784 kB\nMemFree:        1 kB\n")
    assert mem_total(tmp_path / "meminfo") == 24683784 * 1024
    assert mem_total(tmp_path / "missing") is None


def test_cgroup_v2_the_tightest_limit_up_the_tree_wins(tmp_path):
    root = tmp_path / "cg"
    job = "system.slice/slurmstepd.scope/job_7/step_0"
    _write(tmp_path / "self", "0::/" + job + "\n")
    _write(root / "system.slice/slurmstepd.scope/job_7/memory.max", str(512 * GIB))  # sbatch --mem=512G
    _write(root / job / "memory.max", "max")
    _write(root / "system.slice/memory.max", str(1024 * GIB))
    limit, where = cgroup_limit(tmp_path / "self", root)
    assert limit == 512 * GIB and where.endswith("job_7")
    # "max" everywhere: no limit
    _write(root / "system.slice/slurmstepd.scope/job_7/memory.max", "max")
    _write(root / "system.slice/memory.max", "max")
    assert cgroup_limit(tmp_path / "self", root) == (None, None)


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    root = tmp_path / "cg"
    _write(tmp_path / "self", "4:memory:/slurm/uid_1/job_9\n3:cpuset:/\n")
    _write(root / "memory/slurm/uid_1/job_9/memory.limit_in_bytes", str(256 * GIB))
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712")  # the kernel's "no limit"
    assert cgroup_limit(tmp_path / "self", root)[0] == 256 * GIB
    _write(root / "memory/slurm/uid_1/job_9/memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_limit(tmp_path / "self", root) == (None, None)
    # Inside a container the named folder does not exist: the mounted root is the container's own cgroup.
    _write(tmp_path / "other", "4:memory:/docker/abc\n")
    _write(root / "memory/memory.limit_in_bytes", str(64 * GIB))
    assert cgroup_limit(tmp_path / "other", root)[0] == 64 * GIB
