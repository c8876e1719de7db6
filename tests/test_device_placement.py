"""Device placement kept under load (issue 13, item 3): a model whose layers alternate
between two logical CPU devices, differentiated by memsave_grads and by tf.gradients.

Checked for "memory" and "speed", with and without ``colocate_gradients_with_ops``:
- every copied op (``..._memsave/recompute_level*/...``) requests its original's device and
  carries its original's colocation group, and the placer runs it where the original runs;
- every boundary (identity of a kept tensor) is colocated with the op it reads;
- every gradient op our call creates lands on the device where tf.gradients' gradient ops of
  the same forward op land (with colocation: on the forward op's device);
- the gradients equal tf.gradients'.
Placement is read from the partition graphs the session actually ran, not only from the
requested device strings. Two logical CPUs must be configured before TensorFlow initialises
its devices, which the test session has long done: the graphs run in a subprocess (as in
test_distribute.py) that reports back as JSON.
"""

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

PLACEMENT = textwrap.dedent(r"""
    import json, os
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import memsave_grads as mg
    from memsave_grads._tf import selection
    # The model is small: without this the never-worse rule would hand it to tf.gradients and
    # there would be no copy to check (tests/conftest.py does the same in-process).
    selection.NEVER_WORSE_RULE = False

    DEPTH, WIDTH, BATCH = 8, 16, 4

    def describe(graph, ops, placed):
        return {op.name: {"type": op.type, "device": op.device,
                          "groups": [g.decode() for g in op.colocation_groups()],
                          "inputs": [t.op.name for t in op.inputs],
                          "placed": placed.get(op.name, "")} for op in ops}

    def case(checkpoints, colocate):
        rng = np.random.RandomState(0)
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH], name="x")
            h, ws = x, []
            for i in range(DEPTH):
                # Alternate devices: every residual add reads a tensor from the other device.
                # Layer 0 on cpu:1, so that an op left without a device (which the placer puts
                # on cpu:0) is caught wherever its forward op is on cpu:1.
                with tf.device(f"/cpu:{(i + 1) % 2}"), tf.name_scope(f"layer{i}"):
                    w = tf.Variable((rng.randn(WIDTH, WIDTH) / np.sqrt(WIDTH)).astype(np.float32),
                                    name="w")
                    ws.append(w)
                    h = h + tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(tf.square(h), name="loss")
            forward = list(graph.get_operations())
            ref = tf.compat.v1.gradients(loss, ws + [x], colocate_gradients_with_ops=colocate)
            after_ref = set(graph.get_operations())
            ours = mg.gradients(loss, ws + [x], checkpoints=checkpoints,
                                colocate_gradients_with_ops=colocate)
            ref_ops = [op for op in graph.get_operations()
                       if op in after_ref and op not in set(forward)]
            our_ops = [op for op in graph.get_operations() if op not in after_ref]
            config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
            # No grappler and no common subexpression elimination (which would merge our
            # top-segment gradient ops with tf.gradients' identical ones): the partition graphs
            # then hold the ops as built, under their names.
            config.graph_options.rewrite_options.disable_meta_optimizer = True
            config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
            with tf.compat.v1.Session(config=config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                metadata = tf.compat.v1.RunMetadata()
                ref_values, our_values = sess.run(
                    [ref, ours], {x: rng.randn(BATCH, WIDTH).astype(np.float32)},
                    options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                    run_metadata=metadata)
            placed = {node.name: node.device for part in metadata.partition_graphs
                      for node in part.node}
            return {"forward": describe(graph, forward, placed),
                    "ref": describe(graph, ref_ops, placed),
                    "ours": describe(graph, our_ops, placed),
                    "ref_values": [v.tolist() for v in ref_values],
                    "our_values": [v.tolist() for v in our_values]}

    result = {f"{c}/{colocate}": case(c, colocate)
              for c in ("memory", "speed") for colocate in (False, True)}
    print("RESULT " + json.dumps(result), flush=True)
""")

CASES = [f"{c}/{colocate}" for c in ("memory", "speed") for colocate in (False, True)]
_COPY = re.compile(r"^(?:.*/)?recompute_level[^/]+/(?!boundary/)(.+)$")
_GRAD_OF = re.compile(r"^gradients(?:_\d+)?/(?:.*recompute_level[^/]+/)?(.+?)_grad/")


