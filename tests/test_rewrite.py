"""What the rewrite adds to the graph, and what it must leave alone."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

import memsave_grads as mg
from conftest import assert_grads_close


def _snapshot(graph):
    return {op.name: (op.type, [t.name for t in op.inputs], [c.name for c in op.control_inputs],
                      op.device, op.node_def.SerializeToString(deterministic=True))
            for op in graph.get_operations()}


def _mlp(depth=6, dropout=False, device=None):
    x = tf.constant(np.random.RandomState(0).randn(4, 8).astype(np.float32), name="x")
    ws = [tf.Variable(np.random.RandomState(i).randn(8, 8).astype(np.float32) / 3, name=f"w{i}")
          for i in range(depth)]
    h = x
    for i, w in enumerate(ws):
        with tf.device(device if device else None):
            h = tf.tanh(tf.matmul(h, w), name=f"layer{i}")
            if dropout:
                h = tf.nn.dropout(h, rate=0.25)
    return x, ws, tf.reduce_sum(h * h, name="loss")


@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_user_graph_is_untouched(graph, session, strategy):
    x, ws, loss = _mlp(dropout=False)
    session.run(tf.compat.v1.global_variables_initializer())
    forward_before = session.run(loss)
    # Snapshot after the first run: Session.run itself rewrites AssignVariableOp attributes.
    before = _snapshot(graph)
    mg.gradients(loss, ws + [x], checkpoints=strategy)
    after = _snapshot(graph)
    assert {name: after[name] for name in before} == before
    assert len(after) > len(before)
    np.testing.assert_allclose(session.run(loss), forward_before)


def test_stateful_ops_are_never_copied(graph):
    x, ws, loss = _mlp(dropout=True)
    before = set(graph.get_operations())
    mg.gradients(loss, ws, checkpoints="memory")
    copies = [op for op in graph.get_operations() if op not in before and "recompute" in op.name]
    assert copies, "expected recomputed segments"
    assert not [op for op in copies if op.op_def.is_stateful], "a stateful op was copied"


@pytest.mark.parametrize("pool", ["max", "avg"])
@pytest.mark.parametrize("form", ["op", "call", "seeded op", "seeded call"])
def test_fractional_pooling_is_never_drawn_again(pool, form):
    """Fractional pooling picks its pooling regions at random on every run although TensorFlow
    does not mark it stateful (nor a tf.function holding it): a copy pooled other regions and
    the gradients came out wrong (outside review: 33.5 off a largest gradient of 56). Seeded
    and deterministic (``seed`` != 0 in tf.nn's wrappers) every kernel pools alike, so it is
    replayed. Both gradients come from one traced step, so the forward pass is shared."""
    fractional = tf.nn.fractional_max_pool if pool == "max" else tf.nn.fractional_avg_pool
    ks = [tf.Variable(np.random.RandomState(i).randn(3, 3, 2, 2).astype(np.float32) / 4)
          for i in range(6)]
    x = tf.random.stateless_normal([2, 12, 12, 2], [0, 0])
    seed = 7 if form.startswith("seeded") else 0

    def block(h, k):
        pooled = fractional(tf.nn.conv2d(h, k, 1, "SAME"), [1.0, 1.44, 1.44, 1.0],
                            pseudo_random=True, seed=seed)[0]
        return h + 0.1 * tf.image.resize(tf.tanh(pooled), [12, 12])

    if form.endswith("call"):
        block = tf.function(block)
    pool_type = "FractionalMaxPool" if pool == "max" else "FractionalAvgPool"
    recomputed = []

    @tf.function
    def step():
        h = x
        for k in ks:
            h = block(h, k)
        y = tf.reduce_sum(h * h)
        graph = tf.compat.v1.get_default_graph()
        before = set(graph.get_operations())
        # Ours first: tf.gradients of a call makes its op output intermediates, after which a
        # plan keeps the call whole.
        got = mg.gradients(y, ks, checkpoints="memory")
        recomputed.extend(op.type for op in graph.get_operations() if op not in before
                          and "recompute" in op.name and "_grad" not in op.name)
        return tf.gradients(y, ks), got

    expected, got = step()
    assert_grads_close(got, expected)
    pooled_again = [t for t in recomputed if t == pool_type]
    assert recomputed, "expected recomputed segments"
    if form.startswith("seeded"):
        assert pooled_again, "a seeded, deterministic pool is replayed like any stateless op"
    else:
        assert not pooled_again, f"a {pool_type} that draws on every run was copied"


def test_copies_keep_devices_and_wait_for_their_gradient(graph):
    x, ws, loss = _mlp(device="/device:CPU:0")
    before = set(graph.get_operations())
    mg.gradients(loss, ws, checkpoints="memory")
    copies = [op for op in graph.get_operations() if op not in before
              and op.name.startswith("gradients_memsave/recompute")  # not their gradients
              and "/boundary/" not in op.name]
    boundaries = [op for op in graph.get_operations() if "/boundary/" in op.name]
    # Identities, not StopGradient: a gradient of these gradients must reach the checkpoints
    # (design note "boundaries").
    assert boundaries and all(op.type == "Identity" for op in boundaries)
    originals = {op.name: op for op in before}
    for copy in copies:
        original_name = copy.name.split("/", 2)[-1]
        original = originals.get(original_name)
        if original is not None:
            assert copy.device == original.device
            assert copy.colocation_groups() == original.colocation_groups()
    # Roots read only boundaries and outside tensors; they must wait for their gradient.
    roots = [op for op in copies if not any(t.op in copies for t in op.inputs)]
    assert roots and all(op.control_inputs for op in roots)
    assert all(any("gradients" in c.name for c in op.control_inputs) for op in roots)



def test_copies_wait_for_a_bias_gradient_s_input_not_the_bias_gradient():
    """A kept view of a bias (Keras 3 convolutions reshape theirs; nested budget plans keep
    it) gets its gradient from a BiasAddGrad, which oneDNN's graph pass fuses with the
    filter gradient of the same convolution, here computed a level later, downstream of the
    copies. Had the copies waited for the BiasAddGrad, the fused op would be both before and
    after them: "14 nodes in a cycle" at the first run wherever oneDNN is on (x86 CPUs with
    AVX-512, TF's default there). They wait for the gradient it reduces instead. Float32 (what
    oneDNN runs); the gradients and the gradients of their squared norm."""
    rng = np.random.RandomState(0)
    w1 = tf.Variable(rng.randn(3, 3, 4, 8).astype(np.float32) / 6)
    w2 = tf.Variable(rng.randn(3, 3, 8, 8).astype(np.float32) / 8)
    bias = tf.Variable(rng.randn(8).astype(np.float32))
    x = tf.constant(rng.randn(2, 8, 8, 4).astype(np.float32))
    added = []

    def step(checkpoints):
        h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
        kept_conv = tf.nn.conv2d(h, w2, 1, "SAME")
        bias_view = tf.reshape(bias, [8])
        loss = tf.reduce_sum(tf.tanh(tf.nn.bias_add(kept_conv, bias_view)))
        graph = tf.compat.v1.get_default_graph()
        before = set(graph.get_operations())
        if checkpoints is None:
            grads = tf.gradients(loss, [w1, w2, bias])
        else:
            grads = mg.gradients(loss, [w1, w2, bias], checkpoints=[kept_conv, bias_view])
            added.extend(op for op in graph.get_operations() if op not in before)
        norm = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        return grads + tf.gradients(norm, [w1, w2, bias])

    expected = tf.function(lambda: step(None))()
    got = tf.function(lambda: step("list"))()
    assert_grads_close(got, expected)
    copies = [op for op in added if op.name.startswith("gradients_memsave/recompute")
              and "/boundary/" not in op.name]
    roots = [op for op in copies if not any(t.op in copies for t in op.inputs)]
    assert roots and all(op.control_inputs for op in roots)
    waited_for = {c.type for op in roots for c in op.control_inputs}
    assert "BiasAddGrad" not in waited_for, waited_for


def test_op_names_are_deterministic():
    def build():
        g = tf.Graph()
        with g.as_default():
            _, ws, loss = _mlp()
            mg.gradients(loss, ws, checkpoints="memory")
        return [op.name for op in g.get_operations()]

    assert build() == build()


def test_repeated_calls_and_second_order(graph, session):
    x = tf.constant(np.random.RandomState(0).randn(4, 8).astype(np.float32))
    w = tf.Variable(np.random.RandomState(1).randn(8, 8).astype(np.float32) / 3)
    h = x
    for _ in range(5):
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_sum(h * h)
    first = mg.gradients(loss, x, checkpoints="memory")
    again = mg.gradients(loss, x, checkpoints="memory")
    reference = tf.gradients(loss, x)
    # Second order: gradient of a function of the (memsave) gradient.
    second = tf.gradients(tf.reduce_sum(first[0] ** 2), w)
    second_ref = tf.gradients(tf.reduce_sum(reference[0] ** 2), w)
    session.run(tf.compat.v1.global_variables_initializer())
    got = session.run([first[0], again[0], second[0]])
    want = session.run([reference[0], reference[0], second_ref[0]])
    assert_grads_close(got, want)


def test_sparse_stays_sparse_and_mixed_is_densified(graph, session):
    table = tf.Variable(np.random.RandomState(0).randn(12, 8).astype(np.float32))
    ids = tf.constant([1, 5, 5, 11])
    h = tf.gather(table, ids)
    for i in range(4):
        h = tf.tanh(tf.matmul(h, tf.ones([8, 8]) * (0.1 + i)))
    sparse_loss = tf.reduce_sum(h)
    mixed_loss = sparse_loss + tf.reduce_sum(tf.matmul(h, table, transpose_b=True))
    sparse = mg.gradients(sparse_loss, table, checkpoints="memory")[0]
    mixed = mg.gradients(mixed_loss, table, checkpoints="memory")[0]
    assert isinstance(sparse, tf.IndexedSlices)
    assert isinstance(mixed, tf.Tensor)
    ref_sparse = tf.convert_to_tensor(tf.gradients(sparse_loss, table)[0])
    ref_mixed = tf.gradients(mixed_loss, table)[0]
    session.run(tf.compat.v1.global_variables_initializer())
    got = session.run([tf.convert_to_tensor(sparse), mixed])
    want = session.run([ref_sparse, ref_mixed])
    assert_grads_close(got, want)


def test_sparse_partial_without_dense_shape_meeting_dense_is_an_error():
    from memsave_grads._tf import stitch
    with tf.Graph().as_default():
        t = tf.zeros([4, 2], name="t")
        sparse = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]))  # no dense_shape
        with pytest.raises(mg.SparseGradientError, match="no dense_shape"):
            stitch.aggregate([sparse, tf.ones([4, 2])], t)


def _handle_data(t):
    from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel
    return handle_data_util.get_resource_handle_data(t)


def test_copies_carry_the_handle_data_of_variant_and_resource_outputs(graph):
    """A While's TensorList outputs (a scan's states), a function call's TensorList output and
    a resource passed through a loop get their handle data from TensorFlow's Python builders,
    not from the C++ shape functions that run when an op is created (design note "handle
    data"); each copy must carry its original's, or pfor cannot vectorize its gradient."""
    from memsave_grads._tf import rewrite  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import list_ops  # pylint: disable=import-outside-toplevel
    x = tf.compat.v1.placeholder(tf.float32, [3, 4])
    v = tf.compat.v1.Variable(tf.ones([4, 4]), use_resource=True)
    states = tf.scan(lambda a, e: a + e, tf.range(6.0), initializer=x)

    @tf.function
    def as_list(t):
        return list_ops.tensor_list_from_tensor(t, element_shape=[4])

    listed = as_list(x)
    _, handle = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h),
                              [tf.constant(0), v.handle])
    del states, listed, handle
    ops = [op for op in graph.get_operations() if op.type not in ("Placeholder", "VarHandleOp")]
    copies = rewrite.copy_ops(ops, "copies", [])
    checked = {}
    for op, copy in copies.items():
        for original, copied in zip(op.outputs, copy.outputs):
            expected = _handle_data(original) if original.dtype in (tf.variant,
                                                                    tf.resource) else None
            if expected is not None and expected.is_set:
                assert _handle_data(copied) == expected, (op.type, original.name)
                checked.setdefault(op.type, 0)
                checked[op.type] += 1
    # The ops whose copies lost it before: While outputs and a call's output.
    assert checked.get("StatelessWhile", 0) + checked.get("While", 0) >= 3, checked
    assert checked.get("StatefulPartitionedCall", 0) + checked.get("PartitionedCall", 0) >= 1


