"""Markdown tables and the numbers in them, shared by every command's report (TensorFlow-free:
the fit-limit child processes format nothing, but the parent formats before it imports
TensorFlow)."""

from __future__ import annotations

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
