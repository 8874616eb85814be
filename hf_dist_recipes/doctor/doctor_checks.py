"""The doctor's checks of the facts (`probe()`), each judging one thing that can break distributed training ok /
warning / error, with the fix and the source of the rule. `FACT_CHECKS`, in order:
- `versions`: the stack's versions (warning when one of deepspeed, transformers, accelerate, datasets is missing);
- `torch sees the GPUs`: cuda_host.check_torch_sees_gpus's verdict, taken during the probe (error when the host
  has NVIDIA GPUs and torch sees none, with cuda_host's reason and fix);
- `driver`: the NVIDIA driver is at least the floor of torch's build CUDA (cuda_host.MIN_DRIVER_BY_CUDA_MAJOR,
  NVIDIA's minor-version compatibility) and runs its CUDA major (error otherwise);
- `nccl`: the NCCL torch was compiled against and the one loaded (else installed) are the same (warning
  otherwise: NVIDIA/nccl 1212, pytorch 122571); a single nvidia-nccl-* distribution is installed and the libnccl
  loaded is its file, not one found through LD_LIBRARY_PATH (pytorch 119072);
- `infiniband`: an InfiniBand/RoCE port is ACTIVE (ok "not present" without any; warning when every port is down,
  NCCL then falls back to TCP sockets);
- `nccl network`: the InfiniBand/RoCE ports and the IP interfaces NCCL would use, by NCCL's documented selection
  rules (`nccl_net.py`); a warning naming the NCCL_IB_HCA / NCCL_SOCKET_IFNAME values that pin the choice
  when it is ambiguous (several interfaces qualify, ports on two fabrics, a filter that is a prefix of more names) or
  an NCCL_IB_HCA matches no port; an error when NCCL_SOCKET_IFNAME matches no interface (NCCL stops at init);
- `peer access`: with 2 or more GPUs, every pair can access each other (warning otherwise: NVIDIA/nccl 631);
- `/dev/shm`: at least 512 MiB (DeepSpeed's ds_report threshold; NCCL's shared-memory transport lives there);
- `debug variables`: NCCL_DEBUG=INFO/TRACE or TORCH_DISTRIBUTED_DEBUG=DETAIL left set (warning: NVIDIA's NCCL
  docs, slower and floods the logs);
- `declared minimums`: the versions the installed packages declare they need (error);
- `build locks`: a stale DeepSpeed JIT build lock (error: every later run hangs on it; `op_builds.stale_locks`);
- `ninja`: the ninja DeepSpeed's op builds run (first on PATH) is the environment's own, or at least its version
  (warning otherwise: jobs with and without the environment activated rebuild every op; `op_builds.ninjas`), and
  one exists when DeepSpeed is installed (warning: an op build stops with "Ninja is required").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hf_dist_recipes.core.findings import Finding
from hf_dist_recipes.core.sizes import MIB, format_size
from hf_dist_recipes.doctor.facts import EnvironmentFacts
from hf_dist_recipes.doctor.probe_gpus import NVML_INSTALL_HINT
from hf_dist_recipes.environment import cuda_host

SHM_MIN_BYTES = 512 * MIB  # deepspeed/env_report.py get_shm_size: below this ds_report warns
STACK = ("deepspeed", "transformers", "accelerate", "datasets")

# (package, its versions, needs package, needs versions, source): version-facts.md "Declared minimums", from the
# packages' own metadata. A needed package that is absent is the `versions` check's business, not this one's.
DECLARED_MINIMUMS: tuple[tuple[str, str, str, str, str], ...] = (
    ("transformers", ">=5,<6", "accelerate", ">=1.1.0", "transformers 5.x package metadata (extras)"),
    ("transformers", ">=5,<6", "deepspeed", ">=0.9.3", "transformers 5.x package metadata (extras)"),
    ("transformers", ">=5.25", "torch", ">=2.6", "transformers 5.25 package metadata"),
    ("transformers", ">=5.25", "python", ">=3.11", "transformers 5.25 package metadata (Requires-Python)"),
    ("accelerate", ">=1.16", "torch", ">=2.6", "accelerate 1.16 package metadata"),
    ("accelerate", ">=1.16", "python", ">=3.11", "accelerate 1.16 package metadata (Requires-Python)"),
    ("deepspeed", ">=0.19.8", "torch", ">=2.0", "deepspeed 0.19.8 package metadata"),
)


@dataclass(frozen=True)
class Check(Finding):
    """One line of the doctor's table (a `core.findings.Finding`). `fix`: what to do (empty when ok); `source`:
    where the rule behind the check comes from (release notes, issue numbers, a module)."""

    source: str = ""


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _major(text: str | None) -> int | None:
    v = _version(text)
    return v.major if v else None


def check_versions(facts: EnvironmentFacts) -> Check:
    rf = facts.rule_facts()
    torch_text = facts.torch.version + (f" (CUDA {rf['cuda']})" if rf["cuda"] else " (CPU build)")
    shown = [f"python {rf['python']}", f"torch {torch_text}"] + [f"{p} {rf[p] or 'missing'}" for p in STACK]
    if rf["nccl"]:
        shown.append(f"nccl {rf['nccl']}")
    if rf["driver"]:
        shown.append(f"driver {rf['driver']}" + (f" (CUDA {rf['driver_cuda']})" if rf["driver_cuda"] else ""))
    missing = [p for p in STACK if not rf[p]]
    if missing:
        return Check(
            "versions",
            "warning",
            ", ".join(shown) + f"; not installed: {', '.join(missing)}",
            f"pip install {' '.join(missing)} at the versions requirements.lock pins (or: pip install hf-dist-recipes)",
            "pyproject.toml dependencies",
        )
    return Check("versions", "ok", ", ".join(shown), source="importlib.metadata, torch.version")


def check_torch_sees_gpus(facts: EnvironmentFacts) -> Check:
    source = "hf_dist_recipes.environment.cuda_host.check_torch_sees_gpus"
    if facts.torch.gpu_problem:
        detail, _, fix = facts.torch.gpu_problem.partition(" Fix: ")
        return Check("torch sees the GPUs", "error", detail, fix or "see the detail", source)
    if facts.torch.device_count:
        names = sorted({g.name for g in facts.gpus})
        return Check(
            "torch sees the GPUs", "ok", f"{facts.torch.device_count} GPU(s): {', '.join(names)}", source=source
        )
    return Check("torch sees the GPUs", "ok", "no NVIDIA GPU on this host: training runs on the CPU", source=source)


def check_driver(facts: EnvironmentFacts) -> Check:
    name, source = "driver", "NVIDIA CUDA Compatibility guide (minor-version compatibility); cuda_host.py"
    build, driver = facts.torch.cuda, facts.driver.version
    if build is None:
        seen = f"driver {driver}" if driver else "no NVIDIA driver"
        return Check(name, "ok", f"{seen}; torch is a CPU build, it needs none", source=source)
    if driver is None:
        if not facts.gpus and not facts.nvidia_host.gpu_count:
            return Check(name, "ok", f"no NVIDIA driver and no GPU; torch's CUDA {build} is unused", source=source)
        return Check(
            name,
            "warning",
            f"the driver version could not be read ({facts.driver.nvml_unavailable})",
            f"{NVML_INSTALL_HINT}, or put nvidia-smi on PATH",
            source,
        )
    floor = cuda_host.min_driver_for_cuda(build)
    if floor is None:
        return Check(name, "ok", f"driver {driver}; no known floor for torch's CUDA {build}", source=source)
    too_old = floor is not None and _version(driver) is not None and _version(driver) < Version(floor)
    runs = facts.driver.cuda
    major_short = runs is not None and _major(runs) is not None and _major(runs) < _major(build)
    if too_old or major_short:
        why = f"driver {driver}" + (f" runs CUDA <= {runs}" if runs else "")
        return Check(
            name,
            "error",
            f"{why}, torch's build CUDA {build} needs driver >= {floor}",
            f"upgrade the driver to >= {floor}, or install the torch build for the CUDA this driver runs "
            "(hf-dist-recipes pin --cuda <that CUDA>)",
            source,
        )
    return Check(
        name,
        "ok",
        f"driver {driver}" + (f" (CUDA {runs})" if runs else "") + f" >= {floor} needed by torch's CUDA {build}",
        source=source,
    )


def check_nccl(facts: EnvironmentFacts) -> Check:
    nccl, source = facts.nccl, "NVIDIA/nccl 1212; pytorch 122571, 119072"
    if nccl.compiled is None and nccl.installed is None and nccl.loaded_path is None:
        return Check("nccl", "ok", "no NCCL (torch without CUDA: Gloo only)", source=source)
    if nccl.others:
        return Check(
            "nccl",
            "warning",
            f"several NCCL distributions installed: {nccl.installed_from} "
            f"{nccl.installed} and {', '.join(nccl.others)}; torch may load the wrong libnccl",
            f"pip uninstall {' '.join(o.split('==')[0] for o in nccl.others)}, keeping the one torch pins",
            source,
        )
    dist = (nccl.installed_from or "nvidia-nccl").split()[0]
    if nccl.loaded_path and nccl.installed_from and f"{os.sep}nvidia{os.sep}" not in nccl.loaded_path:
        return Check(
            "nccl",
            "warning",
            f"torch loaded {nccl.loaded_path} (NCCL {nccl.loaded or 'unknown'}), not the "
            f"library of {dist} {nccl.installed}",
            f"remove {os.path.dirname(nccl.loaded_path)} from "
            "LD_LIBRARY_PATH (or uninstall that libnccl) so torch loads the NCCL it pins",
            source,
        )
    effective, what = (nccl.loaded, "loaded") if nccl.loaded else (nccl.installed, "installed")
    if nccl.compiled and effective and _version(nccl.compiled) != _version(effective):
        return Check(
            "nccl",
            "warning",
            f"torch was compiled against NCCL {nccl.compiled} but NCCL {effective} is "
            f"{what}" + (f" ({dist})" if nccl.installed_from else ""),
            f"pip install {dist}=={nccl.compiled} (the version torch pins); NCCL_DEBUG=VERSION prints the "
            "NCCL actually loaded",
            source,
        )
    where = f" ({nccl.installed_from})" if nccl.installed_from else ""
    return Check(
        "nccl",
        "ok",
        f"NCCL {nccl.loaded or nccl.installed or nccl.compiled}{where}, compiled {nccl.compiled or 'unknown'}",
        source=source,
    )


def check_infiniband(facts: EnvironmentFacts) -> Check:
    source = "NCCL uses verbs ports whose state is ACTIVE (version-facts.md 'Reading the facts at run time')"
    ports = facts.ib_ports
    if not ports:
        return Check(
            "infiniband", "ok", "not present: fine on a single node; across nodes NCCL uses TCP sockets", source=source
        )
    listed = ", ".join(f"{p.device}/{p.port} {p.state} ({p.link_layer or '?'})" for p in ports)
    if not any(p.active for p in ports):
        return Check(
            "infiniband",
            "warning",
            f"no port ACTIVE: {listed}; NCCL falls back to TCP sockets between nodes",
            "bring a port up (cable, subnet manager; `ibstat` shows the state), or "
            "set NCCL_IB_DISABLE=1 to use sockets knowingly",
            source,
        )
    return Check("infiniband", "ok", f"usable: {listed}", source=source)


def check_nccl_network(facts: EnvironmentFacts) -> Check:
    """Which HCA ports and IP interfaces NCCL would use (`nccl_net`, NCCL's documented rules) and, when
    that choice is ambiguous, the NCCL_IB_HCA / NCCL_SOCKET_IFNAME values that pin it."""
    from hf_dist_recipes.doctor.nccl_net import nccl_net_choice

    source = (
        "NCCL user guide, Environment Variables: NCCL_SOCKET_IFNAME, NCCL_IB_HCA "
        "(docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html); NCCL src/misc/socket.cc ncclFindInterfaces"
    )
    choice = nccl_net_choice(facts.ib_ports, facts.net_interfaces, facts.env)
    ports = ", ".join(f"{p} ({layer})" for p, layer in zip(choice.hca_ports, choice.hca_link_layers, strict=True))
    detail = (
        f"HCA ports: {ports or 'none (TCP sockets between nodes)'} [{choice.hca_rule}]; IP interfaces: "
        f"{', '.join(choice.sockets) or 'none'} [{choice.socket_rule}]"
    )
    pin = "; ".join(f"export {name}={value}" for name, value in choice.pins.items())
    if choice.failures:
        fix = "set NCCL_SOCKET_IFNAME to an interface that is up (`ip -br link`), or unset it"
        return Check("nccl network", "error", f"{detail}; {'; '.join(choice.failures)}", fix, source)
    if choice.ambiguities or choice.problems:
        found = "; ".join((*choice.problems, *choice.ambiguities))
        fix = (
            f"pin NCCL's choice, the same on every node: {pin}" if pin else "fix NCCL_IB_HCA (`ibstat` lists the ports)"
        )
        return Check("nccl network", "warning", f"{detail}; across nodes: {found}", fix, source)
    return Check("nccl network", "ok", detail, source=source)


def check_peer_access(facts: EnvironmentFacts) -> Check:
    source = "torch.cuda.can_device_access_peer; NVIDIA/nccl 631, 2079; nccl-tests 117"
    if not facts.peer_access:
        return Check(
            "peer access", "ok", f"not applicable: {facts.torch.device_count} GPU(s) visible to torch", source=source
        )
    nvlink = facts.nvlink()
    links = {
        True: "NVLink active",
        False: "no NVLink",
        None: "NVLink unknown (NVML unavailable, or its GPUs not matched to torch's)",
    }[nvlink]
    denied = [(i, j) for i, j, can in facts.peer_access if not can]
    if denied:
        shown = ", ".join(f"{i}->{j}" for i, j in denied[:8]) + (", ..." if len(denied) > 8 else "")
        return Check(
            "peer access",
            "warning",
            f"{len(denied)} of {len(facts.peer_access)} GPU pairs cannot access each other ({shown}); {links}",
            "GeForce cards have no P2P (expected, NCCL goes through host memory); on data-center GPUs "
            "over PCIe disable ACS / boot with iommu=pt, or set NCCL_P2P_DISABLE=1 if all-reduce hangs",
            source,
        )
    return Check("peer access", "ok", f"all {len(facts.peer_access)} GPU pairs; {links}", source=source)


def check_shm(facts: EnvironmentFacts) -> Check:
    source = "DeepSpeed env_report.py (ds_report): /dev/shm under 512 MiB"
    fix = "docker run --shm-size=1g or larger (or --ipc=host); Kubernetes: an emptyDir with medium: Memory at /dev/shm"
    if facts.shm_bytes is None:
        return Check("/dev/shm", "warning", f"size unknown ({facts.shm_error})", fix, source)
    size = format_size(facts.shm_bytes, digits=0)
    if facts.shm_bytes < SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            "warning",
            f"{size}, under 512 MiB: NCCL's shared-memory transport and data loader workers run out of it",
            fix,
            source,
        )
    return Check("/dev/shm", "ok", size, source=source)


def check_debug_variables(facts: EnvironmentFacts) -> Check:
    source = "NVIDIA NCCL docs (debug variables are not for production); version-facts.md 'Environment variables'"
    left = []
    if facts.env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        left.append(f"NCCL_DEBUG={facts.env['NCCL_DEBUG']}")
    if facts.env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        left.append("TORCH_DISTRIBUTED_DEBUG=DETAIL")
    if left:
        return Check(
            "debug variables",
            "warning",
            f"{', '.join(left)} set: every rank logs each collective (slower, floods the logs)",
            "unset them, or NCCL_DEBUG=WARN to keep the errors",
            source,
        )
    return Check("debug variables", "ok", "no NCCL/torch debug logging left on", source=source)


def check_build_locks(facts: EnvironmentFacts, *, root=None) -> Check:
    """Stale DeepSpeed JIT build locks under the extensions root (`root`, default where the next run builds)."""
    from hf_dist_recipes.doctor import op_builds

    source = "known_issues.toml deepspeed-stale-jit-build-lock; hf_dist_recipes/doctor/op_builds.py"
    where = root if root is not None else op_builds.extensions_root()
    locks = op_builds.stale_locks(where)
    if locks:
        return Check(
            "build locks",
            "error",
            f"stale lock(s) {', '.join(map(str, locks))}: every DeepSpeed run that "
            "loads these ops hangs at engine creation",
            f"rm {' '.join(map(str, locks))} (no build is running now)",
            source,
        )
    return Check("build locks", "ok", f"no stale DeepSpeed build lock under {where}", source=source)


def check_ninja(facts: EnvironmentFacts | None, *, search_path=None, interpreter=None) -> Check:
    """The ninja torch runs for DeepSpeed's op builds (first on `search_path`, default $PATH) against the one beside
    `interpreter` (default sys.executable). Reads the machine, like `check_build_locks`; `facts` only says whether
    DeepSpeed is installed (None: assume it is)."""
    from hf_dist_recipes.doctor import op_builds

    source = (
        "torch cpp_extension verify_ninja_availability runs `ninja` from PATH; ninja log v7 (ninja-build/ninja 2519) "
        "vs v6 (2240); hf_dist_recipes/doctor/op_builds.py"
    )
    used, beside = op_builds.ninjas(search_path, interpreter)
    bin_dir = Path(interpreter or sys.executable).parent
    on_path_fix = f"activate the environment, or in every job script: export PATH={bin_dir}:$PATH"
    if used is None:
        if beside is not None:
            detail = (
                f"no ninja on PATH, though {beside.path} ({beside.version or 'version unknown'}) is installed beside "
                "the interpreter: a DeepSpeed op build stops with 'Ninja is required to load C++ extensions'"
            )
            return Check("ninja", "warning", detail, on_path_fix, source)
        if facts is not None and not facts.rule_facts().get("deepspeed"):
            return Check("ninja", "ok", "no ninja, and no DeepSpeed to build ops with it", source=source)
        detail = "no ninja anywhere: a DeepSpeed op build (cpu_adam, fused_adam, shm) stops with 'Ninja is required'"
        return Check("ninja", "warning", detail, "pip install ninja (DeepSpeed's own requirement)", source)
    shown = f"{used.path} ({used.version or 'version unknown'})"
    if beside is None or os.path.samefile(used.path, beside.path) or used.version == beside.version:
        return Check("ninja", "ok", f"DeepSpeed's ops build with {shown}", source=source)
    detail = (
        f"DeepSpeed's ops build with {shown}, the first on PATH, but the environment has {beside.path} "
        f"({beside.version or 'version unknown'}): jobs run with and without the environment activated distrust "
        "each other's .ninja_log and rebuild every op (a minute or more of every core, each job)"
    )
    return Check("ninja", "warning", detail, f"{on_path_fix} (or uninstall one of the two)", source)


def check_declared_minimums(facts: EnvironmentFacts) -> Check:
    rf = facts.rule_facts()
    broken, sources = [], []
    for pkg, spec, needs, needs_spec, source in DECLARED_MINIMUMS:
        have, need = _version(rf[pkg]), _version(rf[needs])
        if have is None or need is None or not SpecifierSet(spec).contains(have, prereleases=True):
            continue
        if not SpecifierSet(needs_spec).contains(need, prereleases=True):
            broken.append(f"{pkg} {rf[pkg]} needs {needs} {needs_spec}, found {rf[needs]}")
            sources.append(source)
    if broken:
        return Check(
            "declared minimums",
            "error",
            "; ".join(broken),
            "upgrade each named package to the version it needs (requirements.lock pins a set that fits)",
            "; ".join(dict.fromkeys(sources)),
        )
    return Check(
        "declared minimums",
        "ok",
        "every installed package has the versions it declares it needs",
        source="package metadata (version-facts.md 'Declared minimums')",
    )


FACT_CHECKS: tuple[Callable[[EnvironmentFacts], Check], ...] = (
    check_versions,
    check_torch_sees_gpus,
    check_driver,
    check_nccl,
    check_infiniband,
    check_nccl_network,
    check_peer_access,
    check_shm,
    check_debug_variables,
    check_declared_minimums,
    check_build_locks,
    check_ninja,
)
