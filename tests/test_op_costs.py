"""``op_flops`` and ``tensor_bytes`` (memsave_grads/_tf/graph.py) on real ops.

They set every node's recompute cost and every size in the graph model, so every budget, plan
and predicted peak rests on them. Each expected value is worked out by hand in the test from the
op's shapes, never read back from the function.
"""

import numpy as np
import pytest
import tensorflow as tf

from memsave_grads._tf import graph as tf_graph


def _zeros(shape, dtype=tf.float32):
    return tf.zeros(shape, dtype=dtype)


def _placeholder(shape, dtype=tf.float32):
    return tf.compat.v1.placeholder(dtype, shape)


# --------------------------------------------------------------------------------------------
# tensor_bytes: static shape x item size; unknown dimensions count as 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, itemsize", [
    (tf.float32, 4), (tf.float64, 8), (tf.float16, 2), (tf.bfloat16, 2), (tf.int8, 1),
    (tf.int32, 4), (tf.int64, 8), (tf.bool, 1), (tf.complex64, 8), (tf.complex128, 16)])
def test_bytes_of_a_static_shape(graph, dtype, itemsize):
    assert tf_graph.tensor_bytes(_placeholder([3, 4, 5], dtype)) == 3 * 4 * 5 * itemsize


def test_a_scalar_is_one_element(graph):
    assert tf_graph.tensor_bytes(_placeholder([], tf.float64)) == 8


def test_an_empty_tensor_has_no_bytes(graph):
    assert tf_graph.tensor_bytes(_placeholder([3, 0, 5])) == 0


def test_unknown_dimensions_count_as_one(graph):
    assert tf_graph.tensor_bytes(_placeholder([None, 7])) == 7 * 4
    assert tf_graph.tensor_bytes(_placeholder([None, 7, None])) == 7 * 4
    assert tf_graph.tensor_bytes(_placeholder([None, None], tf.float64)) == 8


def test_unknown_rank_is_one_element(graph):
    assert tf_graph.tensor_bytes(_placeholder(None, tf.int64)) == 8


def test_resource_variant_and_string_tensors_count_no_bytes(graph):
    # TensorFlow gives these dtypes item size 0: a variable handle's buffer is the variable's
    # (resident anyway), and a list's or a string's size is not in its static shape.
    variable = tf.Variable(_zeros([64, 64]))
    assert variable.handle.dtype == tf.resource
    assert tf_graph.tensor_bytes(variable.handle) == 0
    tensor_list = tf.raw_ops.EmptyTensorList(element_shape=[2], max_num_elements=3,
                                             element_dtype=tf.float32)
    assert tensor_list.dtype == tf.variant
    assert tf_graph.tensor_bytes(tensor_list) == 0
    assert tf_graph.tensor_bytes(tf.constant(["a long string"] * 5)) == 0


def test_op_bytes_sum_every_output(graph):
    values, _ = tf.nn.top_k(_zeros([6, 10]), k=3)
    # values: 6 x 3 float32; indices: 6 x 3 int32
    assert tf_graph.op_bytes(values.op) == 6 * 3 * 4 + 6 * 3 * 4
    left, right = tf.split(_zeros([4, 6]), [2, 4], axis=1)
    assert left.op is right.op
    assert tf_graph.op_bytes(left.op) == 4 * 2 * 4 + 4 * 4 * 4


def test_an_op_without_outputs_has_no_bytes(graph):
    assert tf_graph.op_bytes(tf.no_op()) == 0


# --------------------------------------------------------------------------------------------
# op_flops: exact for matmuls, convolutions and einsum (a multiply-add counts 2)
# --------------------------------------------------------------------------------------------


def _flops(t) -> float:
    return tf_graph.op_flops(t.op)


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False),
                                                      (False, True), (True, True)])
def test_matmul_is_2mkn(graph, transpose_a, transpose_b):
    m, k, n = 3, 5, 7
    a = _zeros([k, m] if transpose_a else [m, k])
    b = _zeros([n, k] if transpose_b else [k, n])
    product = tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    assert product.op.type == "MatMul"
    assert _flops(product) == 2 * m * k * n


@pytest.mark.parametrize("adjoint_a", [False, True])
def test_batch_matmul_is_2mkn_per_batch(graph, adjoint_a):
    batch, m, k, n = 4, 3, 5, 7
    a = _zeros([batch, k, m] if adjoint_a else [batch, m, k])
    product = tf.matmul(a, _zeros([batch, k, n]), adjoint_a=adjoint_a)
    assert product.op.type.startswith("BatchMatMul")
    assert _flops(product) == 2 * batch * m * k * n


def test_batch_matmul_counts_broadcast_batches(graph):
    # [2, 1, 3, 5] @ [4, 5, 7]: the batch dimensions broadcast to [2, 4]: 8 products of 3x5x7.
    product = tf.matmul(_zeros([2, 1, 3, 5]), _zeros([4, 5, 7]))
    assert product.shape == [2, 4, 3, 7]
    assert _flops(product) == 2 * (2 * 4) * 3 * 5 * 7


