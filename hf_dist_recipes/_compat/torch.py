"""torch's details that are not public API (proven: `PROVEN["torch"]`): the allocator settings, the fused norm,
non-persistent buffers, the default store and collective timeouts, the flight recorder and its analyser. Each says
when it can go."""

from __future__ import annotations


def set_allocator_settings(settings: str) -> None:
    """Hand `settings` (PYTORCH_CUDA_ALLOC_CONF syntax) to the running process's allocator config, which torch 2.13
    may have parsed already: its caching allocator reads the variable once (`c10::CachingAllocator::
    AcceleratorAllocatorConfig::instance()`), and other torch 2.x releases parse it while libc10_cuda loads, at
    `import torch` (their `BackendStaticInitializer`), so a variable set later alone can go unread.
    `torch._C._accelerator_setAllocatorSettings` (private; `torch.cuda.memory._set_allocator_settings` is its
    deprecated alias) parses it now. Expandable segments may be switched on at any time, for allocations after it."""
    import torch

    torch._C._accelerator_setAllocatorSettings(settings)


def tensor_norms(tensors: list):
    """The 2-norm of each tensor, float32, from one fused call (torch 2.13 `torch._foreach_norm`, the kernel
    `clip_grad_norm_` uses; on CPU it loops in C++). NaN and Inf survive; so does a float32 overflow."""
    import torch

    return torch.stack(torch._foreach_norm(tensors)).float()


# torch 2.13 `nn.Module._non_persistent_buffers_set` (torch/nn/modules/module.py:458, filled by `register_buffer(...,
# persistent=False)` at :590): the buffers `state_dict` leaves out, so an export must too. Goes when torch exposes
# buffer persistence publicly (today only `state_dict()` shows it, which under ZeRO-3 holds empty placeholders).
def non_persistent_buffer_names(module) -> set[str]:
    """Names of `module`'s own buffers registered with persistent=False."""
    return set(module._non_persistent_buffers_set)


# No silent hangs (comm/watchdog.py). torch 2.13 `distributed_c10d._get_default_store()` returns the store
# `init_process_group` rendezvoused through (a PrefixStore over the launcher's TCPStore); the heartbeats go there, so
# they need no port or address of their own. `_set_pg_timeout(timeout, group)` calls `_set_default_timeout` on the
# group's Gloo and NCCL backends: later collectives of that group use the new timeout (Gloo raises when it passes;
# ProcessGroupNCCL's watchdog aborts, and with TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down). A group made
# by `new_group` (DeepSpeed's ZeRO/TP/EP groups) keeps the timeout it was created with, so every group in
# `_world.pg_map` is changed. Covered: torch 2.13 to 2.15 (PROVEN). The store goes when torch exposes a group's
# store; the private timeout setter when the torch floor is 2.14 (public `set_timeout`, used where present).
# torch elastic tells its workers to rendezvous through the agent's own store with TORCHELASTIC_USE_AGENT_STORE="True"
# (torch 2.13 distributed/rendezvous.py `_torchelastic_use_agent_store`); after a restart that store still holds the
# first attempt's keys (`comm.restarts`, pytorch/pytorch#135712). Goes when that issue is fixed in the torch floor.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def agent_store_in_use(environ) -> bool:
    return environ.get(AGENT_STORE_VARIABLE) == str(True)


def stop_using_agent_store(environ) -> None:
    """The group is then created as without an agent: rank 0 hosts its store at MASTER_ADDR:MASTER_PORT."""
    environ[AGENT_STORE_VARIABLE] = str(False)


