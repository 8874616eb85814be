"""`recipe(trainer_cls)`: the recipe applied to any `Trainer` subclass (trl's `SFTTrainer`, `DPOTrainer`,
transformers' `Seq2SeqTrainer`, a user's own), without copying it.

    from trl import SFTTrainer
    from hf_dist_recipes import recipe

    trainer = recipe(SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=..., processing_class=tok)

The class is `Recipe<Name>` with bases `(RecipeTrainerMixin, trainer_cls)`, made once per `trainer_cls`. Its `args`
become a `Recipe<C>` of the arguments class `C` the Trainer declares for `args` (the most derived `TrainingArguments`
subclass in the annotation: `SFTConfig` for `SFTTrainer`, `TrainingArguments` for `Seq2SeqTrainer`, which a
`Seq2SeqTrainingArguments` passed in keeps), or of `arguments_class` when given.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing

from transformers import Trainer, TrainingArguments

from hf_dist_recipes.trainer import RecipeTrainer, RecipeTrainerMixin


def recipe(trainer_cls: type[Trainer], arguments_class: type[TrainingArguments] | None = None) -> type[Trainer]:
    """`trainer_cls` with the recipe: `Recipe<Name>(RecipeTrainerMixin, trainer_cls)`, the same class on every call.
    `recipe(Trainer)` is `RecipeTrainer`; a class that has the mixin already is returned as it is. `arguments_class`:
    the arguments class the Trainer needs, when its `args` annotation does not name it (default: read from it)."""
    return _recipe(trainer_cls, arguments_class)  # one cache key however the arguments are spelled


@functools.cache
def _recipe(trainer_cls: type[Trainer], arguments_class: type[TrainingArguments] | None) -> type[Trainer]:
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ValueError(f"recipe() takes a Trainer subclass, not {trainer_cls!r}")
    if arguments_class is not None and not (
        isinstance(arguments_class, type) and issubclass(arguments_class, TrainingArguments)
    ):
        raise ValueError(f"arguments_class must be a TrainingArguments subclass, not {arguments_class!r}")
    if issubclass(trainer_cls, RecipeTrainerMixin) and arguments_class is None:
        return trainer_cls
    if trainer_cls is Trainer and arguments_class in (None, TrainingArguments):
        return RecipeTrainer
    return type(
        f"Recipe{trainer_cls.__name__}",
        (RecipeTrainerMixin, trainer_cls),
        {
            "__module__": __name__,
            "__doc__": f"`{trainer_cls.__module__}.{trainer_cls.__qualname__}` with the recipe "
            "(`hf_dist_recipes.trainer.RecipeTrainerMixin`).",
            "recipe_arguments_base": arguments_class or declared_arguments_class(trainer_cls),
        },
    )


def declared_arguments_class(trainer_cls: type[Trainer]) -> type[TrainingArguments]:
    """The most derived `TrainingArguments` subclass in the annotation of `trainer_cls.__init__`'s `args`
    (`SFTConfig | TrainingArguments | None` -> `SFTConfig`); `TrainingArguments` when it names none or is a string
    that does not resolve."""
    for klass in trainer_cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or "args" not in inspect.signature(init).parameters:
            continue
        try:
            annotation = typing.get_type_hints(init).get("args")
        except Exception:  # forward references to optional packages: fall back to the raw annotation
            annotation = inspect.signature(init).parameters["args"].annotation
        candidates = [
            c
            for c in _members(annotation)
            if isinstance(c, type) and issubclass(c, TrainingArguments) and c is not TrainingArguments
        ]
        for candidate in candidates:
            if all(issubclass(candidate, other) for other in candidates):
                return candidate
        return TrainingArguments
    return TrainingArguments


def _members(annotation) -> list:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]