def test_jacobian_of_a_scan_through_the_rewrite():
    """pfor vectorizes the gradient of the recomputed While (TensorFlow's
    test_jacobian_scan_shape, in a tf.function; it failed with "Required handle data not set"
    under the default "memory"). Every strategy, mode and container: the TF-semantics suite."""
    from tensorflow.python.ops.parallel_for import (  # pylint: disable=import-outside-toplevel
        gradients as pfor_gradients)

    def jacobian():
        x = tf.constant(np.random.RandomState(0).rand(2, 3).astype(np.float32))
        w = tf.constant(np.random.RandomState(1).rand(3, 3).astype(np.float32) / 2)
        h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, w)), w))
        states = tf.scan(lambda a, e: tf.tanh(tf.matmul(a, w) + e), tf.range(3.0),
                         initializer=h)
        return pfor_gradients.jacobian(states, x)

    want = tf.function(jacobian)()
    with mg.patch("memory"):
        got = tf.function(jacobian)()
    assert got.shape == [3, 2, 3, 2, 3]
    assert_grads_close([got], [want])


@pytest.mark.parametrize("strategy", ["memory", ["*"]])
def test_gradient_ops_name_the_forward_op_not_its_copy(graph, strategy):
    """tf.gradients records on each gradient op the forward op it differentiates
    (``_original_op``; TensorFlow's testGradients checks it, error messages follow it back to
    the user's code). Gradients of copies name the user's op, and so does each copy."""
    x, ws, loss = _mlp()
    forward = set(graph.get_operations())
    grads = mg.gradients(loss, ws + [x], checkpoints=strategy)
    new = [op for op in graph.get_operations() if op not in forward]
    copies = [op for op in new if "/recompute_level" in op.name and "/boundary/" not in op.name
              and op.type != "NoOp"]
    assert copies, "expected recomputed segments"
    # pylint: disable=protected-access
    assert all(op._original_op in forward for op in copies)
    credited = [op._original_op for op in new
                if op not in copies and op._original_op is not None]
    assert credited and all(op in forward for op in credited), (
        sorted({op.name for op in credited if op not in forward}))
    x_grad = grads[-1].op  # built by the gradient of layer 0's MatMul, which was recomputed
    assert x_grad.type == "MatMul"
    assert x_grad._original_op.name == "MatMul"  # pylint: disable=protected-access


