"""What RecipeTrainer hands some callbacks from its own methods, and the error where no trainer does.

A few measurements have no `TrainerCallback` hook: each training micro-batch's loss (`compute_loss`,
`training_step`), its inputs, the pre-clip gradient norm. `RecipeTrainerMixin` hands them over from its methods
(`GradientHealthCallback.watch_loss`, `RankAgreementCallback.observe`, `RankMetrics.add_micro_step`); each of those
calls `mark_fed`. Under a plain `transformers.Trainer` nothing calls them, and the callbacks would see nothing and
say nothing, so at the first optimizer step that needs the numbers they call `require_fed`, which raises a
ValueError naming the fix.

Checked at the first step, not at train begin: a resume with `restore_callback_states_from_checkpoint` replaces a
callback with a fresh instance before train begin, and what counts is that something fed this one (a subclass that
overrides `compute_loss` without calling `super()` starves it as surely as a plain Trainer does).
"""

from __future__ import annotations


class TrainerFed:
    """Mixin for what RecipeTrainer feeds: `mark_fed()` in each feeding method, `require_fed()` where the
    numbers are needed."""

    _fed = False

    def mark_fed(self) -> None:
        self._fed = True

    def require_fed(self, callback: str, needs: str) -> None:
        """Raise ValueError unless something fed this object: `callback` names who needs it, `needs` what."""
        if not self._fed:
            raise ValueError(
                f"{callback} needs {needs}, which only RecipeTrainer hands it, and nothing did: use RecipeTrainer, or "
                f"recipe(YourTrainer) from hf_dist_recipes for another Trainer class, which register this callback "
                f"and feed it (do not add a second one; an override of compute_loss or training_step must call super())"
            )
