"""The README headline's models (and docs/budgets.md's), as a user hands them to fit-limit,
from the installed package:

    python -m memsave_grads fit-limit memsave_grads.bench.fit_limit_models:resnet50 \\
        --limit-mib 600 --checkpoints memory --keras-remat --plot resnet50.png

Each function takes the batch size and returns a compiled Keras 3 model (``resnet50_tf_keras``:
a tf_keras one); fit-limit makes a batch of random data of the model's shapes (token ids for
the integer inputs, class indices for the sparse losses). Nothing here is tuned for
memsave_grads: these are the stock layers.
"""

import keras


def resnet50(batch_size, image_size=64, classes=100):
    """keras.applications.ResNet50 (25.6 M weights, random init) on 64 x 64 images."""
    del batch_size
    return _resnet50(keras, image_size, classes)


def resnet50_tf_keras(batch_size, image_size=64, classes=100):
    """The same ResNet50 in tf_keras (Keras 2), as issue 17 first measured it: its batch norm
    is TensorFlow's fused kernel, where Keras 3 builds it from moments and elementwise ops."""
    import tf_keras  # pylint: disable=import-outside-toplevel
    del batch_size
    return _resnet50(tf_keras, image_size, classes)


def _resnet50(keras_module, image_size, classes):
    return _application(keras_module, "ResNet50", image_size, classes)


def _application(keras_module, name, image_size, classes):
    """``keras_module.applications.<name>``, randomly initialized (seed 0), compiled with SGD
    with momentum and sparse cross-entropy."""
    keras_module.utils.set_random_seed(0)
    model = getattr(keras_module.applications, name)(
        weights=None, input_shape=(image_size, image_size, 3), classes=classes)
    model.compile(optimizer=keras_module.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras_module.losses.SparseCategoricalCrossentropy())
    return model


def _block(h, dim, heads, causal):
    attention = keras.layers.MultiHeadAttention(heads, dim // heads)(
        h, h, use_causal_mask=causal)
    h = keras.layers.LayerNormalization()(h + attention)
    hidden = keras.layers.Dense(4 * dim, activation="gelu")(h)
    return keras.layers.LayerNormalization()(h + keras.layers.Dense(dim)(hidden))


def _token_model(layers, sequence, dim, heads, vocabulary, causal, per_token_outputs):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((sequence,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, dim)(tokens)
    h = h + keras.layers.Embedding(sequence, dim)(keras.ops.arange(sequence))
    for _ in range(layers):
        h = _block(h, dim, heads, causal)
    if not per_token_outputs:
        h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(tokens, keras.layers.Dense(vocabulary)(h))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def transformer_encoder(batch_size, layers=8, sequence=128, dim=256, heads=4):
    """A BERT-style encoder: 8 blocks of self-attention + GELU MLP, masked-token outputs over
    a 1000-token vocabulary."""
    del batch_size
    return _token_model(layers, sequence, dim, heads, vocabulary=1000, causal=False,
                        per_token_outputs=True)


def gpt_decoder(batch_size, layers=6, sequence=256, dim=256, heads=4):
    """A GPT-style decoder: 6 blocks of causal self-attention, next-token logits over a
    2000-token vocabulary."""
    del batch_size
    return _token_model(layers, sequence, dim, heads, vocabulary=2000, causal=True,
                        per_token_outputs=True)


def lstm(batch_size, steps=200, features=64, units=256):
    """Two stacked LSTM(256) layers over 200 steps (dropout 0.1), a 10-way classifier."""
    del batch_size
    keras.utils.set_random_seed(0)
    inputs = keras.Input((steps, features))
    h = keras.layers.LSTM(units, return_sequences=True, dropout=0.1)(inputs)
    h = keras.layers.LSTM(units, dropout=0.1)(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def efficientnet_b0(batch_size, image_size=64, classes=100):
    """keras.applications.EfficientNetB0 (5.3 M weights, random init) on 64 x 64 images."""
    del batch_size
    return _application(keras, "EfficientNetB0", image_size, classes)


def convnext_tiny(batch_size, image_size=64, classes=100):
    """keras.applications.ConvNeXtTiny (28 M weights, random init) on 64 x 64 images: depthwise
    7 x 7 convolutions, layer norm and GELU instead of batch norm and ReLU."""
    del batch_size
    return _application(keras, "ConvNeXtTiny", image_size, classes)
