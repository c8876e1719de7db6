"""Keras 2 (``tf_keras``) benchmark models, built in the current ``tf.Graph``.

Every builder creates the model with ``weights=None``, runs it once in training mode (batch norm
uses batch statistics) on fixed random inputs held in non-trainable variables, and returns a
softmax cross-entropy loss and the trainable variables. Batch-norm moving-average updates are
left out of the step: they do not depend on the gradients, and every method would pay for them
alike. The names and sizes the benchmark uses are in :mod:`memsave_grads.bench.models`.

``tf_keras`` is an optional dependency (``pip install "memsave-grads[bench]"``); it is imported
when a model is built, not when this module is imported.
"""

from __future__ import annotations

import tensorflow as tf

from memsave_grads.bench.graphs import BuiltModel, make_input, random_labels, softmax_loss


def _keras():
    try:
        import tf_keras  # pylint: disable=import-outside-toplevel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The Keras benchmarks need Keras 2: pip install 'memsave-grads[bench]' "
            "(or pip install tf-keras).") from e
    return tf_keras


def _train_classifier(model, inputs: tf.Variable, batch: int, classes: int,
                      seed: int) -> BuiltModel:
    """Run ``model`` in training mode on ``inputs``; (softmax loss, trainable variables)."""
    logits = model(tf.convert_to_tensor(inputs), training=True)
    labels = random_labels([batch], seed, classes)
    return softmax_loss(labels, logits), list(model.trainable_weights)


def application(constructor: str, batch: int, image: int, classes: int = 10,
                seed: int = 0) -> BuiltModel:
    """``tf_keras.applications.<constructor>(weights=None)`` on ``image`` x ``image`` inputs."""
    keras = _keras()
    images = make_input([batch, image, image, 3], seed, "images")
    model = getattr(keras.applications, constructor)(
        weights=None, input_shape=(image, image, 3), classes=classes,
        classifier_activation=None)
    return _train_classifier(model, images, batch, classes, seed)


def unet(batch: int = 4, image: int = 128, base_filters: int = 32, depth: int = 4,
         classes: int = 4, seed: int = 0) -> BuiltModel:
    """The U-Net of Ronneberger et al. (2015), scaled down: long skip connections from every
    encoder level to the decoder level of the same resolution (no single tensor separates them).
    """
    keras = _keras()
    layers = keras.layers

    def double_conv(x, filters, name):
        for k in (1, 2):
            x = layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv{k}")(x)
            x = layers.BatchNormalization(name=f"{name}_bn{k}")(x)
            x = layers.Activation("relu", name=f"{name}_relu{k}")(x)
        return x

    inputs = keras.Input((image, image, 3))
    x, skips = inputs, []
    for level in range(depth):
        x = double_conv(x, base_filters * 2 ** level, f"down{level}")
        skips.append(x)
        x = layers.MaxPooling2D(name=f"pool{level}")(x)
    x = double_conv(x, base_filters * 2 ** depth, "bottom")
    for level in reversed(range(depth)):
        x = layers.Conv2DTranspose(base_filters * 2 ** level, 2, strides=2,
                                   name=f"up{level}")(x)
        x = layers.Concatenate(name=f"skip{level}")([x, skips[level]])
        x = double_conv(x, base_filters * 2 ** level, f"dec{level}")
    outputs = layers.Conv2D(classes, 1, name="head")(x)
    model = keras.Model(inputs, outputs, name="unet")

    images = make_input([batch, image, image, 3], seed, "images")
    logits = model(tf.convert_to_tensor(images), training=True)
    labels = random_labels([batch, image, image], seed, classes)  # one class per pixel
    return softmax_loss(labels, logits), list(model.trainable_weights)


def transformer(layers_count: int = 8, batch: int = 8, sequence: int = 256, d_model: int = 256,
                heads: int = 8, mlp_ratio: int = 4, classes: int = 10,
                seed: int = 0) -> BuiltModel:
    """A pre-norm Transformer encoder stack: MultiHeadAttention + LayerNorm + MLP per layer."""
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((sequence, d_model))
    x = inputs
    for i in range(layers_count):
        h = layers.LayerNormalization(name=f"layer{i}_ln1")(x)
        h = layers.MultiHeadAttention(heads, d_model // heads, name=f"layer{i}_attention")(h, h)
        x = layers.Add(name=f"layer{i}_residual1")([x, h])
        h = layers.LayerNormalization(name=f"layer{i}_ln2")(x)
        h = layers.Dense(mlp_ratio * d_model, activation="gelu", name=f"layer{i}_mlp1")(h)
        h = layers.Dense(d_model, name=f"layer{i}_mlp2")(h)
        x = layers.Add(name=f"layer{i}_residual2")([x, h])
    x = layers.LayerNormalization(name="final_ln")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(classes, name="head")(x)
    model = keras.Model(inputs, outputs, name="transformer")

    tokens = make_input([batch, sequence, d_model], seed, "embedded_tokens")
    return _train_classifier(model, tokens, batch, classes, seed)