def test_a_boundary_is_the_colocated_identity_tf_would_make():
    """stitch._boundary builds without tf.identity what ``colocate_with(t.op)`` +
    ``tf.identity`` build: the op, its colocation groups, device, shape, and a resource's
    handle data; inside a caller's colocate_with block, that block's groups too."""
    from memsave_grads._tf import stitch  # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            variable = tf.compat.v1.get_variable("v", [3, 2], use_resource=True)
            value = tf.tanh(tf.ones([4, 3]), name="value")
        anchor = tf.constant(1.0, name="anchor")
        with graph.colocate_with(anchor.op):  # an op with colocation groups of its own
            placed = tf.sin(value, name="placed")
        assert placed.op.colocation_groups() == [b"loc:@anchor"]
        for t in (value, placed, variable.handle):
            ours = stitch._boundary(t, "level/boundary/")
            with graph.colocate_with(t.op):
                theirs = tf.identity(t)
            assert ours.op.type == theirs.op.type == "Identity"
            assert ours.op.name.startswith("level/boundary/Identity")
            assert ours.op.colocation_groups() == theirs.op.colocation_groups()
            assert ours.op.device == theirs.op.device
            assert ours.shape.as_list() == theirs.shape.as_list()
        assert _handle_data(ours) == _handle_data(variable.handle)
        with graph.colocate_with(anchor.op):
            inside = stitch._boundary(value, "level/boundary/")
        assert set(inside.op.colocation_groups()) == {b"loc:@value", b"loc:@anchor"}


