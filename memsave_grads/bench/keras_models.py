"""Keras 2 (``tf_keras``) models for the model-scale benchmark, built in a ``tf.Graph``.

Every builder returns a :class:`memsave_grads.bench.harness.ModelSpec` whose ``build()`` creates the
model with ``weights=None`` inside the current graph, runs it once in training mode (batch norm
uses batch statistics) on fixed random inputs held in non-trainable variables, and returns a
softmax cross-entropy loss and the trainable variables. Batch-norm moving-average updates are
left out of the step: they do not depend on the gradients, and every method would pay for them
alike.

``tf_keras`` is an optional dependency (``pip install "memsave-grads[bench]"``); it is imported
when a model is built, not when this module is imported.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from memsave_grads.bench import harness


def _keras():
    try:
        import tf_keras  # pylint: disable=import-outside-toplevel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The Keras benchmarks need Keras 2: pip install 'memsave-grads[bench]' "
            "(or pip install tf-keras).") from e
    return tf_keras


def _train_classifier(model, inputs: tf.Variable, batch: int, classes: int, seed: int):
    """Run ``model`` in training mode on ``inputs``; (softmax loss, trainable variables)."""
    logits = model(tf.convert_to_tensor(inputs), training=True)
    return _classification_loss(logits, batch, classes, seed), list(model.trainable_weights)


def _classification_loss(logits: tf.Tensor, batch: int, classes: int, seed: int) -> tf.Tensor:
    labels = tf.Variable(
        tf.random.stateless_uniform([batch], seed=[seed, 2], maxval=classes, dtype=tf.int32),
        trainable=False, name="labels")
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
        name="loss")


def _application(name: str, constructor: str, batch: int, image: int, classes: int = 10,
                 seed: int = 0) -> harness.ModelSpec:
    def build():
        keras = _keras()
        images = harness.make_input([batch, image, image, 3], seed, "images")
        model = getattr(keras.applications, constructor)(
            weights=None, input_shape=(image, image, 3), classes=classes,
            classifier_activation=None)
        return _train_classifier(model, images, batch, classes, seed)

    return harness.ModelSpec(
        f"{name} b={batch} {image}x{image}", build,
        f"tf_keras.applications.{constructor}(weights=None), {image}x{image} images, "
        f"batch {batch}, training mode")


def resnet50(batch: int = 8, image: int = 128) -> harness.ModelSpec:
    return _application("ResNet50", "ResNet50", batch, image)


def densenet121(batch: int = 8, image: int = 128) -> harness.ModelSpec:
    return _application("DenseNet121", "DenseNet121", batch, image)


def mobilenet_v2(batch: int = 8, image: int = 128) -> harness.ModelSpec:
    return _application("MobileNetV2", "MobileNetV2", batch, image)


def unet(batch: int = 4, image: int = 128, base_filters: int = 32, depth: int = 4,
         classes: int = 4, seed: int = 0) -> harness.ModelSpec:
    """The U-Net of Ronneberger et al. (2015), scaled down: long skip connections from every
    encoder level to the decoder level of the same resolution (no single tensor separates them).
    """

    def build():
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

        images = harness.make_input([batch, image, image, 3], seed, "images")
        logits = model(tf.convert_to_tensor(images), training=True)
        labels = tf.Variable(
            tf.random.stateless_uniform([batch, image, image], seed=[seed, 2], maxval=classes,
                                        dtype=tf.int32), trainable=False, name="labels")
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
            name="loss")
        return loss, list(model.trainable_weights)

    return harness.ModelSpec(
        f"U-Net depth={depth} b={batch} {image}x{image}", build,
        f"U-Net: {depth} levels, {base_filters}..{base_filters * 2 ** depth} filters, "
        f"{image}x{image} images, batch {batch}, per-pixel softmax loss")


def transformer(layers_count: int = 8, batch: int = 8, sequence: int = 256, d_model: int = 256,
                heads: int = 8, mlp_ratio: int = 4, classes: int = 10,
                seed: int = 0) -> harness.ModelSpec:
    """A pre-norm Transformer encoder stack: MultiHeadAttention + LayerNorm + MLP per layer."""

    def build():
        keras = _keras()
        layers = keras.layers
        inputs = keras.Input((sequence, d_model))
        x = inputs
        for i in range(layers_count):
            h = layers.LayerNormalization(name=f"layer{i}_ln1")(x)
            h = layers.MultiHeadAttention(heads, d_model // heads, name=f"layer{i}_attention")(
                h, h)
            x = layers.Add(name=f"layer{i}_residual1")([x, h])
            h = layers.LayerNormalization(name=f"layer{i}_ln2")(x)
            h = layers.Dense(mlp_ratio * d_model, activation="gelu", name=f"layer{i}_mlp1")(h)
            h = layers.Dense(d_model, name=f"layer{i}_mlp2")(h)
            x = layers.Add(name=f"layer{i}_residual2")([x, h])
        x = layers.LayerNormalization(name="final_ln")(x)
        x = layers.GlobalAveragePooling1D(name="pool")(x)
        outputs = layers.Dense(classes, name="head")(x)
        model = keras.Model(inputs, outputs, name="transformer")

        tokens = harness.make_input([batch, sequence, d_model], seed, "embedded_tokens")
        return _train_classifier(model, tokens, batch, classes, seed)

    return harness.ModelSpec(
        f"Transformer {layers_count} layers b={batch} seq={sequence}", build,
        f"Transformer encoder: {layers_count} pre-norm layers (MultiHeadAttention {heads} heads, "
        f"LayerNorm, GELU MLP x{mlp_ratio}), d_model {d_model}, sequence {sequence}, "
        f"batch {batch}")


#: The Keras model families of the benchmark, by the name used in ``--models``.
KERAS_MODELS: dict[str, Callable[[], harness.ModelSpec]] = {
    "resnet50": resnet50,
    "densenet121": densenet121,
    "mobilenetv2": mobilenet_v2,
    "unet": unet,
    "transformer": transformer,
}
