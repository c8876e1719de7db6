"""The benchmark's models by name: a catalogue that costs nothing to import.

A :class:`ModelSpec` is a name, a description and a ``build()`` that creates the model in the
current ``tf.Graph``. The specs here only *name* models; the graphs are made by
:mod:`memsave_grads.bench.graphs` (raw TensorFlow ops) and
:mod:`memsave_grads.bench.keras_graphs` (Keras 2), which ``build()`` imports when it is called.
So the command line can list, match and validate ``--models`` before TensorFlow is imported,
and the dependencies run one way: the catalogue -> the graph builders, never back.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # annotations only: importing TensorFlow here would defeat the module
    from memsave_grads.bench.graphs import BuiltModel


#: The budgets of the ``solvers`` command, as fractions of tf.gradients' predicted peak (here,
#: not in :mod:`memsave_grads.bench.solvers`, so the command line reads them without TensorFlow).
SOLVER_FRACTIONS = (0.75, 0.6, 0.5, 0.4, 0.35)


#: Steps whose peaks every benchmark measures (after a warm-up step); the median is reported.
PEAK_RUNS = 3

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A named model: ``build()`` is called inside a fresh graph and returns (loss, variables)."""

    name: str
    build: Callable[[], BuiltModel]
    description: str = ""


def _raw_graph(function: str, **kwargs) -> Callable[[], BuiltModel]:
    """A ``build()`` calling ``memsave_grads.bench.graphs.<function>(**kwargs)``; TensorFlow is
    imported when the model is built."""
    def build() -> BuiltModel:
        from memsave_grads.bench import graphs  # pylint: disable=import-outside-toplevel
        return getattr(graphs, function)(**kwargs)
    return build


def _keras_graph(function: str, **kwargs) -> Callable[[], BuiltModel]:
    """A ``build()`` calling ``memsave_grads.bench.keras_graphs.<function>(**kwargs)``."""
    def build() -> BuiltModel:
        from memsave_grads.bench import keras_graphs  # pylint: disable=import-outside-toplevel
        return getattr(keras_graphs, function)(**kwargs)
    return build


# --------------------------------------------------------------------------------------------
# Raw-op models (memsave_grads.bench.graphs)
# --------------------------------------------------------------------------------------------


def residual_mlp(depth: int, width: int, batch: int, seed: int = 0) -> ModelSpec:
    """``depth`` residual blocks ``h = h + tanh(h @ W_i)``; one activation is
    ``batch * width * 4`` bytes."""
    return ModelSpec(
        f"residual MLP d={depth} w={width} b={batch}",
        _raw_graph("mlp", depth=depth, width=width, batch=batch, residual=True, seed=seed),
        f"residual MLP: {depth} blocks h = h + tanh(h @ W_i), width {width}, batch {batch}")


def tanh_mlp(depth: int, width: int, batch: int, seed: int = 0) -> ModelSpec:
    """A plain chain of ``depth`` layers ``h = tanh(h @ W_i)``."""
    return ModelSpec(
        f"tanh MLP d={depth} w={width} b={batch}",
        _raw_graph("mlp", depth=depth, width=width, batch=batch, residual=False, seed=seed),
        f"tanh MLP chain: {depth} layers h = tanh(h @ W_i), width {width}, batch {batch}")


def conv_resnet(blocks: int = 16, batch: int = 32, image: int = 32,
                channels: Sequence[int] = (32, 64), classes: int = 10,
                seed: int = 0) -> ModelSpec:
    """A small ResNet from raw ops (see :func:`memsave_grads.bench.graphs.conv_resnet`)."""
    return ModelSpec(
        f"conv ResNet {blocks} blocks b={batch} {image}x{image}",
        _raw_graph("conv_resnet", blocks=blocks, batch=batch, image=image,
                   channels=tuple(channels), classes=classes, seed=seed),
        f"ResNet-style conv net: {blocks} residual blocks, channels {list(channels)}, "
        f"{image}x{image} images, batch {batch}")


# --------------------------------------------------------------------------------------------
# Keras 2 models (memsave_grads.bench.keras_graphs; need tf_keras when built)
# --------------------------------------------------------------------------------------------


def keras_application(name: str, constructor: str, batch: int, image: int, classes: int = 10,
                      seed: int = 0) -> ModelSpec:
    """``tf_keras.applications.<constructor>(weights=None)`` in training mode."""
    return ModelSpec(
        f"{name} b={batch} {image}x{image}",
        _keras_graph("application", constructor=constructor, batch=batch, image=image,
                     classes=classes, seed=seed),
        f"tf_keras.applications.{constructor}(weights=None), {image}x{image} images, "
        f"batch {batch}, training mode")


def resnet50(batch: int = 8, image: int = 128) -> ModelSpec:
    return keras_application("ResNet50", "ResNet50", batch, image)


def densenet121(batch: int = 8, image: int = 128) -> ModelSpec:
    return keras_application("DenseNet121", "DenseNet121", batch, image)


def mobilenet_v2(batch: int = 8, image: int = 128) -> ModelSpec:
    return keras_application("MobileNetV2", "MobileNetV2", batch, image)


