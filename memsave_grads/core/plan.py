"""The plan: the one record every planner returns (docs/design.md, note "plan and schedule").

A plan says which forward nodes keep their outputs through the backward pass. Everything else
follows from it and the graph: :func:`memsave_grads.core.schedule.of_plan` derives the segments
and levels, which the memory model replays in bytes and the TensorFlow rewrite executes, so the
prediction and the rewrite cannot drift apart.

Every way of choosing checkpoints produces a :class:`Plan`: the ``"memory"`` planner, the budget
solvers, the revolve DP (with ``children``: nested plans), and the strategies that choose by op
type, name or collection (no prediction attached). Node numbers are those of the
:class:`~memsave_grads.core.graph.ForwardGraph` the plan was made for.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Plan:
    """Kept nodes, nested sub-plans, and what the planner knows about them.

    Attributes:
      kept: nodes whose outputs are kept. For a whole graph: closed for single ownership
        (``graph.close_segments``, design note "single owner"), the nodes kept anyway included.
        For a sub-plan: nodes of its segment kept while the segment is replayed.
      not_replayed: kept nodes whose segment is never copied (stateful ops; design note "never
        replay state"): their gradient is taken through the original op.
      children: for a kept node, the plan its recomputed segment follows (multi-level plans,
        design note "multi-level"); empty for a single-level plan.
      chosen: the nodes the strategy itself picked, for reports (``kept`` adds the nodes kept
        anyway and the single-owner closure); None where the planner does not distinguish.
      planner: who made the plan: ``"memory"``, a solver (``"greedy"``, ``"dp"``, ``"milp"``,
        ``"revolve"``), ``"speed"``, ``"collection"``, ``"explicit"``.
      reason: one sentence on why this plan, for logs and ``explain()``.
      predicted_peak_bytes: the memory model's peak of the plan (None where not predicted).
      recompute_cost: what the plan recomputes, in the planner's measure: for the solvers
        ``ForwardGraph.cost_of`` summed (a node replayed at depth d counts d times); for
        ``"memory"`` recomputed nodes, expensive ones weighing more; None where not predicted.
      optimal: the solver proved that no plan *of its search space* within the budget
        recomputes less (see ``memsave_grads.core.solvers``).
      solve_seconds: wall time of the planner.
      budget_bytes: the budget it was solved for, if any.
      cuts: topological positions cut at (cut-based planners); ``kept`` holds their frontiers.
      segment_cap_bytes: the cap on recomputed bytes between cuts that gave the plan
        (``"memory"``).
    """

    kept: frozenset
    not_replayed: frozenset = frozenset()
    children: Mapping[int, "Plan"] = dataclasses.field(default_factory=dict, compare=False)
    chosen: frozenset | None = None
    planner: str = ""
    reason: str = ""
    predicted_peak_bytes: int | None = None
    recompute_cost: float | None = None
    optimal: bool = False
    solve_seconds: float = 0.0
    budget_bytes: int | None = None
    cuts: tuple = ()
    segment_cap_bytes: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "kept", frozenset(self.kept))
        object.__setattr__(self, "not_replayed", frozenset(self.not_replayed))

    @property
    def levels(self) -> int:
        """Recomputation depth: 1 for a single-level plan, 2 when segments have sub-plans..."""
        return 1 + max((c.levels for c in self.children.values()), default=0)

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)