@pytest.fixture(scope="module")
def placement():
    try:
        done = subprocess.run([sys.executable, "-c", PLACEMENT], capture_output=True, text=True,
                              check=False, timeout=240)
    except subprocess.TimeoutExpired as exc:  # run() has killed the child
        pytest.fail(f"placement subprocess ran past {exc.timeout} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def _kinds(case):
    """Our ops split into copies ({copy: original}), boundaries and gradient ops."""
    copies, boundaries, grads = {}, [], []
    for name in case["ours"]:
        # Copies and boundaries live under "<scope>_memsave/"; the gradient ops TensorFlow
        # builds for the copies under "gradients_<n>/<scope>_memsave/...".
        ours = name.split("/")[0].endswith("_memsave")
        if ours and "/boundary/" in name:
            boundaries.append(name)
            continue
        match = _COPY.match(name) if ours else None
        if match:
            copies[name] = match.group(1)
        else:
            grads.append(name)
    return copies, boundaries, grads


def _forward_of(case, name):
    """The forward op a gradient op belongs to: its colocation group where it has one of a
    forward op (colocate_gradients_with_ops), else the ``<op>_grad/`` scope of its name."""
    op = case["ours"].get(name) or case["ref"][name]
    for group in op["groups"]:
        target = group[len("loc:@"):]
        if target in case["forward"]:
            return target
    match = _GRAD_OF.match(name)
    if match and match.group(1) in case["forward"]:
        return match.group(1)
    return None


def _on_device(placed, index):
    return placed.endswith(f"CPU:{index}")


@pytest.mark.parametrize("key", CASES)
def test_the_layers_really_run_on_both_devices(placement, key):
    forward = placement[key]["forward"]
    for i in range(2):
        for kind in ("MatMul", "Tanh", "add"):
            op = forward[f"layer{i}/{kind}"]
            device = (i + 1) % 2
            assert op["device"].endswith(f"CPU:{device}") and _on_device(op["placed"], device), op


@pytest.mark.parametrize("key", CASES)
def test_copies_keep_their_originals_device_and_colocation(placement, key):
    case = placement[key]
    copies, _, _ = _kinds(case)
    assert len(copies) >= 6, sorted(case["ours"])  # the test must see recomputation
    devices = set()
    for copy, original in copies.items():
        assert original in case["forward"], (copy, original)
        mine, theirs = case["ours"][copy], case["forward"][original]
        assert mine["type"] == theirs["type"], (copy, mine, theirs)
        assert mine["device"] == theirs["device"], (copy, mine, theirs)
        assert mine["groups"] == theirs["groups"], (copy, mine, theirs)
        if mine["placed"]:
            # A copy whose value no gradient reads (an AddV2's, say) is pruned from the run.
            assert mine["placed"] == theirs["placed"], (copy, mine, theirs)
            devices.add(mine["placed"][-1])
    assert devices == {"0", "1"}, devices


@pytest.mark.parametrize("key", CASES)
def test_boundaries_are_colocated_with_what_they_read(placement, key):
    case = placement[key]
    _, boundaries, _ = _kinds(case)
    assert boundaries
    for name in boundaries:
        boundary = case["ours"][name]
        assert boundary["type"] == "Identity", boundary
        source = case["forward"][boundary["inputs"][0]]
        assert boundary["groups"] == source["groups"], (name, boundary, source)
        if boundary["placed"] and source["placed"]:  # a fed placeholder is not a node
            assert boundary["placed"] == source["placed"], (name, boundary, source)


@pytest.mark.parametrize("key", CASES)
def test_gradient_ops_land_where_tf_gradients_puts_them(placement, key):
    case = placement[key]
    colocate = key.endswith("True")
    _, _, grads = _kinds(case)

    def placed_by_forward(ops, names):
        by_forward = {}
        for name in names:
            forward = _forward_of(case, name)
            if colocate:
                # Every gradient op is colocated with a forward op, as tf.gradients' are.
                assert forward is not None, (name, ops[name])
            if forward is not None and ops[name]["placed"]:
                by_forward.setdefault(forward, set()).add(ops[name]["placed"])
        return by_forward

    ref = placed_by_forward(case["ref"], case["ref"])
    ours = placed_by_forward(case["ours"], grads)
    # Every layer's MatMul has gradient ops (its weight's gradient) in both calls.
    matmuls = {f"layer{i}/MatMul" for i in range(8)}
    assert matmuls <= set(ours) and matmuls <= set(ref), (sorted(ours), sorted(ref))
    for forward, devices in ours.items():
        if not case["forward"][forward]["placed"]:
            continue  # a fed placeholder: no node of the run to compare with
        if colocate:
            assert devices == {case["forward"][forward]["placed"]}, (forward, devices)
        if forward in ref:
            assert devices == ref[forward], (forward, devices, ref[forward])
    if colocate:
        # With colocation the comparison has teeth: tf.gradients' own ops sit on both devices.
        for forward, devices in ref.items():
            if case["forward"][forward]["placed"]:
                assert devices == {case["forward"][forward]["placed"]}, (forward, devices)
        assert {d[-1] for devices in ours.values() for d in devices} == {"0", "1"}


@pytest.mark.parametrize("key", CASES)
def test_same_values_as_tf_gradients(placement, key):
    case = placement[key]
    for got, want in zip(case["our_values"], case["ref_values"]):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
