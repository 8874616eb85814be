"""Every reliance on an upstream detail that is not public API, one module per upstream (`transformers`,
`accelerate`, `deepspeed`, `torch`, `stdlib`), each item with the versions it was read in and when it can go. Here:
the releases they were proven at, the floor to the newest of each range (`PROVEN`; .ci/run tests both ends), and the
workarounds' version gates (`WORKAROUNDS`, `needed`: each names the releases that behave so and the upstream issue).
`tests/unit/test_compat.py` fails when an installed upstream no longer behaves as assumed here (a workaround's both
ways); `tests/unit/test_private_upstream.py` when a private upstream name is used outside this folder.
"""

from __future__ import annotations

from dataclasses import dataclass

# The releases these private touches were read in and tested at (tests/unit/test_compat.py runs against what is
# installed and fails outside these: re-read the touches against the new release, then widen). The lower ends are
# pyproject.toml's floors, the upper ends the newest releases tested (the development lock).
PROVEN = {
    "transformers": ">=5.23,<=5.25.0",
    "accelerate": ">=1.10,<=1.16.0",
    "deepspeed": ">=0.19.8,<=0.19.8",
    "torch": ">=2.13,<=2.15.0",
}


@dataclass(frozen=True)
class Workaround:
    """An upstream behaviour the package works around. `affected`: the releases of `package` that behave so (PEP 440;
    open above while no release fixes it); `upstream`: the issue or the place in upstream's code; `remove_when`: what
    lets the workaround go."""

    package: str
    affected: str
    upstream: str
    remove_when: str

    def needed(self, installed: str | None = None) -> bool:
        """Whether `installed` (default: the installed release of `package`) is one of the affected releases."""
        from importlib.metadata import version

        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.affected).contains(installed or version(self.package), prereleases=True)


WORKAROUNDS = {
    "autotp_weight_conversion": Workaround(
        "transformers",
        ">=5.22",
        "integrations/deepspeed.py `_apply_weight_conversions_to_state_dict` refuses any `autotp_size > 1`, though "
        "training AutoTP slices nothing before `deepspeed.initialize` (no upstream issue yet)",
        "the guard tells inference TP from training AutoTP: close `affected` below that release",
    ),
    "evaluation_before_training": Workaround(
        "transformers",
        ">=5.23",
        "huggingface/transformers#44889 (open): an evaluation before `train()` leaves an inference engine that "
        "`train()` destroys and then uses",
        "#44889 is released: close `affected` below that release",
    ),
    "moe_resume_conversion": Workaround(
        "transformers",
        ">=5.23",
        "huggingface/transformers#48805 (PR 48822, open): `Trainer._load_from_checkpoint` loads safetensors without "
        "the weight conversion, so MoE experts keep their fresh values",
        "PR 48822 is released: close `affected` below that release",
    ),
    "hpz_group_per_process": Workaround(
        "deepspeed",
        ">=0.19.8",
        "deepspeed/utils/groups.py `_create_zero_param_parallel_group` asserts the hpZ group is created once per "
        "process (no upstream issue yet)",
        "zero.Init reuses or replaces the group: close `affected` below that release",
    ),
    "sp_groups_once_per_process": Workaround(
        "deepspeed",
        ">=0.18.2",
        "deepspeed/runtime/sequence_parallel/parallel_state_sp.py `initialize_sequence_parallel` asserts the SP groups "
        "are made once per process, and accelerate registers Ulysses at every DeepSpeed prepare: an `evaluate()` "
        "before `train()`, or a second `train()`, stops there (no upstream issue yet)",
        "the registration reuses or replaces the groups: close `affected` below that release",
    ),
    "cpu_adam_resumed_step": Workaround(
        "deepspeed",
        ">=0.19.8",
        "csrc/includes/cpu_adam.h `IncrementStep`: CPU Adam multiplies beta1^t and beta2^t once per step in its C++ "
        "state, but an optimizer whose first step is a later one (a resume) takes std::pow, which can differ in the "
        "last bit of a float: the first update after a resume is not the uninterrupted run's (no upstream issue yet)",
        "IncrementStep computes the powers the same way on both paths: close `affected` below that release",
    ),
    "jit_build_lock_file": Workaround(
        "torch",
        "<2.14",
        "torch/utils/cpp_extension.py `_jit_compile` builds behind `FileBaton(<build dir>/lock)`: every process waits "
        "while the file exists, so a build killed mid-way leaves a file that hangs every later run; torch 2.14 holds "
        "an OS-level lock on the same file instead (`FileLock`, released when its holder dies), and the file that "
        "stays after each load means nothing (doctor/op_builds.py looks for stale files only where they block)",
        "the torch floor is 2.14: the stale-lock check goes with it",
    ),
}


def needed(name: str) -> bool:
    """Whether the installed upstream needs the workaround `name` (a key of `WORKAROUNDS`)."""
    return WORKAROUNDS[name].needed()


# Upstream behaviour other modules work around (public API only, so the code lives there; the tests in
# tests/unit/test_compat.py fail when upstream changes):
# - transformers 5.24 `Trainer.get_tp_size` reads the DeepSpeed TP degree only from `args.hf_deepspeed_config`
#   -> arguments.py adopts a launcher TP config into `args.deepspeed`;
# - accelerate 1.16 `DeepSpeedPlugin` refuses mixed_precision & co. beside a deepspeed_config_file
#   -> planning/accelerate_config.py never writes them, planning/lint.py reports them.
