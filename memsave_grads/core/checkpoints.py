"""What ``checkpoints=`` asks for, parsed once and passed on.

``_validate.check_checkpoints`` checks the argument's form and returns it as a
:class:`ParsedCheckpoints`, so that the planner (``_tf.selection``), the never-worse rule and
the Keras step read its kind from one record instead of working it out again by type checks.
"""

from __future__ import annotations

import dataclasses

from memsave_grads.core import budgets


@dataclasses.dataclass(frozen=True, eq=False)
class ParsedCheckpoints:
    """One ``checkpoints=`` argument: exactly one of ``strategy``, ``budget`` or ``items``.

    Attributes:
      given: the argument as the caller gave it (reports and warnings show it so).
      strategy: a strategy name (``"memory"``, ``"speed"``, ``"collection"``), or None.
      budget: a :class:`~memsave_grads.core.budgets.Budget` (a ``"budget:..."`` string
        parsed), or None.
      items: an explicit list: graph tensors and name patterns (a single tensor as a list of
        one), or None.
    """

    given: object
    strategy: str | None = None
    budget: budgets.Budget | None = None
    items: tuple | None = None

    @property
    def explicit(self) -> bool:
        """Tensors or name patterns the user chose (honoured even where predicted worse)."""
        return self.items is not None

    @property
    def planner(self) -> str:
        """Who makes the plan, as ``Plan.planner`` names it for a strategy or a list (a budget's
        solver names itself)."""
        return self.strategy if self.strategy is not None else "explicit"

    def describe(self) -> str:
        """``budget:50%``-like for a budget, else the argument as given."""
        return self.budget.describe() if self.budget is not None else repr(self.given)
