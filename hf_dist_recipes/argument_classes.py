"""The recipe's arguments for any `TrainingArguments` subclass, and the upgrade of a user's arguments into them.

`recipe_arguments_class(C, RecipeTrainingArguments)` is a dataclass `Recipe<C>` with bases
`(RecipeTrainingArguments, C)`, made once per `C`:
an instance is a `C` (its fields, its methods, its post-init: `RecipeTrainingArguments.__post_init__` calls
`super().__post_init__()`, which is `C`'s) and a `RecipeTrainingArguments` (the recipe's defaults and checks).
Defaults: a field the recipe declares takes the recipe's default; a stock field `C` re-declares (trl's
`learning_rate=2e-5`, `gradient_checkpointing=True`, ...) keeps `C`'s, which plain dataclass inheritance would lose
(the recipe's bases carry the stock default last). `Seq2SeqTrainingArguments` -> `RecipeSeq2SeqTrainingArguments`,
`SFTConfig` -> `RecipeSFTConfig`.

`upgrade(args, base, RecipeTrainingArguments)` builds the instance `RecipeTrainer` & co. train with
(`RecipeTrainingArguments.from_training_arguments`). Instances pickle and deep-copy by naming `C` (which must be
importable, as for any pickled `C`), not the made class, so a fresh process loads a `training_args.bin` without having
made it.

The recipe class is passed in, not imported: `hf_dist_recipes.arguments` imports this module (its
`from_training_arguments` upgrades through it), so importing it back would make a cycle.
"""

from __future__ import annotations

import dataclasses
import threading

from transformers import TrainingArguments

from hf_dist_recipes._compat import transformers as compat_transformers

_CLASSES: dict[tuple[type, type], type] = {}  # (recipe class, base) -> Recipe<base>
_LOCK = threading.Lock()


def recipe_arguments_class(base: type[TrainingArguments], recipe: type[TrainingArguments]) -> type:
    """`Recipe<base>`: the recipe class `recipe` (`RecipeTrainingArguments`) applied to the arguments class `base`
    (cached: the same class on every call)."""
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise ValueError(f"{base!r} is not a TrainingArguments subclass; pass the class the Trainer's args are")
    if issubclass(base, recipe):
        return base
    if base is TrainingArguments:
        return recipe
    with _LOCK:
        made = _CLASSES.get((recipe, base))
        if made is None:
            made = _CLASSES[(recipe, base)] = _make(base, recipe)
        return made


def _make(base: type[TrainingArguments], recipe: type[TrainingArguments]) -> type:
    ours = set(vars(recipe).get("__annotations__", {}))  # the fields the recipe declares
    stock = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    redeclared = [
        (f.name, f.type, _copy_field(f))
        for f in dataclasses.fields(base)
        if f.name in stock and f.name not in ours and not _same_default(f, stock[f.name])
    ]
    return dataclasses.make_dataclass(
        f"Recipe{base.__name__}",
        redeclared,
        bases=(recipe, base),
        namespace={
            "__module__": __name__,
            "__doc__": f"`{base.__module__}.{base.__qualname__}` with the recipe's defaults and checks "
            "(`hf_dist_recipes.argument_classes`).",
            "__reduce__": _reduce,
            "_recipe_base": base,  # no annotation: class attributes, not fields
            "_recipe_class": recipe,
        },
    )


def _reduce(self):
    return _instance, (type(self)._recipe_base, type(self)._recipe_class), dict(vars(self))


def _instance(base: type[TrainingArguments], recipe: type[TrainingArguments]):
    """An empty `Recipe<base>` for pickle and deepcopy, which then restore its attributes (no post-init again)."""
    cls = recipe_arguments_class(base, recipe)
    return cls.__new__(cls)


def upgrade(args: TrainingArguments, base: type[TrainingArguments] | None, recipe: type[TrainingArguments]):
    """`args` as a `Recipe<C>` of the recipe class `recipe`, where `C` is `type(args)`, or `base` when `args` is
    not a `base` already (trl's trainers need their config class: a plain `TrainingArguments` given to
    `recipe(SFTTrainer)` becomes a `RecipeSFTConfig`, as `SFTTrainer` itself would turn it into an `SFTConfig`).

    Every field the user set (a value other than its class's default, also after the stock post-init) is kept; a
    field left at its default takes the recipe's default where the recipe declares one, else its class's default."""
    target_base = type(args) if base is None or isinstance(args, base) else base
    if isinstance(args, recipe) and isinstance(args, target_base):
        return args
    target = recipe_arguments_class(target_base, recipe)
    source_fields = [f for f in dataclasses.fields(args) if f.init]
    target_fields = {f.name: f for f in dataclasses.fields(target) if f.init}
    unknown = [f.name for f in source_fields if f.name not in target_fields]
    if unknown:
        raise ValueError(
            f"{type(args).__name__} has fields {unknown} that {target_base.__name__} lacks; pass a "
            f"{target_base.__name__} (or a subclass of it) as args"
        )
    source_defaults = {f.name: _default(f) for f in source_fields}
    after_post_init = _post_init_defaults(source_defaults)
    ours = set(vars(recipe).get("__annotations__", {}))
    kept = {}
    for f in source_fields:
        value, default = getattr(args, f.name), source_defaults[f.name]
        # Compared with the default after the stock post-init too: that turns activation_checkpointing's None into
        # False (or trl's True), which is not the user's choice and must not override the launch plan's.
        if value != default and value != after_post_init.get(f.name, default):
            kept[f.name] = value
        elif f.name not in ours and _default(target_fields[f.name]) != default:
            kept[f.name] = default  # the source class's default, as a to_dict() rebuild would carry it
    return target(**kept)


