"""Fails when a private name of an upstream library is used anywhere in the package outside `hf_dist_recipes/_compat/`.

Upstream: transformers, accelerate, deepspeed, torch. A name is private when it starts with one underscore (`_x`, not
`__x__`). The rule, checked on every module's source (AST, function-level code included) and, for rule 4, on the
imported classes:

1. imports: `from <upstream>... import _x`, and any imported upstream module path with a private part
   (`import torch._dynamo`, `from torch._C import x`);
2. attributes: `E._x` where `E` starts at a name bound to an upstream import (`torch._foreach_norm`,
   `dist.distributed_c10d._world`), or where `_x` is defined nowhere in the package, so that it can only be
   another library's (`module._non_persistent_buffers_set`, `self._tr_loss` in a Trainer subclass), unless `E`
   starts at a name bound to a non-upstream import (`os._exit`);
3. the same for `getattr` / `hasattr` / `setattr` / `delattr` with a literal `"_x"`;
4. overrides: a package class, or a mixin in its MRO, that defines `_x` where an upstream class in the MRO has
   `_x` (overriding `Trainer._clip_grad_norm`). A mixin defined in `_compat/` is allowed.

What it cannot see: a private name the package also defines for itself, used on an upstream object that is not
reached through an import (rule 2 then trusts the package's own name), and undocumented upstream API without an
underscore (`deepspeed.module_inject...`, `param.ds_id`, a checkpoint's keys); those are kept in `_compat` by
review, each with its test in tests/unit/test_compat.py.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_dist_recipes"
UPSTREAM = ("transformers", "accelerate", "deepspeed", "torch")
COMPAT = "hf_dist_recipes._compat"  # one module per upstream (transformers.py, deepspeed.py, ...)
ALLOWED = set((PACKAGE / "_compat").glob("*.py"))
GETATTR_FAMILY = {"getattr", "hasattr", "setattr", "delattr"}
PYTHON_SET = {"_abc_impl"}  # set by Python itself (abc) on every subclass


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _upstream(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in UPSTREAM


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> dict[str, str]:
    """Every name an import binds in the module (any scope) -> the dotted path it stands for."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _defined_in(tree: ast.AST) -> set[str]:
    """Every name a module defines itself: functions, classes, assignment targets (`self._x = ...` too), function
    parameters, and string keys of dict literals (a namespace handed to `type()`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Dict):
            names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def _defined_names() -> set[str]:
    names = set()
    for path in _modules():
        names |= _defined_in(ast.parse(path.read_text(encoding="utf-8")))
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _violations(path: Path, tree: ast.AST, own: set[str]) -> list[str]:
    """Rules 1-3 on one module's syntax tree; `own`: the names the package defines."""
    bound = _imports(tree)
    where = path.relative_to(PACKAGE.parent)
    out = []

    def access(node: ast.AST, base: ast.AST, name: str) -> None:
        root = _root(base)
        origin = bound.get(root) if root else None
        if _upstream(origin) or (name not in own and origin is None):
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _upstream(alias.name) and any(_private(p) for p in alias.name.split(".")):
                    out.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _upstream(node.module):
            if any(_private(p) for p in node.module.split(".")) or any(_private(a.name) for a in node.names):
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            access(node, node.value, node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in GETATTR_FAMILY
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            access(node, node.args[0], node.args[1].value)
    return out


def _in_compat(module: str) -> bool:
    return module == COMPAT or module.startswith(COMPAT + ".")


def _overrides(cls: type) -> list[str]:
    """Rule 4: private attributes that the package's classes in `cls`'s MRO define over an upstream class's."""
    upstream = [k for k in cls.__mro__ if _upstream(k.__module__)]
    out = []
    for own in cls.__mro__:
        if own.__module__.startswith("hf_dist_recipes") and not _in_compat(own.__module__):
            for name in vars(own):
                if _private(name) and name not in PYTHON_SET:
                    owner = next((k for k in upstream if hasattr(k, name)), None)
                    if owner is not None:
                        out.append(f"{own.__module__}.{own.__qualname__}.{name} overrides {owner.__qualname__}.{name}")
    return out


def test_no_private_upstream_name_outside_compat():
    assert {p.name for p in ALLOWED} >= {"transformers.py", "accelerate.py", "deepspeed.py", "torch.py"}
    own = _defined_names()
    found = []
    for path in _modules():
        if path not in ALLOWED:
            found += _violations(path, ast.parse(path.read_text(encoding="utf-8")), own)
    assert found == [], "private upstream names outside hf_dist_recipes/_compat/:\n" + "\n".join(found)


def test_no_package_class_overrides_a_private_upstream_method_outside_compat():
    found = set()
    for path in _modules():
        module = importlib.import_module(_module_name(path))
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                found.update(_overrides(obj))
    assert sorted(found) == [], "move these overrides into hf_dist_recipes/_compat/"


def _check(source: str) -> list[str]:
    tree = ast.parse(source)
    return sorted(
        v.split(": ", 1)[1] for v in _violations(PACKAGE / "x.py", tree, _defined_names() | _defined_in(tree))
    )


def test_rules_1_to_3_catch_each_kind():
    source = """
import torch
import torch.distributed as dist
import torch._dynamo
from torch.distributed import distributed_c10d
from transformers.trainer import _is_peft_model
from torch._C import _get_tracing_state
from transformers import Trainer
x = torch._foreach_norm
y = distributed_c10d._world.pg_map
z = dist.distributed_c10d._get_default_store()
def f(module, trainer):
    return module._non_persistent_buffers_set, getattr(trainer, "_tr_loss", None)
class T(Trainer):
    def f(self):
        return self._tr_loss, self._own_helper()
    def _own_helper(self):
        return 1
"""
    assert _check(source) == sorted(
        [
            "import torch._dynamo",
            "from transformers.trainer import _is_peft_model",
            "from torch._C import _get_tracing_state",
            "torch._foreach_norm",
            "distributed_c10d._world",
            "dist.distributed_c10d._get_default_store",
            "module._non_persistent_buffers_set",
            "getattr(trainer, '_tr_loss', None)",
            "self._tr_loss",
        ]
    )


def test_rules_1_to_3_pass_public_stdlib_and_own_names():
    source = """
import os
import torch
from hf_dist_recipes._compat import deepspeed as compat_deepspeed
class Mine:
    _own = 1
def f(self, model):
    os._exit(1)
    torch.distributed.is_initialized()
    return self._own, compat_deepspeed.ZERO_RANK_FILE, getattr(model, "_own", None)
"""
    assert _check(source) == []


def test_rule_4_catches_an_override_through_a_mixin_and_allows_one_in_compat():
    from transformers import Trainer

    class Mixin:
        def _clip_grad_norm(self, model):
            return 0.0

        def _recipe_own(self):
            return 1

    class Recipe(Mixin, Trainer):
        pass

    Mixin.__module__ = Recipe.__module__ = "hf_dist_recipes.x"
    assert [o.rsplit(".Mixin.", 1)[1] for o in _overrides(Recipe)] == [
        "_clip_grad_norm overrides Trainer._clip_grad_norm"
    ]
    Mixin.__module__ = "hf_dist_recipes._compatible"  # a name that only starts like it
    assert len(_overrides(Recipe)) == 1
    Mixin.__module__ = "hf_dist_recipes._compat.transformers"
    assert _overrides(Recipe) == []
