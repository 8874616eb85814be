"""DeepSpeed's JIT-built ops: built once per node in a node-local folder, which each rank sets before DeepSpeed starts.

DeepSpeed builds its ops (cpu_adam under optimizer offload, deepspeed_shm_comm on CPU, fused_adam, ...) when they
are first used: `OpBuilder.jit_load` (deepspeed/ops/op_builder/builder.py) calls `torch.utils.cpp_extension.load`,
whose `_get_build_directory` puts each op in `$TORCH_EXTENSIONS_DIR/<op>`, by default
`~/.cache/torch_extensions/py311_<cu130|cpu>/<op>`, and whose `_jit_compile` lets one process build behind
`<op>/lock` (torch/utils/file_baton.py `FileBaton`: O_CREAT|O_EXCL, the others poll until the file is gone).
On a cluster the home folder is a network filesystem that every node shares, so by default:
- every rank of every node builds into one folder behind one lock, over the network;
- nodes share binaries that are not theirs: cpu_adam is compiled with `-march=native` (builder.py `cpu_arch`)
  and CUDA ops for the GPUs of the building node, so a node with another CPU or GPU loads code it cannot run, and
  a node whose build flags differ rewrites build.ninja and relinks the .so under the others;
- a node killed mid-build leaves the lock, and every rank of every node then waits on it forever, with no
  message and no CPU use (verified-on-cpu.md; transformers issue 26015).
`use_node_local_extensions_dir` (called by `RecipeTrainingArguments` before DeepSpeed starts) therefore points
`TORCH_EXTENSIONS_DIR`, when the user has not set it, at `<$TMPDIR or /tmp>/torch_extensions-<user>/<build key>`:
on the node's own disk, per user (mode 0700: nobody else can plant a library there), per Python, torch and CUDA
version (incompatible builds never mix). The local ranks of one node still share it, and torch's lock makes one
of them build while the others wait, so each node builds each op once; a node-local /tmp also survives jobs, so
later jobs on the node reuse the build. An explicit `TORCH_EXTENSIONS_DIR` is always kept.

What outside a job checks on these builds (a stale lock, the ninja they build with: `doctor`, and the demo before
it launches) is `doctor/op_builds.py`; the comment a generated launch config carries about them,
`planning.generate.launch_header_lines`.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import stat
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "TORCH_EXTENSIONS_DIR"
MOUNTS = "/proc/self/mounts"
# Filesystems shared between nodes (types as /proc/self/mounts names them): never a node-local build folder.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "fuse.ceph-fuse",
        "afs",
        "panfs",
        "wekafs",
        "9p",
        "virtiofs",
    }
)


def build_key() -> str:
    """Folder name that changes with everything a built op depends on: e.g. "py311_cu130_torch2.13.0"."""
    import torch  # here, not at the top: the CLI imports this module, and doctor/pin must start without torch

    if torch.version.hip:
        accel = f"rocm{torch.version.hip}"
    elif torch.version.cuda:
        accel = f"cu{torch.version.cuda}"
    else:
        accel = "cpu"
    accel = accel.replace(".", "")
    base, _, local = torch.__version__.partition("+")
    version = base if local in ("", accel) else f"{base}_{local}"  # keep a local tag that is not the CUDA one
    key = f"py{sys.version_info.major}{sys.version_info.minor}_{accel}_torch{version}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry nor USER/LOGNAME
        return str(os.getuid())


def _mount(path: Path) -> tuple[str, set[str]] | None:
    """(filesystem type, mount options) of the mount holding `path`; None where /proc/self/mounts is unreadable."""
    try:
        lines = Path(MOUNTS).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str, set[str]] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fields[2], set(fields[3].split(",")))
    return None if best is None else (best[1], best[2])


def node_local_base(environ: dict | None = None) -> Path | None:
    """The node's own temporary folder: $TMPDIR, else /tmp; the first that exists on a local filesystem that may
    hold programs (not noexec: torch loads the built .so from there). None when neither is."""
    env = os.environ if environ is None else environ
    for candidate in (env.get("TMPDIR"), "/tmp"):
        if not candidate or not os.path.isdir(candidate):
            continue
        mount = _mount(Path(candidate))
        if mount is None or (mount[0] not in NETWORK_FILESYSTEMS and "noexec" not in mount[1]):
            return Path(candidate)
    return None


def node_local_extensions_dir(environ: dict | None = None) -> Path | None:
    """Where this node builds DeepSpeed's ops by default: `<$TMPDIR or /tmp>/torch_extensions-<user>/<build key>`
    (`build_key()`); None when the node has no local temporary folder that may hold programs."""
    base = node_local_base(environ)
    return None if base is None else base / f"torch_extensions-{_user()}" / build_key()


def _private_dir(path: Path) -> None:
    """Create `path` (mode 0700) or check that an existing one is ours alone: a library another user could write
    there would be loaded into the training processes."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # judged below, a link included
        info = os.lstat(path)
    except OSError as err:
        raise ValueError(
            f"cannot create the DeepSpeed ops folder {path} ({err}); set {ENV} to a folder of yours on a local disk"
        ) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ValueError(
            f"{path} is not a folder of this user alone (a link, another owner, or writable by "
            f"others), so DeepSpeed's ops will not be built there: remove it, or set {ENV} to a folder "
            "of yours on a local disk"
        )


def use_node_local_extensions_dir(environ: dict | None = None) -> Path | None:
    """Point `TORCH_EXTENSIONS_DIR` at `node_local_extensions_dir()` unless it is set (then it is kept and
    returned). Returns the folder ops now build in; None (and torch's default stays) when the node has no
    suitable local folder. Must run before DeepSpeed builds or loads an op: torch reads the variable then."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        return Path(env[ENV])
    target = node_local_extensions_dir(env)
    if target is None:
        logger.warning(
            "no local, executable temporary folder ($TMPDIR, /tmp): DeepSpeed's ops build in torch's "
            "default folder under the home directory; set %s to a local disk",
            ENV,
        )
        return None
    _private_dir(target.parent)
    env[ENV] = str(target)
    return target