@tf.RegisterGradient("MemsaveGradsTestDoubledRead")
def _doubled_read_gradient(_, grad):
    return 2.0 * grad


def test_a_variable_read_given_another_gradient_keeps_it(graph, session):
    """The final level passes a variable read's gradient straight to its variable (stitch.
    _read_gradients_passed_on), but not where gradient_override_map gave the read another
    gradient: the gradients are tf.gradients' either way."""
    x = tf.constant(np.random.RandomState(0).randn(4, 8).astype(np.float32))
    ws = [tf.Variable(np.random.RandomState(i).randn(8, 8).astype(np.float32) / 3)
          for i in range(8)]
    h = x
    for i, w in enumerate(ws):
        if i % 2:
            with graph.gradient_override_map({"ReadVariableOp": "MemsaveGradsTestDoubledRead"}):
                read = w.read_value()
        else:
            read = w.read_value()
        h = tf.tanh(tf.matmul(h, read))
    loss = tf.reduce_sum(h * h)
    session.run(tf.compat.v1.global_variables_initializer())
    theirs = session.run(tf.gradients(loss, ws))
    ours = session.run(mg.gradients(loss, ws, checkpoints="memory"))
    assert_grads_close(ours, theirs)


def _created_both_ways(build_inputs, op_type, attrs_of, contexts=()):
    """The op ``rewrite.create_op`` makes and the one ``Graph._create_op_internal`` makes from
    the same arguments (then ``_set_device`` and ``_add_control_inputs``, as copies were made
    before), in twin graphs under the same context managers."""
    from memsave_grads._tf import rewrite  # pylint: disable=import-outside-toplevel
    made = []
    for fast in (True, False):
        graph = tf.Graph()
        with graph.as_default():
            inputs, controls, device = build_inputs()
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context(graph, inputs))
                op_def = graph.op_def_for_type(op_type)
                attrs = attrs_of(inputs)
                if fast:
                    op = rewrite.create_op(graph, op_type, inputs, name="made", attrs=attrs,
                                           op_def=op_def, device=device,
                                           control_inputs=controls)
                else:
                    op = graph._create_op_internal(  # pylint: disable=protected-access
                        op_type, inputs, name="made", attrs=attrs, op_def=op_def,
                        compute_device=False)
                    op._set_device(device)  # pylint: disable=protected-access
                    if controls:
                        op._add_control_inputs(controls)  # pylint: disable=protected-access
            made.append(op)
    return made


