"""Raw-op benchmark models, built in the current ``tf.Graph``: MLPs and a small conv ResNet.

Each builder returns (scalar loss, trainable variables). Inputs live in non-trainable variables
and every initial value comes from stateless random ops with fixed seeds, so nothing is fed and
every run sees the same data. The names and sizes the benchmark uses are in
:mod:`memsave_grads.bench.models`, which calls these when a model is built.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

#: What a builder returns: the scalar loss and the variables to train.
BuiltModel = tuple[tf.Tensor, list[tf.Variable]]


def make_input(shape, seed: int, name: str) -> tf.Variable:
    """A non-trainable variable holding fixed random data (so nothing is fed per step)."""
    return tf.Variable(tf.random.stateless_normal(shape, seed=[seed, 0]), trainable=False,
                       name=name)


def random_labels(shape, seed: int, classes: int) -> tf.Variable:
    """Fixed integer class labels in ``[0, classes)``, in a non-trainable variable."""
    return tf.Variable(
        tf.random.stateless_uniform(shape, seed=[seed, 2], maxval=classes, dtype=tf.int32),
        trainable=False, name="labels")


def softmax_loss(labels: tf.Variable, logits: tf.Tensor) -> tf.Tensor:
    """Mean sparse softmax cross-entropy: the loss of every classifier here."""
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
        name="loss")


def _weight(shape, seed: int, stddev: float, name: str) -> tf.Variable:
    return tf.Variable(tf.random.stateless_normal(shape, seed=[seed, 1], stddev=stddev),
                       name=name)


def mlp(depth: int, width: int, batch: int, residual: bool, seed: int = 0) -> BuiltModel:
    """``h = h + tanh(h @ W_i)`` (residual) or ``h = tanh(h @ W_i)``; loss mean(h**2)."""
    # Residual blocks add their output to the stream: a smaller init keeps activations bounded.
    stddev = (0.5 if residual else 1.0) / math.sqrt(width)
    h = make_input([batch, width], seed, "inputs")
    weights = []
    for i in range(depth):
        with tf.name_scope(f"block{i}"):
            w = _weight([width, width], seed + 1 + i, stddev, "w")
            weights.append(w)
            out = tf.tanh(tf.matmul(h, w))
            h = h + out if residual else out
    return tf.reduce_mean(tf.square(h), name="loss"), weights


def conv_resnet(blocks: int = 16, batch: int = 32, image: int = 32,
                channels: Sequence[int] = (32, 64), classes: int = 10,
                seed: int = 0) -> BuiltModel:
    """A small ResNet from raw ops: conv-BN-relu-conv-BN + shortcut, relu; softmax loss.

    ``blocks`` residual blocks split evenly over the stages in ``channels``; every stage after
    the first halves the resolution (strided conv, 1x1 projection shortcut). Batch norm uses
    batch statistics (``tf.nn.moments`` + ``tf.nn.batch_normalization``).
    """
    stages = len(channels)
    per_stage = [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]
    counter = iter(range(seed + 1, seed + 10_000))
    variables = []

    def conv(x, cin, cout, k=3, stride=1, name="conv"):
        kernel = _weight([k, k, cin, cout], next(counter), math.sqrt(2.0 / (k * k * cin)),
                         f"{name}_kernel")
        variables.append(kernel)
        return tf.nn.conv2d(x, kernel, strides=stride, padding="SAME", name=name)

    def batch_norm(x, c, name="bn"):
        gamma = tf.Variable(tf.ones([c]), name=f"{name}_gamma")
        beta = tf.Variable(tf.zeros([c]), name=f"{name}_beta")
        variables.extend([gamma, beta])
        mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
        return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-5, name=name)

    images = make_input([batch, image, image, 3], seed, "images")
    labels = random_labels([batch], seed, classes)
    with tf.name_scope("stem"):
        h = tf.nn.relu(batch_norm(conv(images, 3, channels[0]), channels[0]))
    cin = channels[0]
    index = 0
    for stage, (cout, count) in enumerate(zip(channels, per_stage)):
        for j in range(count):
            stride = 2 if stage > 0 and j == 0 else 1
            with tf.name_scope(f"block{index}"):
                y = tf.nn.relu(batch_norm(conv(h, cin, cout, stride=stride, name="conv1"),
                                          cout, "bn1"))
                y = batch_norm(conv(y, cout, cout, name="conv2"), cout, "bn2")
                shortcut = h
                if stride != 1 or cin != cout:
                    shortcut = batch_norm(conv(h, cin, cout, k=1, stride=stride,
                                               name="proj"), cout, "proj_bn")
                h = tf.nn.relu(y + shortcut)
            cin = cout
            index += 1
    with tf.name_scope("head"):
        pooled = tf.reduce_mean(h, axis=[1, 2])
        dense = _weight([cin, classes], next(counter), 1.0 / math.sqrt(cin), "dense")
        variables.append(dense)
        logits = tf.matmul(pooled, dense)
        loss = softmax_loss(labels, logits)
    return loss, variables