def recipe_defaults_in_effect(args, recipe: type) -> list[tuple[str, object, object]]:
    """(field, the user's class's default, the value in effect) for each stock field the recipe class `recipe`
    declares whose value in `args` is the recipe's default where the user's class (`Recipe<C>`'s `C`; a plain
    `RecipeTrainingArguments`: `TrainingArguments`) has another. Read from the values, so every route alike: a
    `Recipe<C>` made by `recipe_arguments(C)`, an upgrade of a `C`, `HfArgumentParser` (which passes every field)."""
    base = getattr(type(args), "_recipe_base", TrainingArguments)
    stock = {f.name for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name: _default(f) for f in dataclasses.fields(base)}
    ours = {f.name: _default(f) for f in dataclasses.fields(recipe)}
    declared = sorted(set(vars(recipe).get("__annotations__", {})) & stock)
    return [
        (name, theirs[name], getattr(args, name))
        for name in declared
        if _shown(getattr(args, name)) == _shown(ours[name]) != _shown(theirs[name])
    ]


def describe_recipe_defaults(args, trainer_name: str, recipe: type) -> str:
    """The start-up line: each default of the user's arguments class the recipe replaced (`recipe_defaults_in_effect`;
    the schedule with its cycles), the seeding and the seed check, and how to keep the class's values."""
    base = getattr(type(args), "_recipe_base", TrainingArguments)
    replaced = recipe_defaults_in_effect(args, recipe)
    cycles = (args.lr_scheduler_kwargs or {}).get("num_cycles")

    def change(name, theirs, ours) -> str:
        said = f"{name} {_shown(theirs)} -> {_shown(ours)}"
        return f"{said} (num_cycles={cycles})" if name == "lr_scheduler_type" and cycles is not None else said

    seeding = (
        f"every rank seeded with seed={args.seed} when the recipe's arguments were made, and seed_check="
        f"{_shown(args.seed_check)} stops a job whose ranks disagree on seeds, data order or weights"
    )
    if not replaced:
        return f"{trainer_name}: {seeding}."
    owner = base.__name__ + ("'" if base.__name__.endswith("s") else "'s")
    build = type(args).__name__ if base is TrainingArguments else f"hf_dist_recipes.recipe_arguments({base.__name__})"
    return (
        f"{trainer_name}: the recipe's defaults in place of {owner}: "
        f"{', '.join(change(*r) for r in replaced)}; {seeding}. To keep {owner}, give them: {build}(..., "
        f"{', '.join(f'{name}={_shown(theirs)}' for name, theirs, _ in replaced)}); values given to a recipe "
        "arguments class are kept as given."
    )


def _shown(value) -> str:
    return repr(getattr(value, "value", value))  # an enum (SchedulerType) as the string a user writes


def _post_init_defaults(declared: dict[str, object]) -> dict[str, object]:
    """What transformers 5.24's post-init makes of a class's declared defaults of the activation/gradient
    checkpointing alias pair (`_compat.transformers.STOCK_POST_INIT_DEFAULTS`): the new name when set, else the
    deprecated one, else False (trl's configs declare `gradient_checkpointing=True`). Checked in
    tests/unit/test_argument_classes.py."""
    resolved = declared.get("activation_checkpointing")
    if resolved is None:
        resolved = declared.get("gradient_checkpointing")
    return dict.fromkeys(compat_transformers.STOCK_POST_INIT_DEFAULTS, False if resolved is None else resolved)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _same_default(a: dataclasses.Field, b: dataclasses.Field) -> bool:
    try:
        return bool(_default(a) == _default(b))
    except Exception:  # a default without a usable ==: treat as re-declared
        return False


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    return dataclasses.field(
        default=f.default,
        default_factory=f.default_factory,
        init=f.init,
        repr=f.repr,
        hash=f.hash,
        compare=f.compare,
        metadata=f.metadata,
        kw_only=f.kw_only,
    )
