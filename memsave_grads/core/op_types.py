"""Every fact memsave_grads knows about TensorFlow op *types*, in one table.

TensorFlow-free on purpose: an op type is a string (``op.type``, ``NodeDef.op``), so the memory
model, the planners and the TF-facing code (``_tf/``) all read the same sets, and a new op type
is taught to the package here and only here.

The facts fall in four groups:

- **cost**: which ops are expensive to recompute (:data:`EXPENSIVE_OP_TYPES`, split by the
  formula ``_tf.graph.op_flops`` counts them with);
- **buffers**: which outputs own no memory of their own (:data:`ALIAS_OP_TYPES`, the views),
  and which kernels write into an input's buffer (:data:`FORWARDS_INPUT_BUFFER_OP_TYPES`);
- **gradients**: which forward values an op's gradient reads (:func:`gradient_reads_input`,
  :func:`gradient_reads_output`), which decides what must stay alive for the backward pass;
- **graph structure**: function calls, TF1 control flow, while loops and variable reads, which
  the rewrite treats specially.

A type missing from a set gets the conservative answer: expensive no, view no, gradient reads
its inputs yes. A missing type can cost memory, never correctness.
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------

#: Dense matrix products: ``2 x output elements x the contracted dimension`` FLOPs.
MATMUL_OP_TYPES = frozenset({"MatMul", "_FusedMatMul", "SparseMatMul"})
#: Batched matrix products (the contracted dimension is the last of ``x``, or the one before
#: it under ``adj_x``).
BATCH_MATMUL_OP_TYPES = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
#: Convolutions whose kernel is ``[*spatial, in/groups, out]``: every output element costs one
#: multiply-add per kernel element of its output channel.
CONVOLUTION_OP_TYPES = frozenset({"Conv1D", "Conv2D", "Conv3D", "_FusedConv2D",
                                  "FusedConv2DBiasActivation"})
#: Depthwise convolutions (kernel ``[h, w, in, multiplier]``): one multiply-add per window pixel.
DEPTHWISE_CONVOLUTION_OP_TYPES = frozenset({"DepthwiseConv2dNative"})
#: Transposed convolutions (``Conv2DTranspose`` is the input gradient of a convolution): the
#: cost follows the *gradient* input's elements, the kernel being ``[*spatial, out, in]``.
TRANSPOSED_CONVOLUTION_OP_TYPES = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2"})
#: Einsum: ``2 x output elements x the product of the contracted dimensions``.
EINSUM_OP_TYPES = frozenset({"Einsum", "XlaEinsum"})

#: Op types whose outputs are expensive to recompute: exactly those with a contraction formula
#: above (dense linear algebra and convolutions). Everything else costs about one operation per
#: element, so recomputing it is cheap next to these; the ``"speed"`` policy keeps these and
#: recomputes the rest, and the planners break ties toward keeping them.
EXPENSIVE_OP_TYPES = (MATMUL_OP_TYPES | BATCH_MATMUL_OP_TYPES | CONVOLUTION_OP_TYPES
                      | DEPTHWISE_CONVOLUTION_OP_TYPES | TRANSPOSED_CONVOLUTION_OP_TYPES
                      | EINSUM_OP_TYPES)


def einsum_operand_reordered(equation: str, index: int) -> bool:
    """Whether XLA lowers operand ``index`` (0 or 1) of the two-operand einsum ``equation``
    through a transpose of it. A dot reads an operand in place when its batch dimensions lead
    and it has at most one free and one contracted dimension, in either order (``"bsd,ed->bse"``:
    the dot contracts ``W``'s second dimension as it is); otherwise XLA first transposes it
    into batch, free, contracted order (left operand) or batch, contracted, free (right) unless
    it is in that order already. ``"th,ehm->etm"`` (a mixture of experts' weights: two free
    dimensions ``e``, ``m`` around the contracted ``h``) is transposed; ``"bsd,de->bse"`` is
    not. (Checked against the optimized HLO of TF 2.21's CPU compiler on 97 equations: no
    operand flagged that XLA reads in place.) An ellipsis counts as one label. Forms this does
    not read (a repeated or summed-out label, other than two operands): False, i.e. treated as
    before this rule (its use: a reordered operand of a recomputed einsum waits for the
    gradient, ``_tf/rewrite.py``; design note "memory under XLA")."""
    inputs, _, output = equation.replace(" ", "").replace("...", ".").partition("->")
    operands = inputs.split(",")
    if len(operands) != 2 or index not in (0, 1):
        return False
    mine, other = operands[index], operands[1 - index]
    if len(set(mine)) != len(mine) or any(label not in other + output for label in mine):
        return False
    contracted_rank = 2 if index == 0 else 1  # where the contracted dimensions go
    ranks = [0 if label in other and label in output
             else contracted_rank if label in other else 3 - contracted_rank
             for label in mine]
    if ranks == sorted(ranks):
        return False
    batch = ranks.count(0)
    read_in_place = (ranks[:batch] == [0] * batch and ranks.count(1) <= 1
                     and ranks.count(2) <= 1)
    return not read_in_place


def is_expensive_op_type(op_type: str) -> bool:
    """True for matmul/convolution/einsum-like op types (:data:`EXPENSIVE_OP_TYPES`)."""
    return op_type in EXPENSIVE_OP_TYPES


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------

#: Ops whose value is given from outside the graph (a feed, or a function graph's argument or
#: capture). A copy of one is a new, unfed input: it is never replayed, its value is read.
FEED_OP_TYPES = frozenset({"Placeholder", "PlaceholderWithDefault"})

#: Stateful only so that TensorFlow neither prunes nor folds them: they check their input
#: (and pass it through), so running one again checks the same values again and gives the same
#: output. Replayed like a stateless op (a Keras cell with tf.debugging.check_numerics or an
#: assert recomputes; issue 17's outside check).
CHECK_OP_TYPES = frozenset({"CheckNumerics", "CheckNumericsV2", "Assert"})

#: Ops that draw at random although TensorFlow does not mark them stateful (so neither are the
#: conds, loops and calls holding them): fractional pooling picks its pooling regions anew on
#: every run, unless ``deterministic`` is set with a nonzero ``seed`` or ``seed2`` (then every
#: kernel of the op, a copy's too, seeds its generator alike). A copy would pool other regions
#: than the forward pass did: never replayed (issue 36's outside review).
UNMARKED_RANDOM_OP_TYPES = frozenset({"FractionalMaxPool", "FractionalAvgPool"})

#: TF2 conds (cond_v2); the first is the one TensorFlow marks stateful, still replayable where
#: its branches run only checks and stateless ops.
STATEFUL_COND_OP_TYPE = "If"
COND_OP_TYPES = frozenset({STATEFUL_COND_OP_TYPE, "StatelessIf"})
#: TF2 switch cases (``tf.switch_case``, cond_v2's ``Case``): a branch index and a list of
#: branch functions.
CASE_OP_TYPES = frozenset({"Case", "StatelessCase"})

#: Op types whose output depends only on the *shape* of their input, never on its values: what
#: is computed from them (shape arithmetic, a dropout mask drawn for a dynamic batch size) is
#: constant with respect to ``xs`` and is the same when a copy runs again (design note "unknown
#: batch size"), so the forward region does not extend through them.
SHAPE_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

#: Op types whose output is an alias of memory that exists anyway (a variable's buffer, a
#: constant, a fed value): it costs no bytes and no FLOPs in the memory model.
ALIAS_OP_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "Placeholder", "Const"})

#: Op types that read rows of their first input (a table): the gradient with respect to it is
#: ``IndexedSlices`` of the rows read, the size of the output, not of the table.
GATHER_OP_TYPES = frozenset({"GatherV2", "ResourceGather", "Gather"})

#: Op types whose (single) output always shares its input's buffer: no new memory, and while
#: the output is held, so is the input's buffer. Both users below start from this set.
VIEW_OP_TYPES = frozenset({"Identity", "StopGradient", "PreventGradient", "Reshape",
                           "ExpandDims", "Squeeze"})

#: The memory model's views (``ForwardGraph.views``): :data:`VIEW_OP_TYPES` and ``Snapshot``,
#: which takes over its input's buffer when nothing else holds it and copies otherwise; the
#: model counts it as a view. ``IdentityN`` (tf.custom_gradient's wrapper) is not one here:
#: the model's plans were measured without it, and counting it changes plans, a change to
#: measure rather than make in passing.
MEMORY_MODEL_VIEW_OP_TYPES = VIEW_OP_TYPES | {"Snapshot"}

#: Views of a variable's value (``_tf.early_release.value_readers``): :data:`VIEW_OP_TYPES`
#: and ``IdentityN``, whose every output aliases the input at its position (tf.custom_gradient
#: and Keras wrap values in it). Not ``Snapshot``: the variable always holds its own value, so
#: a snapshot of it is a copy, and its readers do not hold the variable's buffer.
VALUE_VIEW_OP_TYPES = VIEW_OP_TYPES | {"IdentityN"}

#: Elementwise op types whose kernel writes its output into an input's buffer when nothing
#: else holds that input (``forward_input_or_allocate_output``): the op then allocates nothing.
#: Their gradient kernels do the same with the incoming gradient.
FORWARDS_INPUT_BUFFER_OP_TYPES = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "Neg", "Square", "SquaredDifference",
    "Maximum", "Minimum", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Exp",
    "Log", "Sqrt", "Rsqrt", "Erf", "Erfc", "Softplus", "BiasAdd", "Softmax", "LogSoftmax",
    "Abs", "Sign", "Reciprocal", "Inv",
})


def forwards_input_buffer(op_type: str) -> bool:
    """Whether the kernel may take over an input's buffer
    (:data:`FORWARDS_INPUT_BUFFER_OP_TYPES`)."""
    return op_type in FORWARDS_INPUT_BUFFER_OP_TYPES


# --------------------------------------------------------------------------------------------
# Gradients: which forward values the backward pass reads
# --------------------------------------------------------------------------------------------

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

#: Op types whose gradient reads only its first input (the condition of ``SelectV2``: dropout's
#: mask), given static shapes; with a dynamic shape it reads the others' shapes too, which
#: keeps them alive (``_ReduceGradientArgs`` calls ``tf.shape``). ``Select`` (v1) is not one:
#: its gradient takes ``zeros_like`` of an input.
GRADIENT_READS_CONDITION_ONLY_OP_TYPES = frozenset({"SelectV2"})

#: Op types whose output is its inputs' values, passed on or summed, when the values are
#: gradients: ``tf.gradients`` wraps gradients in identities and adds partials with ``AddN``.
#: Followed backward from a gradient they lead to the ops that really compute it (a weight
#: gradient's MatMul), which ``_tf.early_release`` delays.
GRADIENT_PASS_THROUGH_OP_TYPES = frozenset({"Identity", "IdentityN", "AddN", "StopGradient"})

#: Gradient op types that oneDNN's graph pass fuses with a *later* op reading the same incoming
#: gradient, without looking at control edges (seen: a bias gradient with the convolution's
#: filter gradient; a matmul's weight gradient was not fused). Copies must not wait for one:
#: where the later op runs after the copies, the fused op would be both upstream and downstream
#: of them (design note "scheduling"); they wait for its input, the incoming gradient, instead.
FUSED_WITH_LATER_GRADIENT_OP_TYPES = frozenset({"BiasAddGrad"})


def gradient_reads_inputs(op_type: str) -> bool:
    """Whether an op's gradient reads its inputs (unknown types: assume it does)."""
    return op_type not in GRADIENT_IGNORES_INPUTS_OP_TYPES


def gradient_reads_input(op_type: str, index: int, differentiable: list[bool],
                         static_shapes: bool = False) -> bool:
    """Whether an op's gradient reads its input ``index``, given which of its inputs need a
    gradient (``differentiable[i]``: input ``i`` depends on ``xs``) and whether its inputs'
    and outputs' shapes are all static."""
    if not gradient_reads_inputs(op_type):
        return False
    if op_type in GRADIENT_READS_CONDITION_ONLY_OP_TYPES and static_shapes:
        return index == 0
    others = any(d for i, d in enumerate(differentiable) if i != index)
    if op_type in GRADIENT_READS_OTHER_INPUTS_OP_TYPES:
        return others
    if op_type in GRADIENT_READS_NUMERATOR_FOR_DENOMINATOR_OP_TYPES and index == 0:
        return len(differentiable) > 1 and differentiable[1]
    return True


def gradient_reads_output(op_type: str) -> bool:
    """Whether an op's gradient reads its own output (:data:`GRADIENT_READS_OUTPUT_OP_TYPES`)."""
    return op_type in GRADIENT_READS_OUTPUT_OP_TYPES


# --------------------------------------------------------------------------------------------
# Graph structure
# --------------------------------------------------------------------------------------------

#: Ops that call a function by name in their ``f`` attribute (a ``tf.function`` called while
#: another graph is traced; Keras' grouped convolutions call a ``jit_compile`` one). What they
#: cost is what the function runs.
FUNCTION_CALL_OP_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})

#: Op types that belong to TF1 (v1) control flow: copying them needs their control-flow
#: context, which the rewrite does not rebuild, so a region holding one is refused.
V1_CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
})

#: while_v2 loops. Their gradient appends accumulator inputs to the forward op after it was
#: made, so a copy must receive its control dependencies through its inputs (``_tf.rewrite``);
#: their functions' input shapes are in the ``output_shapes`` attribute, not on the inputs.
WHILE_OP_TYPES = frozenset({"While", "StatelessWhile"})

#: Op types that read a resource variable's current value (the read aliases the variable's
#: buffer): a variable's gradient is the sum of its reads' gradients, and a write must wait
#: for the ops still holding a value read before it.
VARIABLE_READ_OP_TYPES = frozenset({"ReadVariableOp"})

#: Op types that read a variable's value through its handle and whose gradient goes to the
#: handle: the value read (``ReadVariableOp``) or rows of it (``ResourceGather``, as
#: ``IndexedSlices``). Where such a read is kept (never replayed), the gradient of its value is
#: sent on to the handle (``_tf.graph.handle_gradient``).
HANDLE_GRADIENT_READ_OP_TYPES = VARIABLE_READ_OP_TYPES | {"ResourceGather"}