@pytest.mark.parametrize("strides, padding, out_hw", [(1, "SAME", 8), (2, "SAME", 4),
                                                      (1, "VALID", 6), (2, "VALID", 3)])
def test_conv2d_is_2_x_output_x_window(graph, strides, padding, out_hw):
    # NHWC: each output element sums a 3 x 3 x 3 window: 27 multiply-adds. VALID: (8 - 3) /
    # stride + 1 positions (rounded down); SAME: 8 / stride (rounded up).
    batch, channels_in, channels_out = 2, 3, 4
    kernel = _zeros([3, 3, channels_in, channels_out])
    out = tf.nn.conv2d(_zeros([batch, 8, 8, channels_in]), kernel, strides=strides,
                       padding=padding)
    assert out.op.type == "Conv2D" and out.shape == [batch, out_hw, out_hw, channels_out]
    assert _flops(out) == 2 * (batch * out_hw * out_hw * channels_out) * (3 * 3 * channels_in)


def test_depthwise_conv_is_2_x_output_x_spatial_window(graph):
    # Each output channel reads one input channel: a 3 x 3 window, not 3 x 3 x channels.
    channels_in, multiplier = 3, 2
    out = tf.nn.depthwise_conv2d(_zeros([1, 6, 6, channels_in]),
                                 _zeros([3, 3, channels_in, multiplier]),
                                 strides=[1, 1, 1, 1], padding="SAME")
    assert out.op.type == "DepthwiseConv2dNative"
    assert _flops(out) == 2 * (6 * 6 * channels_in * multiplier) * (3 * 3)


def test_transposed_conv_is_the_forward_conv_it_reverses(graph):
    # conv2d_transpose of a [1, 4, 4, 8] map to [1, 4, 4, 2] with a [3, 3, 2, 8] kernel: each of
    # the 32 output elements sums a 3 x 3 x 8 window.
    out = tf.nn.conv2d_transpose(_zeros([1, 4, 4, 8]), _zeros([3, 3, 2, 8]),
                                 output_shape=[1, 4, 4, 2], strides=1, padding="SAME")
    assert out.op.type == "Conv2DBackpropInput"
    assert _flops(out) == 2 * (4 * 4 * 2) * (3 * 3 * 8)


@pytest.mark.parametrize("equation, shapes, output_elements, contracted", [
    ("bij,bjk->bik", ([2, 3, 4], [2, 4, 5]), 2 * 3 * 5, 4),
    ("...ij,jk->...ik", ([2, 6, 3, 4], [4, 5]), 2 * 6 * 3 * 5, 4),
    ("ij,ij->i", ([3, 4], [3, 4]), 3, 4),
    ("ij,kl->ijkl", ([2, 3], [4, 5]), 2 * 3 * 4 * 5, 1),  # an outer product: nothing summed
    ("bhqd,bhkd->bhqk", ([2, 4, 6, 8], [2, 4, 7, 8]), 2 * 4 * 6 * 7, 8),  # attention scores
])
def test_einsum_is_2_x_output_x_contracted(graph, equation, shapes, output_elements, contracted):
    out = tf.einsum(equation, *(_zeros(s) for s in shapes))
    assert out.op.type == "Einsum"
    assert _flops(out) == 2 * output_elements * contracted


# --------------------------------------------------------------------------------------------
# op_flops: every other op counts one per element of its largest input or output
# --------------------------------------------------------------------------------------------


def test_elementwise_ops_count_one_per_element(graph):
    x = _zeros([3, 4])
    assert _flops(tf.tanh(x)) == 12
    assert _flops(x * x) == 12
    assert _flops(x + _zeros([4])) == 12  # a broadcast operand: the output is the largest
    assert _flops(tf.cast(x, tf.float64)) == 12


def test_reductions_and_copies_count_their_largest_tensor(graph):
    x = _zeros([3, 4])
    assert _flops(tf.reduce_sum(x)) == 12  # the input, not the scalar output
    assert _flops(tf.tile(x, [2, 5])) == 3 * 4 * 2 * 5  # the output
    assert _flops(tf.concat([x, _zeros([3, 6])], axis=1)) == 3 * 10


def test_multi_output_ops_count_their_largest_tensor(graph):
    left, _ = tf.split(_zeros([4, 6]), [2, 4], axis=1)
    assert _flops(left) == 24  # the input
    values, _ = tf.nn.top_k(_zeros([6, 10]), k=3)
    assert _flops(values) == 60