def default_store():
    """The default process group's store (torch 2.13 `_get_default_store`)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def set_collective_timeout(seconds: float) -> int:
    """Set the timeout of every process group this rank belongs to; returns how many groups were changed."""
    from datetime import timedelta

    import torch.distributed as torch_distributed
    from torch.distributed import distributed_c10d

    changed = 0
    for group in list(distributed_c10d._world.pg_map):
        if distributed_c10d._rank_not_in_group(group):
            continue
        # torch 2.14 makes it public as `set_timeout` (the private name warns there); 2.13 has the private one only.
        set_timeout = getattr(torch_distributed, "set_timeout", None) or distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=seconds), group)
        changed += 1
    return changed


# The start-up timeout (comm/process_setup.py). Where the process group is created, with what timeout, read in
# transformers 5.24, accelerate 1.16, deepspeed 0.19.8 and torch 2.13, and measured on 2 CPU ranks
# (tests/distributed/test_other_trainers.py, test_checkpoint_lifecycle.py):
# - `TrainingArguments.__post_init__` (training_args.py:1661) reads `self.device` -> `_setup_devices`, which gives
#   accelerate's `PartialState` `timeout=ddp_timeout` on the DeepSpeed and GPU branches (training_args.py:1888,
#   1891) but none with `use_cpu` (training_args.py:1876-1879, which the recipe sets on every CPU host). There
#   accelerate's MULTI_CPU branch calls `init_process_group(backend="gloo", rank=, world_size=)` (accelerate
#   state.py:282) and the group gets torch's default, 30 minutes (distributed_c10d.py:849 `_get_default_timeout`).
# - Without `use_cpu`, under a DeepSpeed launch (ACCELERATE_USE_DEEPSPEED, also a CPU one: accelerate's DeepSpeed
#   launcher does not pass use_cpu on) `PartialState` calls `deepspeed.comm.init_distributed(timeout=ddp_timeout)`
#   (accelerate state.py:212 -> deepspeed comm/comm.py:910 -> comm/torch.py:282 `init_process_group`); that is the
#   NCCL path, and the plain route's (a script's own TrainingArguments, with the stock ddp_timeout, 1800 s).
# - `new_group` without a timeout (DeepSpeed's groups: `utils/groups.py` `_clone_world_group` and the TP/EP
#   groups, made when the engine is built) takes `_get_default_timeout` too: 30 minutes on Gloo, 10 on NCCL.
# `collective_timeout` reads a group's timeout back from its backend's options (private); `set_collective_timeout`
# above changes it on every existing group. Remove the reading when torch exposes a group's timeout; the recipe
# route's change (not the plain route's) when transformers passes ddp_timeout with use_cpu too
# (tests/unit/test_compat.py::test_transformers_gives_a_use_cpu_group_no_timeout fails then).
def collective_timeout(group=None) -> float | None:
    """The collective timeout in seconds of `group` (default: the default group), from its NCCL backend where it has
    one, else its Gloo backend; None without a process group or without either backend."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    devices = group._device_types
    for device in (torch.device("cuda"), torch.device("cpu")):
        if device in devices:
            return group._get_backend(device).options._timeout.total_seconds()
    return None


# The flight recorder (comm/flight_recorder.py). torch 2.13 keeps one recorder per event type: the CPU one
# (`FlightRecorder<c10::Event>`, every Gloo collective, on by default: `TORCH_FR_BUFFER_SIZE`, older name
# `TORCH_NCCL_TRACE_BUFFER_SIZE`, default 2000 entries, read once when the recorder is first used) and NCCL's
# (`FlightRecorder<at::cuda::CUDAEvent>`, CUDA builds only). `torch._C._distributed_c10d._dump_fr_trace()` and
# `_dump_nccl_trace()` return the pickle (format "version" 2.10: "entries" with "collective_seq_id",
# "profiling_name" such as "gloo:all_reduce", "input_sizes", "state", "frames" (the Python call site) and
# "process_group", plus "pg_config" and "pg_status") that NCCL's dump on timeout writes and
# `torch.distributed.flight_recorder.fr_trace` reads. Neither is public API. Covered: torch 2.13 to 2.15 (PROVEN).
# Goes when torch offers a public in-process dump.
def flight_recorder_trace() -> bytes | None:
    """This process's flight recorder as torch's pickle: NCCL's where the default group is NCCL, else the CPU
    (Gloo) one; None when torch has no such dump or the recorder is off (no entries and no groups)."""
    import pickle

    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    dump = c10d._dump_fr_trace
    if dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        dump = c10d._dump_nccl_trace
    raw = dump()
    content = pickle.loads(raw)
    return raw if content.get("entries") or content.get("pg_config") else None


# The private `Trainer` methods the recipe overrides, all here: `RecipeTrainerMixin` inherits this class, so its


# 2.13 to 2.15 (tests/unit/test_hang_report.py::test_compat_*). Goes when torch documents the analyser as a library.
FR_COLLECTIVE_FIELDS = (
    "pass_check",
    "collective_seq_id",
    "group_id",
    "pg_desc",
    "collective_name",
    "missing_ranks",
    "mismatch_collectives",
    "type_of_mismatch",
)
FR_LOGGER = "Flight Recorder"


def fr_match_collectives(
    entries: dict[int, list[dict]], groups: dict[str, tuple[str, list[int]]], version: str, mismatch_cap: int = 10
) -> list:
    """torch's `Collective` records for every rank's flight-recorder `entries` ({global rank: torch's entries}),
    `groups` {process-group name: (description, member ranks)} (every group named in an entry), `version`: the
    dump's "version". The entry lists are copied (torch's builder consumes them)."""
    import logging

    logging.getLogger(FR_LOGGER).disabled = True  # torch's analyser prints its findings; the report says them
    from torch.distributed.flight_recorder.components.builder import build_collectives, build_groups_memberships
    from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning

    config = {name: {"desc": desc, "ranks": str(sorted(ranks))} for name, (desc, ranks) in groups.items()}
    _, by_guid, _, memberships, pg_guids = build_groups_memberships({rank: config for rank in entries})
    aligned = align_trace_from_beginning({rank: list(rank_entries) for rank, rank_entries in entries.items()})
    _, collectives, _ = build_collectives(aligned, by_guid, memberships, pg_guids, version, mismatch_cap)
    return collectives
