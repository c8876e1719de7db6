"""A catalogue of forward graphs for parity tests.

Each builder runs inside a graph (or a tf.function) and returns a :class:`Case`. Every case
contains matmuls (so ``"speed"`` applies) and adds its interior tensors to the ``"checkpoints"``
collection (so ``"collection"`` applies); ``"memory"`` cuts any of them (some, like
``encoder_decoder``, have no single tensor that separates xs from ys), so that every strategy is
exercised on every shape.
"""

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

D = 8


@dataclasses.dataclass
class Case:
    ys: list
    xs: list
    grad_ys: list | None = None
    feed: dict = dataclasses.field(default_factory=dict)
    interior: list = dataclasses.field(default_factory=list)  # candidate checkpoints
    kwargs: dict = dataclasses.field(default_factory=dict)


def _rng(seed=0):
    return np.random.RandomState(seed)


#: How builders make weights. tf.function tests swap in tf.constant: variables cannot be
#: created inside a function that is traced more than once.
make_weight = tf.Variable


def _weight(name, seed, shape=(D, D), dtype=tf.float32):
    init = (_rng(seed).randn(*shape) / np.sqrt(shape[0])).astype(dtype.as_numpy_dtype)
    return make_weight(init, name=name)


def _input(batch=4, dtype=tf.float32, seed=1, name="x"):
    return tf.constant(_rng(seed).randn(batch, D).astype(dtype.as_numpy_dtype), name=name)


def _collect(case: Case) -> Case:
    for t in case.interior:
        tf.compat.v1.add_to_collection("checkpoints", t)
    return case


def _dense_chain(h, n, name, dtype=tf.float32, seed=10):
    interior = []
    for i in range(n):
        w = _weight(f"{name}_w{i}", seed + i, dtype=dtype)
        h = tf.tanh(tf.matmul(h, w), name=f"{name}_{i}")
        interior.append(h)
    return h, interior


def chain():
    x = _input()
    h, interior = _dense_chain(x, 6, "chain")
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[x], interior=interior[1:-1]))


def chain_float64():
    x = _input(dtype=tf.float64)
    h, interior = _dense_chain(x, 6, "chain64", dtype=tf.float64)
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[x], interior=interior[1:-1]))


def residual_chain():
    x = _input()
    h, interior = x, []
    for i in range(6):
        w = _weight(f"res_w{i}", 20 + i)
        h = h + tf.tanh(tf.matmul(h, w))
        interior.append(h)
    return _collect(Case(ys=[tf.reduce_sum(tf.sin(h))], xs=[x], interior=interior[:-1]))


def diamond():
    x = _input()
    a = tf.tanh(tf.matmul(x, _weight("dia_w0", 30)))
    b = tf.sin(tf.matmul(a, _weight("dia_w1", 31)))
    c = tf.cos(a) * 2.0
    d = tf.tanh(b * c + a)
    e = tf.tanh(tf.matmul(d, _weight("dia_w2", 32)))
    f = tf.tanh(tf.matmul(e, _weight("dia_w3", 33)))
    return _collect(Case(ys=[tf.reduce_mean(f)], xs=[x], interior=[a, d, e]))


def split_unstack():
    x = _input()
    a = tf.tanh(tf.matmul(x, _weight("spl_w0", 40)))
    p, q = tf.split(a, 2, axis=1)
    rows = tf.unstack(a, axis=0)
    b = tf.concat([q * 2.0, tf.sin(p)], axis=1) + tf.stack(rows[::-1], axis=0)
    c = tf.tanh(tf.matmul(b, _weight("spl_w1", 41)))
    c2 = tf.tanh(tf.matmul(c, _weight("spl_w2", 42)))
    return _collect(Case(ys=[tf.reduce_sum(c2)], xs=[x], interior=[a, b, c]))


def shared_inputs():
    """The same weight variable is read by every layer; xs are variables."""
    x = _input()
    w = _weight("shared_w", 50)
    h, interior = x, []
    for _ in range(5):
        h = tf.tanh(tf.matmul(h, w)) + 0.5 * h
        interior.append(h)
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[w, x], interior=interior[1:-1]))


def unknown_batch():
    x = tf.compat.v1.placeholder(tf.float32, [None, D], name="x_unknown")
    h, interior = _dense_chain(x, 5, "unk")
    feed = {x: _rng(5).randn(3, D).astype(np.float32)}
    return _collect(Case(ys=[tf.reduce_sum(h)], xs=[x], feed=feed, interior=interior[1:-1]))