def test_aliases_of_resident_memory_cost_nothing(graph):
    variable = tf.Variable(_zeros([64, 64]))
    read = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.float32)
    assert read.op.type == "ReadVariableOp" and _flops(read) == 0
    assert variable.handle.op.type == "VarHandleOp" and tf_graph.op_flops(variable.handle.op) == 0
    constant = tf.constant(np.ones([64, 64], np.float32))
    assert constant.op.type == "Const" and _flops(constant) == 0
    assert _flops(_placeholder([64, 64])) == 0


def test_ops_without_outputs_cost_nothing(graph):
    assert tf_graph.op_flops(tf.no_op()) == 0
    variable = tf.Variable(_zeros([64, 64]))
    assign = variable.assign(_zeros([64, 64]), read_value=False)
    assert not assign.outputs and tf_graph.op_flops(assign) == 0


def test_resource_inputs_are_not_elements(graph):
    # ResourceGather reads a [1000, 16] variable through its (scalar) handle: it costs the
    # rows it gathers, 2 x 16, not the variable.
    variable = tf.Variable(_zeros([1000, 16]))
    rows = tf.gather(variable, [3, 7])
    assert rows.op.type == "ResourceGather"
    assert _flops(rows) == 2 * 16


# --------------------------------------------------------------------------------------------
# Unknown dimensions count as 1, in costs as in sizes
# --------------------------------------------------------------------------------------------


def test_unknown_batch_counts_as_one(graph):
    x = _placeholder([None, 5])
    assert _flops(tf.tanh(x)) == 5
    assert _flops(tf.matmul(x, _zeros([5, 7]))) == 2 * 1 * 5 * 7
    out = tf.nn.conv2d(_placeholder([None, 8, 8, 3]), _zeros([3, 3, 3, 4]), 1, "SAME")
    assert _flops(out) == 2 * (1 * 8 * 8 * 4) * (3 * 3 * 3)


def test_unknown_contracted_dimension_counts_as_one(graph):
    # [3, ?] @ [?, 7]: the output is known, the sum's length is not: 1 multiply-add per output.
    product = tf.matmul(_placeholder([3, None]), _placeholder([None, 7]))
    assert _flops(product) == 2 * 3 * 7 * 1


def test_unknown_rank_counts_as_one_element(graph):
    assert _flops(tf.tanh(_placeholder(None))) == 1
    # ij,jk->ik with i unknown: the output [?, 5] has 5 elements, each a sum over j = 4.
    product = tf.einsum("ij,jk->ik", _placeholder(None), _zeros([4, 5]))
    assert product.shape.as_list() == [None, 5]
    assert _flops(product) == 2 * 5 * 4


def test_a_conv_with_an_unknown_kernel_is_costed_from_what_is_known(graph):
    # A kernel of unknown rank counts 1 element and 1 output channel: 1 multiply-add for each
    # of the output's 8 x 8 known elements (its channels are unknown too).
    out = tf.nn.conv2d(_zeros([1, 8, 8, 3]), _placeholder(None), 1, "SAME")
    assert out.op.type == "Conv2D" and out.shape.as_list() == [1, 8, 8, None]
    assert _flops(out) == 2 * (8 * 8) * 1


# --------------------------------------------------------------------------------------------
# param_bytes: the variable gradients each backward step produces
# --------------------------------------------------------------------------------------------


def _param_bytes(loss, variables, held):
    from memsave_grads import api  # pylint: disable=import-outside-toplevel
    import contextlib  # pylint: disable=import-outside-toplevel
    with api.gradients_applied_together() if held else contextlib.nullcontext():
        ctx = api.prepare(loss, variables, None, [], {},
                          select=False).selection
    model = ctx.model
    return ({op.type: b for op, b in zip(ctx.region, model.param_bytes) if b},
            sum(model.param_bytes))


def test_a_shared_weight_is_held_once_and_a_gathered_table_by_its_rows(graph):
    """A 64 x 64 float32 weight (16 KiB) read by two matmuls: each backward step produces a
    partial of 16 KiB, but held for the optimizer the partials are one summed buffer, so it
    counts once. A 1000 x 64 embedding table (250 KiB) gathered at 8 rows: its gradient is
    IndexedSlices of those rows (2 KiB), whatever the table's size."""
    with tf.Graph().as_default():
        w = tf.Variable(tf.ones([64, 64]))
        table = tf.Variable(tf.ones([1000, 64]))
        rows = tf.gather(table, tf.constant([1, 2, 3, 4, 5, 6, 7, 8]))       # [8, 64]
        h = tf.matmul(tf.tanh(tf.matmul(rows, w)), w)
        loss = tf.reduce_sum(h)
        variables = [w, table]
        _, spiky_total = _param_bytes(loss, variables, held=False)
        by_type, held_total = _param_bytes(loss, variables, held=True)
    weight, gathered = 64 * 64 * 4, 8 * 64 * 4
    assert spiky_total == 2 * weight + gathered
    assert held_total == weight + gathered
    assert by_type.get("GatherV2", by_type.get("ResourceGather")) == gathered