def _described(op):
    node_def = op.node_def
    return {"name": op.name, "type": op.type, "inputs": [t.name for t in op.inputs],
            "controls": sorted(c.name for c in op.control_inputs), "device": op.device,
            "attrs": {k: v.SerializeToString(deterministic=True)
                      for k, v in node_def.attr.items()},
            "groups": op.colocation_groups(),
            "shapes": [t.shape.as_list() if t.shape.rank is not None else None
                       for t in op.outputs],
            "dtypes": [t.dtype for t in op.outputs],
            "original": op._original_op,  # pylint: disable=protected-access
            "gradient_function": op._gradient_function,  # pylint: disable=protected-access
            "context": op._control_flow_context}  # pylint: disable=protected-access


def _matmul_inputs():
    a = tf.ones([2, 3], name="a")
    with tf.device("/device:CPU:1"):  # where a colocated op goes, by the ordinary route
        b = tf.ones([3, 4], name="b")
    wait = tf.no_op(name="wait")
    return [a, b], [wait, wait], "/device:CPU:0"  # a control input given twice counts once


def _list_inputs():
    parts = [tf.ones([2, 2], name=f"part{i}") for i in range(3)]
    return parts + [tf.constant(0, name="axis")], [], ""


def _type_list_inputs():
    return [tf.ones([2], name="f"), tf.constant([1, 2], name="i")], [], ""