def grad_ys_several_ys():
    x = _input()
    h1, i1 = _dense_chain(x, 3, "gy_a", seed=60)
    h2, i2 = _dense_chain(h1, 3, "gy_b", seed=70)
    gy1 = tf.constant(_rng(7).randn(4, D).astype(np.float32))
    return _collect(Case(ys=[h1, tf.reduce_sum(h2)], xs=[x], grad_ys=[gy1, tf.constant(2.0)],
                         interior=i1[:-1] + i2[:-1]))


def unconnected_xs():
    x = _input()
    unused = _input(seed=9, name="unused")
    h, interior = _dense_chain(x, 5, "unc")
    return _collect(Case(ys=[tf.reduce_sum(h)], xs=[x, unused], interior=interior[1:-1]))


def unconnected_zero():
    case = unconnected_xs()
    case.kwargs = {"unconnected_gradients": "zero"}
    return case


def embedding():
    table = _weight("emb_table", 80, shape=(20, D))
    ids = tf.constant([[1, 3, 3, 7], [0, 19, 3, 2]])
    e = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
    h, interior = _dense_chain(e, 5, "emb")
    w_out = _weight("emb_out", 81)
    y = tf.reduce_sum(tf.matmul(h, w_out))
    return _collect(Case(ys=[y], xs=[table, w_out], interior=interior[:-1]))


def batch_norm():
    x = _input(batch=6)
    h, interior, params = x, [], []
    for i in range(4):
        h = tf.matmul(h, _weight(f"bn_w{i}", 90 + i))
        scale = make_weight(np.ones([D], np.float32), name=f"bn_scale{i}")
        offset = make_weight(np.zeros([D], np.float32), name=f"bn_offset{i}")
        params += [scale, offset]
        if i % 2:
            h4 = tf.reshape(h, [6, 1, 1, D])
            h4, _, _ = tf.compat.v1.nn.fused_batch_norm(h4, scale, offset, is_training=True)
            h = tf.reshape(h4, [6, D])
        else:
            mean, var = tf.nn.moments(h, axes=[0])
            h = tf.nn.batch_normalization(h, mean, var, offset, scale, 1e-3)
        h = tf.nn.relu(h)
        interior.append(h)
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[x] + params[:3],
                         interior=interior[:-1]))


def dropout():
    x = _input()
    h, interior = x, []
    for i in range(5):
        h = tf.nn.dropout(tf.tanh(tf.matmul(h, _weight(f"drop_w{i}", 100 + i))), rate=0.3)
        interior.append(h)
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[x], interior=interior[:-1]))


def cond():
    x = _input()
    a = tf.tanh(tf.matmul(x, _weight("cond_w0", 110)))
    b = tf.cond(tf.reduce_sum(a) > 0.0, lambda: tf.sin(a) * 3.0, lambda: tf.tanh(a) - 1.0)
    c = tf.tanh(tf.matmul(b, _weight("cond_w1", 111)))
    d = tf.tanh(tf.matmul(c, _weight("cond_w2", 112)))
    return _collect(Case(ys=[tf.reduce_sum(d)], xs=[x], interior=[a, b, c]))


def while_loop():
    x = _input()
    w = _weight("while_w", 120)
    a = tf.tanh(tf.matmul(x, _weight("while_w0", 121)))
    _, b = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                         [tf.constant(0), a])
    c = tf.tanh(tf.matmul(b, _weight("while_w1", 122)))
    d = tf.tanh(tf.matmul(c, _weight("while_w2", 123)))
    return _collect(Case(ys=[tf.reduce_sum(d)], xs=[x, w], interior=[a, b, c]))


def encoder_decoder():
    """U-Net-like: every encoder level skips to its decoder level (concat), so no single
    tensor separates xs from ys."""
    x = _input()
    h, skips, interior = x, [], []
    for level in range(3):
        h, inner = _dense_chain(h, 2, f"enc{level}", seed=130 + 10 * level)
        skips.append(h)
        interior += inner
    for level in reversed(range(3)):
        joined = tf.concat([h, skips[level]], axis=1)
        w = _weight(f"dec{level}_join", 170 + level, shape=(2 * D, D))
        h = tf.nn.relu(tf.matmul(joined, w))
        h, inner = _dense_chain(h, 2, f"dec{level}", seed=180 + 10 * level)
        interior += inner
    return _collect(Case(ys=[tf.reduce_sum(h * h)], xs=[x], interior=interior[:-1]))


BUILDERS: dict[str, Callable[[], Case]] = {
    f.__name__: f for f in [chain, chain_float64, residual_chain, diamond, split_unstack,
                            shared_inputs, unknown_batch, grad_ys_several_ys, unconnected_xs,
                            unconnected_zero, embedding, batch_norm, dropout, cond, while_loop,
                            encoder_decoder]
}
