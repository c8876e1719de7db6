"""Markdown tables and the numbers in them, shared by every command's report (TensorFlow-free:
the fit-limit child processes format nothing, but the parent formats before it imports
TensorFlow)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


def number(value: float) -> str:
    """Three significant digits or so: 1234, 123, 12.3, 1.23, 0.123."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def markdown_table(header: Sequence[str], align: Sequence[str],
                   rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; ``align`` has one letter per column, ``r`` (right) or ``l``."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plain_data(value):
    """``value`` as JSON-ready data, the one conversion behind every command's ``--format
    json``: a dataclass as the dict of its fields, a mapping or sequence item by item, numbers,
    strings, booleans and None as they are (a float that is not finite as None), anything else
    (a Budget, a tensor) as its ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