def unet(batch: int = 4, image: int = 128, base_filters: int = 32, depth: int = 4,
         classes: int = 4, seed: int = 0) -> ModelSpec:
    """The U-Net of Ronneberger et al. (2015), scaled down (see
    :func:`memsave_grads.bench.keras_graphs.unet`)."""
    return ModelSpec(
        f"U-Net depth={depth} b={batch} {image}x{image}",
        _keras_graph("unet", batch=batch, image=image, base_filters=base_filters,
                     depth=depth, classes=classes, seed=seed),
        f"U-Net: {depth} levels, {base_filters}..{base_filters * 2 ** depth} filters, "
        f"{image}x{image} images, batch {batch}, per-pixel softmax loss")


def transformer(layers_count: int = 8, batch: int = 8, sequence: int = 256, d_model: int = 256,
                heads: int = 8, mlp_ratio: int = 4, classes: int = 10,
                seed: int = 0) -> ModelSpec:
    """A pre-norm Transformer encoder stack (see
    :func:`memsave_grads.bench.keras_graphs.transformer`)."""
    return ModelSpec(
        f"Transformer {layers_count} layers b={batch} seq={sequence}",
        _keras_graph("transformer", layers_count=layers_count, batch=batch,
                     sequence=sequence, d_model=d_model, heads=heads, mlp_ratio=mlp_ratio,
                     classes=classes, seed=seed),
        f"Transformer encoder: {layers_count} pre-norm layers (MultiHeadAttention {heads} heads, "
        f"LayerNorm, GELU MLP x{mlp_ratio}), d_model {d_model}, sequence {sequence}, "
        f"batch {batch}")


#: The Keras model families of the benchmark, by a short name.
KERAS_MODELS: dict[str, Callable[[], ModelSpec]] = {
    "resnet50": resnet50,
    "densenet121": densenet121,
    "mobilenetv2": mobilenet_v2,
    "unet": unet,
    "transformer": transformer,
}


# --------------------------------------------------------------------------------------------
# What each command measures, and --models
# --------------------------------------------------------------------------------------------


def keras_models() -> list[ModelSpec]:
    """The Keras networks at the benchmark's sizes."""
    return [make() for make in KERAS_MODELS.values()]


def benchmark_models() -> list[ModelSpec]:
    """The models of ``memsave-grads benchmark`` (and explain, budgets, tradeoff): the Keras
    networks (they need ``tf_keras``), a deep MLP, a tanh chain and a small conv ResNet."""
    return [
        *keras_models(),
        residual_mlp(depth=128, width=512, batch=256),
        tanh_mlp(depth=64, width=1024, batch=256),
        conv_resnet(blocks=16, batch=32, image=32, channels=(32, 64)),
    ]


@dataclasses.dataclass(frozen=True)
class XlaSpec:
    """A model of the XLA table: ``memsave_grads.bench.xla.<function>(**kwargs)`` builds it
    (a ``BlockModel``: eager variables and block functions) in the process that measures it,
    which is why the spec is a name and JSON-able arguments rather than a closure."""

    name: str
    function: str
    kwargs: dict
    description: str = ""


def xla_models() -> list[XlaSpec]:
    """The benchmark's XLA table (the peer table): the networks of :func:`benchmark_models`
    that are stacks of blocks (so that ``tf.recompute_grad`` and ``keras.RematScope`` can wrap
    them), under the same family names; the Transformer is written in raw ops (no biases,
    LayerNorm without offset), not Keras', says so in its name, and has sequence 128 (issue
    36's peer table)."""
    return [
        XlaSpec("Transformer 8 layers b=8 seq=128 (raw ops)", "transformer",
                {"layers_count": 8, "batch": 8, "sequence": 128},
                "Transformer encoder (raw ops): 8 pre-norm layers, d_model 256, sequence 128, "
                "batch 8"),
        XlaSpec("residual MLP d=128 w=512 b=256", "mlp",
                {"depth": 128, "width": 512, "batch": 256, "residual": True},
                "residual MLP: 128 blocks, width 512, batch 256"),
        XlaSpec("tanh MLP d=64 w=1024 b=256", "mlp",
                {"depth": 64, "width": 1024, "batch": 256, "residual": False},
                "tanh MLP chain: 64 layers, width 1024, batch 256"),
        XlaSpec("conv ResNet 16 blocks b=32 32x32", "conv_resnet",
                {"blocks": 16, "batch": 32, "image": 32},
                "ResNet-style conv net: 16 residual blocks, 32x32 images, batch 32"),
    ]


#: Depths of the residual family whose peak memory ``memsave-grads scaling`` plots.
SCALING_DEPTHS = (8, 16, 32, 64, 128, 256)


def scaling_models(width: int = 512, batch: int = 128) -> list[ModelSpec]:
    return [residual_mlp(depth=d, width=width, batch=batch) for d in SCALING_DEPTHS]


def _simplified(text: str) -> str:
    """How ``--models`` compares names: case-insensitive, hyphens ignored ('unet' = 'U-Net')."""
    return text.lower().replace("-", "")


def unmatched_filters(models: Sequence[ModelSpec], filters: Sequence[str]) -> list[str]:
    """The ``filters`` (substrings of model names) that match none of ``models``."""
    return [f for f in filters if not any(_simplified(f) in _simplified(m.name) for m in models)]


def select(models: Sequence[ModelSpec], filters: Sequence[str]) -> list[ModelSpec]:
    """The ``models`` whose name contains one of ``filters`` (all of them when it is empty)."""
    if not filters:
        return list(models)
    wanted = [_simplified(f) for f in filters]
    return [m for m in models if any(w in _simplified(m.name) for w in wanted)]