def _attr_value(**kwargs):
    return attr_value_pb2.AttrValue(**kwargs)


@pytest.mark.parametrize("case", ["matmul", "concat", "identity_n", "scoped", "controlled",
                                  "colocated", "overridden"])
def test_create_op_makes_what_create_op_internal_makes(case):
    """``rewrite.create_op`` (the copies' and boundaries' route through the C API) gives the
    op the ordinary route gives: name made unique in the name scope, inputs (lists grouped
    by the op definition), attributes, device, control inputs (the caller's and those of an
    enclosing ``control_dependencies``), colocation groups of an enclosing ``colocate_with``,
    gradient overrides, shapes, original op and control-flow context."""
    matmul_attrs = lambda inputs: {  # noqa: E731
        "T": _attr_value(type=tf.float32.as_datatype_enum),
        "transpose_a": _attr_value(b=False), "transpose_b": _attr_value(b=False),
        "_class": _attr_value(list=attr_value_pb2.AttrValue.ListValue(s=[b"loc:@a"]))}
    cases = {
        "matmul": (_matmul_inputs, "MatMul", matmul_attrs, ()),
        "concat": (_list_inputs, "ConcatV2", lambda inputs: {
            "T": _attr_value(type=tf.float32.as_datatype_enum), "N": _attr_value(i=3),
            "Tidx": _attr_value(type=tf.int32.as_datatype_enum)}, ()),
        "identity_n": (_type_list_inputs, "IdentityN", lambda inputs: {
            "T": _attr_value(list=attr_value_pb2.AttrValue.ListValue(
                type=[tf.float32.as_datatype_enum, tf.int32.as_datatype_enum]))}, ()),
        "scoped": (_matmul_inputs, "MatMul", matmul_attrs,
                   (lambda g, i: g.name_scope("outer"), lambda g, i: g.name_scope("made"))),
        "controlled": (_matmul_inputs, "MatMul", matmul_attrs,
                       (lambda g, i: g.control_dependencies([tf.no_op(name="before")]),)),
        "colocated": (_matmul_inputs, "MatMul", matmul_attrs,
                      (lambda g, i: g.colocate_with(i[1].op),)),
        "overridden": (_matmul_inputs, "MatMul", matmul_attrs,
                       (lambda g, i: g.gradient_override_map({"MatMul": "Identity"}),
                        lambda g, i: g._attr_scope(  # pylint: disable=protected-access
                            {"_scoped": _attr_value(s=b"yes")}))),
    }
    build, op_type, attrs_of, contexts = cases[case]
    fast, ordinary = _created_both_ways(build, op_type, attrs_of, contexts=contexts)
    assert _described(fast) == _described(ordinary)
    # Its name is marked as used: the next op of that name is made unique.
    assert fast.graph.unique_name(fast.name, mark_as_used=False) != fast.name
