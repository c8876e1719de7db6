"""Budgets held against measured peaks: plan, measure, re-aim (design note "calibrated budgets").

A :class:`~memsave_grads.core.budgets.Budget` bounds the memory model's *prediction*. Where the
model misses terms (op workspaces, the executor's overlap of independent ops, kernels that
fuse), a plan predicted to fit can measure above the budget: 1.05-1.46x on Keras 3
EfficientNetB0 (docs/budgets.md). Scaling by one measured plain step does not fix that: there
the plain step was *over*-predicted and the plans *under*-predicted.

So calibration closes the loop on the plans themselves. The budget the user asks for becomes a
target in measured bytes (a fraction of the measured plain step, or bytes of measured step
peak). The planner is then aimed at a *planned fraction* of the predicted plain peak, each plan
is measured, and the next planned fraction follows from the last: proportional correction
(``g * target / measured``), kept inside the bracket of fractions already known to hold and to
miss, halving it where the correction would leave it. The result is the plan that held with
the least recompute, at the smallest planned fraction that measured it
(``Calibration.held``).

This module is TensorFlow-free: the caller supplies ``measure``, which builds and runs one step
(``memsave_grads.calibrate_budget`` does it for Keras models and step functions; the
``budgets --calibrate`` benchmark for graph-mode sessions).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from memsave_grads import errors
from memsave_grads.core import budgets

#: ``measure(budget)``: the measured peak bytes of one step planned under ``budget``, or of plain
#: ``tf.gradients`` for ``None``; raises ``InfeasibleBudgetError`` where no plan is predicted to
#: fit ``budget``.
MeasureStep = Callable[["budgets.Budget | None"], int]

#: Plans measured at most (besides the plain step). Each is a trace and a few steps; on the
#: networks of docs/budgets.md 2-4 sufficed.
DEFAULT_MAX_MEASUREMENTS = 6
#: Stop once a plan measures within the target and at least this share of it: closer would buy
#: a little less recompute for more measurements.
CLOSE_ENOUGH = 0.9
#: Planned fractions closer than this (relative) count as the same: the planner's plans are
#: discrete, so nearer aims mostly re-measure a plan already measured.
_SAME_AIM = 0.01
#: The smallest relative change of the planned fraction from one measurement to the next; it
#: doubles each time a measurement repeats the last one's peak.
_MIN_STEP = 0.03


def calibrate(asked: budgets.Budget, measure: MeasureStep, *,
              max_measurements: int = DEFAULT_MAX_MEASUREMENTS, step: str = "",
              batch_size: int | None = None) -> budgets.Budget:
    """``asked`` re-aimed so that the plan it gives *measures* within it.

    Args:
      asked: the budget as the user gives it; its fraction is of the *measured* plain step
        here, and bytes are bytes of measured step peak.
      measure: builds and runs one step (see :data:`MeasureStep`). Called once with ``None``
        first, then with budgets of planned fractions.
      max_measurements: the most plans measured.
      step, batch_size: what ``measure`` runs, for the record (``Calibration.step``,
        ``Calibration.batch_size``).

    Returns:
      A :class:`~memsave_grads.core.budgets.Budget` with the planned fraction (of the
      *predicted* plain peak) that held, the same solver and costs, and ``calibration`` saying
      what was measured.

    Raises:
      InfeasibleBudgetError: no plan measured within the target; ``min_feasible_bytes`` is the
        smallest *measured* peak, ``budget_bytes`` the target and ``plain_peak_bytes`` the
        measured plain step, so the message and a retry can use the user's own terms.
    """
    if not isinstance(asked, budgets.Budget):
        raise errors.InvalidTypeError(
            f"budget: expected a memsave_grads.Budget, got {type(asked).__name__}: "
            f"{asked!r:.80}. Example: Budget(fraction=0.5) or Budget.parse('budget:50%').")
    if isinstance(max_measurements, bool) or not isinstance(max_measurements, int) or \
            max_measurements < 1:
        raise errors.InvalidArgumentError(
            f"max_measurements: expected an int >= 1, got {max_measurements!r:.60}.")
    plain_bytes = int(measure(None))
    target_bytes = asked.bytes if asked.bytes is not None else int(asked.fraction * plain_bytes)
    tries: list[budgets.CalibrationTry] = []
    held_at = missed_at = None  # largest planned fraction that held; smallest that missed
    aim = min(1.0, target_bytes / plain_bytes) if plain_bytes > 0 else 1.0
    planning_failures = flat_steps = 0
    while len(tries) < max_measurements and planning_failures <= max_measurements:
        planned = dataclasses.replace(asked, bytes=None, fraction=aim, calibration=None,
                                      calibrate=False)
        try:
            measured = int(measure(planned))
        except errors.InfeasibleBudgetError as infeasible:
            planning_failures += 1
            smallest = budgets.smallest_peak_budget(infeasible, planned)
            if smallest is None or (missed_at is not None and smallest.fraction >= missed_at):
                break  # nothing smaller to try, or it is already known to miss
            # A heuristic solver's smallest peak moves with the budget it was given (api note
            # at SMALLEST_PEAK_ATTEMPTS), and rounding can land just below it: step past.
            aim = max(smallest.fraction, aim * (1 + _SAME_AIM))
            continue
        tries.append(budgets.CalibrationTry(aim, measured))
        if measured <= target_bytes:
            held_at = aim if held_at is None else max(held_at, aim)
            if measured >= CLOSE_ENOUGH * target_bytes or aim >= 1.0:
                break
        else:
            missed_at = aim if missed_at is None else min(missed_at, aim)
        # The same peak again: the aim moved within one plan's span; move farther next time.
        same_plan = len(tries) > 1 and abs(measured - tries[-2].measured_bytes) <= \
            _SAME_AIM * measured
        flat_steps = flat_steps + 1 if same_plan else 0
        aim = _next_aim(aim, measured, target_bytes, held_at, missed_at,
                        min_step=min(0.5, _MIN_STEP * 2**flat_steps))
        if aim is None or any(abs(aim - t.planned_fraction) <= _SAME_AIM * aim for t in tries):
            break
    record = budgets.Calibration(asked=asked, target_bytes=target_bytes,
                                 plain_measured_bytes=plain_bytes, tries=tuple(tries),
                                 step=step, batch_size=batch_size)
    if record.held is None:
        raise _infeasible(record)
    # calibrate=False: this budget is the calibration's result; wrap_model does not measure
    # it again (a budget asking for calibration has none yet).
    return dataclasses.replace(asked, bytes=None, fraction=record.held.planned_fraction,
                               calibration=record, calibrate=False)


def _next_aim(aim: float, measured: int, target: int, held_at: float | None,
              missed_at: float | None, min_step: float = _MIN_STEP) -> float | None:
    """Proportional correction by at least ``min_step`` (relative), kept strictly inside
    (held_at, missed_at), else their midpoint; None: nowhere left to look."""
    proposed = aim * target / measured if measured > 0 else 1.0
    # Plans are discrete: a measured peak just past the target asks for a step too small to
    # reach another plan, and a peak made of a fixed cost barely moves with the aim.
    if measured > target:
        proposed = min(proposed, aim * (1 - min_step))
    else:
        proposed = max(proposed, aim * (1 + min_step))
    proposed = min(1.0, proposed)
    low = held_at if held_at is not None else 0.0
    high = missed_at if missed_at is not None else float("inf")
    if low < proposed < high:
        return proposed
    if missed_at is None:
        return None if held_at is not None and held_at >= 1.0 else min(1.0, proposed)
    midpoint = (low + high) / 2
    return midpoint if high - low > _SAME_AIM * high else None


def _infeasible(record: budgets.Calibration) -> errors.InfeasibleBudgetError:
    smallest = min(t.measured_bytes for t in record.tries) if record.tries else None
    plain = record.plain_measured_bytes

    if smallest is None:
        found = "the planner found no plan to measure near it"
        retry = " Ask for more"
    else:
        found = (f"the smallest of {len(record.tries)} measured plans peaked at "
                 f"{budgets.format_bytes(smallest)} ({smallest / plain:.0%} of the plain step)")
        at_least = math.ceil(smallest / plain * 100) / 100
        retry = f" Ask for at least that (Budget(fraction={at_least:.2f}) of the measured step)"
    error = errors.InfeasibleBudgetError(
        f"budget: {record.asked.describe()} is {budgets.format_bytes(record.target_bytes)} of "
        f"measured step peak ({record.target_bytes / plain:.0%} of the plain tf.gradients step, "
        f"{budgets.format_bytes(plain)}), and no plan measured within it: {found}.{retry}, or "
        "plan without calibration (a budget on the predicted peak).")
    error.min_feasible_bytes = smallest
    error.budget_bytes = record.target_bytes
    error.plain_peak_bytes = plain
    error.calibration = record
    return error
