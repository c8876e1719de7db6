"""Local checkpoint predicates: decide from one operation or name whether to keep its outputs.

These are small, named and TensorFlow-free (they look at op *types* and *names*, strings), so a
strategy reads as a sentence: ``"speed"`` keeps :func:`is_expensive_op_type` outputs.
"""

from __future__ import annotations

import fnmatch
import re

#: Op types whose outputs are expensive to recompute (dense linear algebra and convolutions).
#: ``"speed"`` keeps their outputs and recomputes the cheap elementwise ops between them.
EXPENSIVE_OP_TYPES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "SparseMatMul",
    "Conv1D", "Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "FusedConv2DBiasActivation",
    "_FusedConv2D", "_FusedMatMul", "Einsum", "XlaEinsum",
})

#: Op types that belong to TF1 (v1) control flow: copying them needs their control-flow context.
V1_CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
})


def is_expensive_op_type(op_type: str) -> bool:
    """True for matmul/convolution/einsum-like op types (the ``"speed"`` strategy)."""
    return op_type in EXPENSIVE_OP_TYPES


_PATTERN_OK = re.compile(r"^[^\s]+$")


def pattern_error(pattern: object) -> str | None:
    """Why ``pattern`` is not a usable name pattern, or ``None`` when it is."""
    if not isinstance(pattern, str):
        return f"expected a str, got {type(pattern).__name__}"
    if not pattern:
        return "the pattern is empty"
    if not _PATTERN_OK.match(pattern):
        return "the pattern contains whitespace, which never occurs in TensorFlow names"
    if pattern.count(":") > 1:
        return "a pattern holds at most one ':' (before an output index, as in 'dense/Relu:0')"
    if pattern.count("[") != pattern.count("]"):
        return "unbalanced '[' ']' in the pattern"
    return None


def matches_tensor(pattern: str, op_name: str, output_index: int) -> bool:
    """Name-pattern rule (documented in docs/usage.md).

    Patterns are shell-style globs (``fnmatch``, case-sensitive) matched against the *whole*
    name. A pattern with a ``:`` is matched against the tensor name (``"block3/add:0"``);
    a pattern without one is matched against the op name (``"block*/add"``), selecting every
    output of the matching ops.
    """
    if ":" in pattern:
        return fnmatch.fnmatchcase(f"{op_name}:{output_index}", pattern)
    return fnmatch.fnmatchcase(op_name, pattern)
