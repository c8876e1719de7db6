"""Memory budgets: "fit in this many bytes at the least extra compute".

A :class:`Budget` says how much memory the training step may use, in bytes or as a fraction of
what plain ``tf.gradients`` is predicted to use. It is a ``checkpoints=`` argument, like a
strategy name, and has a string form for :func:`memsave_grads.patch`:
``"budget:4GiB"``, ``"budget:60%"``, ``"budget:0.6"``, optionally naming the solver
(``"budget:60%:milp"``) and asking for measured plans (``"budget:60%:calibrated"``).

This module is TensorFlow-free: it defines the budget as the user gives it, its string form,
and recompute costs calibrated from a measured profile (:func:`calibrated_costs`). The planning
problem a solver receives and how plans are scored live in ``memsave_grads.core.solvers.problem``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re
import statistics
from typing import Mapping, Sequence

from memsave_grads import errors

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: Byte units of the string form, case-insensitive. KB/MB/GB are powers of 1000, KiB/MiB/GiB
#: of 1024.
BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
#: Name of the solver a budget uses unless it says otherwise (see ``solvers.SOLVERS``).
DEFAULT_SOLVER = "greedy"
#: The solvers a budget may name (``memsave_grads.core.solvers.SOLVERS`` implements each).
SOLVER_NAMES = ("greedy", "dp", "milp", "revolve")
#: The largest int64: byte counts beyond it overflow NumPy integers, and no machine has 8 EiB
#: to give (every solver plans at this budget).
MAX_BUDGET_BYTES = 2**63 - 1
STRING_PREFIX = "budget:"
#: The string form's word for ``Budget(calibrate=True)``.
CALIBRATED_WORD = "calibrated"

_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


#: The styles of :func:`format_bytes`.
BYTE_STYLES = ("auto", "MiB", "report")


def format_bytes(nbytes: float | None, style: str = "auto") -> str:
    """Bytes for people, the package's one formatter of them. ``style``:

    - ``"auto"`` (messages and tables): three significant digits in the largest unit that
      fits: ``1.5 GiB``, ``300 MiB``, ``12 KiB``, ``100 B``;
    - ``"MiB"`` (numbers a message compares with each other): always MiB, three significant
      digits: ``0.00211 MiB``, ``1.5e+03 MiB``;
    - ``"report"`` (``explain``'s report, whose lines a reader compares at a glance): one
      decimal, MiB from a tenth of one up, else KiB: ``0.4 MiB``, ``5.5 KiB``.

    None (a size nobody knows) is ``unknown``.
    """
    if nbytes is None:
        return "unknown"
    if style == "MiB":
        return f"{nbytes / 2**20:.3g} MiB"
    if style == "report":
        return (f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 / 10
                else f"{nbytes / 2**10:.1f} KiB")
    if style != "auto":
        raise ValueError(f"style: expected one of {BYTE_STYLES}, got {style!r}")
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget for one gradient computation: exactly one of ``bytes`` or ``fraction``.

    Attributes:
      bytes: the predicted peak of the training step's forward + backward pass may not exceed
        this many bytes. Needs static shapes (a ``None`` batch dimension makes sizes unknown).
      fraction: the predicted peak may not exceed this fraction of the predicted peak of plain
        ``tf.gradients`` on the same graph (``0.5``: half the activation memory).
      solver: ``"greedy"`` (fast, the default), ``"dp"`` (exact over cut positions) or
        ``"milp"`` (exact over kept sets, small graphs, needs scipy); see ``solvers``.
      op_seconds: optional calibration: measured seconds per op name (from
        :func:`memsave_grads.measure.profile_op_seconds`); recompute costs then are seconds
        instead of FLOPs from static shapes (see :func:`calibrated_costs`).
      calibration: set by :func:`memsave_grads.calibrate_budget` (never by hand): the budget
        the user asked for and the measured steps that re-aimed ``fraction`` so that the plan
        measures within it (see :class:`Calibration`).
      calibrate: True: hold the budget against *measured* peaks, not predicted ones, where
        the training step can be run before it trains: under ``wrap_model``, ``fit`` and
        ``train_on_batch`` calibrate it (:func:`memsave_grads.calibrate_budget`) on the first
        batch of each batch size (design note "calibrated budgets"). Where no step can be run
        first (``gradients``, ``patch``, ``minimize``) it is refused: calibrate the step
        yourself and pass the result.

    Among the plans whose predicted peak fits, the solver returns one that recomputes least.
    A budget below the smallest predicted peak any plan reaches raises
    :class:`~memsave_grads.errors.InfeasibleBudgetError`, which states that smallest peak;
    under :func:`memsave_grads.patch` and ``wrap_model`` with ``fallback="warn"``, the plan with
    that smallest peak is used instead, with one warning.
    """

    bytes: int | None = None
    fraction: float | None = None
    solver: str = DEFAULT_SOLVER
    op_seconds: Mapping[str, float] | None = dataclasses.field(default=None, compare=False,
                                                               repr=False)
    calibration: "Calibration | None" = dataclasses.field(default=None, compare=False,
                                                          repr=False)
    calibrate: bool = False

    def __post_init__(self):
        if (self.bytes is None) == (self.fraction is None):
            raise errors.InvalidArgumentError(
                f"Budget: expected exactly one of bytes= or fraction=, got bytes={self.bytes!r}, "
                f"fraction={self.fraction!r}. Example: Budget(bytes=4 * 2**30) or "
                "Budget(fraction=0.5).")
        if self.bytes is not None:
            object.__setattr__(self, "bytes", _checked_bytes(self.bytes))
        if self.fraction is not None:
            object.__setattr__(self, "fraction", _checked_fraction(self.fraction))
        if self.op_seconds is not None:
            _check_op_seconds(self.op_seconds)
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise errors.InvalidTypeError(
                f"Budget.calibration: expected a Calibration made by "
                f"memsave_grads.calibrate_budget, got {type(self.calibration).__name__}. Leave "
                "it out and call calibrate_budget(model_or_step, budget).")
        if not isinstance(self.calibrate, bool):
            raise errors.InvalidTypeError(
                f"Budget.calibrate: expected True or False, got {type(self.calibrate).__name__}: "
                f"{self.calibrate!r:.60}.")
        if not isinstance(self.solver, str) or self.solver not in SOLVER_NAMES:
            raise errors.InvalidArgumentError(
                f"Budget.solver: unknown solver {self.solver!r}; expected one of "
                f"{sorted(SOLVER_NAMES)}.")

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """The string form: ``"budget:<amount>[:<solver>][:calibrated]"``.

        ``<amount>`` is bytes with a unit (``4GiB``, ``512MB``, ``1e9B``), a percentage
        (``60%``) or a bare number in (0, 1] (a fraction); ``calibrated`` sets ``calibrate``.
        """
        if not isinstance(text, str):
            raise errors.InvalidTypeError(
                f"checkpoints: expected a budget string such as 'budget:4GiB' or 'budget:60%', "
                f"got {type(text).__name__}: {text!r:.80}.")
        body = text[len(STRING_PREFIX):] if text.startswith(STRING_PREFIX) else text
        amount, *options = body.split(":")
        options = [option.strip() for option in options]
        calibrate = CALIBRATED_WORD in options
        solvers = [option for option in options if option != CALIBRATED_WORD]
        if len(solvers) > 1 or options.count(CALIBRATED_WORD) > 1:
            raise errors.InvalidArgumentError(
                f"checkpoints: malformed budget {text!r}: after the amount, expected at most a "
                f"solver ({', '.join(SOLVER_NAMES)}) and '{CALIBRATED_WORD}', got "
                f"{':'.join(options)!r}. Example: 'budget:50%:dp:{CALIBRATED_WORD}'.")
        solver = solvers[0] if solvers else ""
        if solver and solver not in SOLVER_NAMES:
            raise errors.InvalidArgumentError(
                f"checkpoints: budget {text!r} has an unknown solver {solver!r}; expected one "
                f"of {', '.join(SOLVER_NAMES)}, or '{CALIBRATED_WORD}'. Example: "
                f"'budget:50%:{CALIBRATED_WORD}'.")
        example = ("Examples: 'budget:4GiB', 'budget:512MiB', 'budget:60%', 'budget:0.6', "
                   f"'budget:60%:milp', 'budget:60%:{CALIBRATED_WORD}'.")
        match = _AMOUNT.match(amount)
        if not match:
            raise errors.InvalidArgumentError(
                f"checkpoints: malformed budget {text!r}: expected bytes with a unit, a "
                f"percentage or a fraction after 'budget:'. {example}")
        value, unit = float(match.group(1)), match.group(2).lower()
        solver = solver.strip() or DEFAULT_SOLVER
        if unit == "%":
            return cls._from_text(text, fraction=value / 100, solver=solver,
                                  calibrate=calibrate)
        if not unit:
            if value > 1:
                raise errors.InvalidArgumentError(
                    f"checkpoints: budget {text!r} has no unit; a bare number is a fraction in "
                    f"(0, 1]. Write bytes with a unit ('{match.group(1)}B', "
                    f"'{match.group(1)}MiB') or a percentage. {example}")
            return cls._from_text(text, fraction=value, solver=solver,
                                  calibrate=calibrate)
        if unit not in BYTE_UNITS:
            raise errors.InvalidArgumentError(
                f"checkpoints: budget {text!r} has an unknown unit {match.group(2)!r}; expected "
                f"one of {sorted(BYTE_UNITS)} (case-insensitive) or %. {example}")
        nbytes = value * BYTE_UNITS[unit]
        # "1e999B" reads as inf: int() of it would raise a bare OverflowError.
        if not nbytes <= MAX_BUDGET_BYTES:
            raise errors.InvalidArgumentError(
                f"checkpoints: budget {text!r} is larger than the largest budget, "
                f"{MAX_BUDGET_BYTES} bytes (8 EiB). Pass the memory the step may use, such as "
                f"'budget:4GiB', or a fraction. {example}")
        return cls._from_text(text, bytes=int(nbytes), solver=solver, calibrate=calibrate)

    @classmethod
    def _from_text(cls, text: str, **fields) -> "Budget":
        """``cls(**fields)``, its refusal naming the string the user wrote (``budget:150%``
        rather than the fraction 1.5 it reads as)."""
        try:
            return cls(**fields)
        except errors.InvalidArgumentError as e:
            raise errors.InvalidArgumentError(f"checkpoints: budget {text!r}: {e}") from None

    def __repr__(self) -> str:
        fields = (f"bytes={self.bytes!r}, fraction={self.fraction!r}, solver={self.solver!r}")
        if self.calibrate:
            fields += ", calibrate=True"
        if self.calibration is not None:
            fields += f", calibrated_from={self.calibration.asked!r}"
        return f"Budget({fields})"

    def describe(self) -> str:
        if self.calibration is not None:
            return (f"{dataclasses.replace(self.calibration.asked, calibrate=False).describe()}"
                    f", calibrated: planned at "
                    f"{self.fraction:.1%} of the predicted plain peak")
        amount = format_bytes(self.bytes) if self.bytes is not None else _percent(self.fraction)
        return f"budget {amount} ({self.solver}{', to calibrate' if self.calibrate else ''})"

    def resolve_bytes(self, plain_peak_bytes: int) -> int:
        """The budget in bytes, given plain ``tf.gradients``' predicted peak."""
        if self.bytes is not None:
            return self.bytes
        return int(self.fraction * plain_peak_bytes)


@dataclasses.dataclass(frozen=True)
class CalibrationTry:
    """One measured plan: planned at ``planned_fraction`` of the predicted plain peak, its step
    measured ``measured_bytes``."""

    planned_fraction: float
    measured_bytes: int


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`memsave_grads.calibrate_budget` measured (design note "calibrated budgets").

    Attributes:
      asked: the budget as the user gave it.
      target_bytes: what the measured step peak may reach: ``asked.fraction`` of the measured
        plain step, or ``asked.bytes``.
      plain_measured_bytes: the measured peak of the plain ``tf.gradients`` step.
      tries: the measured plans, in the order tried.
      step: how the measured step was made, for the record (``"Keras fit step, batch
        dimension unknown"``).
      batch_size: the examples per batch of the measured step (a Keras model's), or None (a
        step function). A step traced with an unknown batch size is planned for it where no
        other batch size is known (``memsave_grads.keras.train_step``).
    """

    asked: "Budget"
    target_bytes: int
    plain_measured_bytes: int
    tries: tuple[CalibrationTry, ...]
    step: str = ""
    batch_size: int | None = None

    @property
    def held(self) -> CalibrationTry | None:
        """The try the calibrated budget plans at: of the tries that held, the one with the
        largest planned fraction (the least recompute), or rather the smallest fraction that
        measured the same peak (the same plan): a fraction at the top of a plan's span sits
        next to the plan above, and the memory model of another trace of the same step (a
        fresh process, fit's) may put the boundary a little lower (measured: a Keras 3
        Transformer at 96.9%, the plain step's 272 MiB in a fresh process instead of 142)."""
        within = [t for t in self.tries if t.measured_bytes <= self.target_bytes]
        if not within:
            return None
        best = max(within, key=lambda t: t.planned_fraction)
        same_plan = [t for t in within
                     if abs(t.measured_bytes - best.measured_bytes) <= 0.01 * abs(best.measured_bytes)]
        return min(same_plan, key=lambda t: t.planned_fraction)

    def __str__(self) -> str:
        lines = [f"{self.asked.describe()}: target {format_bytes(self.target_bytes)} of "
                 f"measured step peak (plain tf.gradients measured "
                 f"{format_bytes(self.plain_measured_bytes)}"
                 f"{'; ' + self.step if self.step else ''})"]
        for t in self.tries:
            verdict = "held" if t.measured_bytes <= self.target_bytes else "missed"
            lines.append(f"  planned at {t.planned_fraction:6.1%} of predicted plain: measured "
                         f"{format_bytes(t.measured_bytes)} "
                         f"({t.measured_bytes / self.target_bytes:.2f} x target, {verdict})")
        return "\n".join(lines)


def is_budget_string(value) -> bool:
    return isinstance(value, str) and value.startswith(STRING_PREFIX)


def as_budget(checkpoints) -> Budget | None:
    """``checkpoints`` as a :class:`Budget` where it is one or its string form, else None
    (a strategy name, a list)."""
    if isinstance(checkpoints, Budget):
        return checkpoints
    return Budget.parse(checkpoints) if is_budget_string(checkpoints) else None


def _checked_bytes(value) -> int:
    """``Budget.bytes`` as a builtin int, or our error. NumPy integers and floats are numbers
    too (``numbers.Integral``/``Real``); ints are compared as ints because ``float(10**400)``
    itself overflows."""
    example = "Example: Budget(bytes=4 * 2**30) for 4 GiB."
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise errors.InvalidArgumentError(
            f"Budget.bytes: expected a positive number of bytes, got "
            f"{type(value).__name__}: {value!r:.80}. {example}")
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
    elif math.isfinite(float(value)):
        nbytes = int(float(value))
    else:
        nbytes = None
    if nbytes is None or not 1 <= nbytes <= MAX_BUDGET_BYTES:
        raise errors.InvalidArgumentError(
            f"Budget.bytes: expected a positive number of bytes up to {MAX_BUDGET_BYTES} (8 EiB), "
            f"got {value!r:.80}. {example}")
    return nbytes


def _checked_fraction(value) -> float:
    """``Budget.fraction`` as a builtin float in (0, 1], or our error (NumPy scalars accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not 0 < float(value) <= 1:
        raise errors.InvalidArgumentError(
            f"Budget.fraction: expected a number in (0, 1] (a share of tf.gradients' "
            f"predicted peak), got {value!r:.80}. Example: Budget(fraction=0.5).")
    return float(value)


def _check_op_seconds(op_seconds) -> None:
    if not isinstance(op_seconds, Mapping) or not all(
            isinstance(name, str) and isinstance(seconds, numbers.Real)
            and not isinstance(seconds, bool) and math.isfinite(float(seconds)) and seconds >= 0
            for name, seconds in op_seconds.items()):
        raise errors.InvalidArgumentError(
            f"Budget.op_seconds: expected a mapping from op name (str) to measured seconds "
            f"(a finite number >= 0), got {op_seconds!r:.80}. Pass the result of "
            "memsave_grads.profile_op_seconds(...), or leave it out to use FLOP estimates.")


def smallest_peak_budget(error: errors.InfeasibleBudgetError, asked: Budget) -> Budget | None:
    """``asked`` re-aimed at the smallest predicted peak ``error`` reports, or ``None`` where
    plain ``tf.gradients`` is predicted to peak no higher (then it is the smallest-peak plan).

    The new budget is a fraction of the plain peak, not bytes, so that it also applies where
    sizes are unknown (a ``None`` batch dimension refuses byte budgets); it is rounded up so
    that it resolves to at least ``min_feasible_bytes``.
    """
    smallest, plain = error.min_feasible_bytes, error.plain_peak_bytes
    if smallest is None or not plain or smallest >= plain:
        return None
    fraction = min(math.nextafter(smallest / plain, math.inf), 1.0)
    return dataclasses.replace(asked, bytes=None, fraction=fraction)


# --------------------------------------------------------------------------------------------
# Recompute costs calibrated from a measured profile
# --------------------------------------------------------------------------------------------


def _percent(fraction: float) -> str:
    """``0.5`` as ``50%``, ``0.005`` as ``0.5%``: whole percents where they are exact."""
    percent = fraction * 100
    return f"{percent:.0f}%" if abs(percent - round(percent)) < 1e-9 else f"{percent:.3g}%"


def calibrated_costs(names: Sequence[str], flops: Sequence[float],
                     op_seconds: Mapping[str, float]) -> tuple[float, ...]:
    """Recompute costs in seconds: measured where the profile has the op, else FLOPs times the
    median seconds-per-FLOP of the measured ops (so unmeasured ops stay comparable).

    Graph optimisation may fuse or rename ops in the profile; ops it does not name fall back to
    the FLOP estimate. With no usable measurement, the FLOP estimates are returned unchanged.
    """
    rates = [op_seconds[name] / f for name, f in zip(names, flops)
             if name in op_seconds and f > 0 and op_seconds[name] > 0]
    if not rates:
        _LOG.warning(
            "memsave_grads: Budget.op_seconds names none of this graph's %d forward ops with a "
            "positive time (it names %d, such as %.60r); planning with FLOP estimates. Profile "
            "this graph's plain training step (memsave_grads.profile_op_seconds).",
            len(names), len(op_seconds), next(iter(op_seconds), None))
        return tuple(float(f) for f in flops)
    seconds_per_flop = statistics.median(rates)
    return tuple(float(op_seconds[name]) if name in op_seconds else f * seconds_per_flop
                 for name, f in zip(names, flops))
