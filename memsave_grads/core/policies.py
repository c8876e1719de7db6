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


#: Op types whose gradient reads none of their (float) inputs, only shapes or the incoming
#: gradient: an output consumed only by such ops need not stay alive for the backward pass.
GRADIENT_IGNORES_INPUTS_OP_TYPES = frozenset({
    "Add", "AddV2", "AddN", "Sub", "Neg", "Identity", "IdentityN", "StopGradient",
    "PreventGradient", "Reshape", "Transpose", "ConcatV2", "Concat", "Pad", "PadV2", "MirrorPad",
    "Mean", "Sum", "Cast", "StridedSlice", "Slice", "Split", "SplitV", "Unpack", "Pack",
    "ExpandDims", "Squeeze", "BroadcastTo", "Tile", "BiasAdd", "AvgPool", "AvgPool3D",
    "GatherV2", "ResourceGather", "Shape", "ZerosLike", "OnesLike",
    # These read their own *output* (GRADIENT_READS_OUTPUT_OP_TYPES), not their input.
    "Relu", "Relu6", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Exp", "Sqrt", "Rsqrt", "Elu",
    "Selu", "Reciprocal", "Inv",
})

#: Op types whose gradient reads their own output.
GRADIENT_READS_OUTPUT_OP_TYPES = frozenset({
    "Relu", "Relu6", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Exp", "Sqrt", "Rsqrt", "Elu",
    "Selu", "Reciprocal", "Inv", "MaxPool", "MaxPoolV2", "MaxPool3D",
    # Returns the per-example gradient as a second output, which its gradient reads.
    "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
})

#: Op types whose output is an alias of memory that exists anyway (a variable's buffer).
ALIAS_OP_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "Placeholder", "Const"})

#: Op types whose output shares its input's buffer (no new memory): while the output is needed,
#: the input's buffer is.
VIEW_OP_TYPES = frozenset({"Identity", "Reshape", "ExpandDims", "Squeeze", "StopGradient",
                           "PreventGradient", "Snapshot"})


#: Op types whose gradient w.r.t. one input reads only the *other* inputs (d(xy)/dx = y): an
#: input is read only when another input needs a gradient. ``0.5 * x`` does not keep ``x``:
#: the constant's gradient, the only one that reads ``x``, is pruned from the step.
GRADIENT_READS_OTHER_INPUTS_OP_TYPES = frozenset({
    "Mul", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Einsum",
})

#: Op types whose gradient reads the numerator only for the denominator's gradient
#: (d(x/y)/dx = 1/y): ``x / 2.0`` does not keep ``x``.
GRADIENT_READS_NUMERATOR_FOR_DENOMINATOR_OP_TYPES = frozenset({"RealDiv", "Div", "DivNoNan"})

#: Elementwise op types whose kernel writes its output into an input's buffer when nothing
#: else holds that input (``forward_input_or_allocate_output``): the op then allocates nothing.
#: Their gradient kernels do the same with the incoming gradient.
FORWARDS_INPUT_BUFFER_OP_TYPES = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "Neg", "Square", "SquaredDifference",
    "Maximum", "Minimum", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Exp",
    "Log", "Sqrt", "Rsqrt", "Erf", "Erfc", "Softplus", "BiasAdd", "Softmax", "LogSoftmax",
    "Abs", "Sign", "Reciprocal", "Inv",
})


def gradient_reads_input(op_type: str, index: int, differentiable: list[bool]) -> bool:
    """Whether an op's gradient reads its input ``index``, given which of its inputs need a
    gradient (``differentiable[i]``: input ``i`` depends on ``xs``)."""
    if not gradient_reads_inputs(op_type):
        return False
    others = any(d for i, d in enumerate(differentiable) if i != index)
    if op_type in GRADIENT_READS_OTHER_INPUTS_OP_TYPES:
        return others
    if op_type in GRADIENT_READS_NUMERATOR_FOR_DENOMINATOR_OP_TYPES and index == 0:
        return len(differentiable) > 1 and differentiable[1]
    return True


def forwards_input_buffer(op_type: str) -> bool:
    return op_type in FORWARDS_INPUT_BUFFER_OP_TYPES


def gradient_reads_inputs(op_type: str) -> bool:
    """Whether an op's gradient reads its inputs (unknown types: assume it does)."""
    return op_type not in GRADIENT_IGNORES_INPUTS_OP_TYPES


def gradient_reads_output(op_type: str) -> bool:
    return op_type in GRADIENT_READS_OUTPUT_OP_TYPES
