"""keras_hub's architectures, trained by Keras 3's ``fit`` step with and without XLA, stock and
under :func:`memsave_grads.wrap_model` (``memsave-grads benchmark --hub only``;
docs/benchmarks.md, "keras_hub under XLA").

Each architecture is its keras_hub backbone built from a small configuration (no preset, no
download: the layers and the graph are the library's, the sizes are ours), with a language-model
head (a ``Dense`` to the vocabulary) and sparse cross-entropy, compiled with ``jit_compile``
False or True. Each (architecture, method, compilation) is measured in a fresh process
(:func:`measure`, which runs this module as a script): the allocator's peak of a
``train_on_batch`` step, the median of :data:`PEAK_RUNS` steps after a warm-up one, in bytes above
what is in use before the step (the weights and the optimizer's state are resident). The step
times of one (architecture, compilation) are measured in one more process, the stock and the
wrapped model (built from the same seed) stepping in turns, so that their ratio holds on a loaded
machine. Needs ``pip install keras-hub`` (not a dependency of memsave_grads).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

from memsave_grads import _child as child
from memsave_grads import _tables as tables
from memsave_grads import measure as measure_lib
from memsave_grads.bench import models
from memsave_grads.bench.models import PEAK_RUNS

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The methods: (key, label); the first is the reference.
METHODS = (("stock", "stock fit"), ("memory", "wrap_model 'memory'"))


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes every architecture is built with: ``layers`` blocks of ``hidden`` units
    (``heads`` attention heads, a feed-forward of ``intermediate``), a vocabulary of
    ``vocabulary`` tokens, ``batch`` sequences of ``sequence`` tokens."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    intermediate: int = 1024
    vocabulary: int = 1000
    batch: int = 8
    sequence: int = 128


def _decoder_inputs(shape: Shape, rng) -> dict:
    tokens = rng.integers(1, shape.vocabulary, (shape.batch, shape.sequence))
    return {"token_ids": tokens, "padding_mask": tokens > 0}


def _encoder_inputs(shape: Shape, rng) -> dict:
    inputs = _decoder_inputs(shape, rng)
    inputs["segment_ids"] = 0 * inputs["token_ids"]
    return inputs


def _seq2seq_inputs(shape: Shape, rng) -> dict:
    encoder, decoder = _decoder_inputs(shape, rng), _decoder_inputs(shape, rng)
    return {"encoder_token_ids": encoder["token_ids"],
            "encoder_padding_mask": encoder["padding_mask"],
            "decoder_token_ids": decoder["token_ids"],
            "decoder_padding_mask": decoder["padding_mask"]}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One keras_hub backbone: its class name, its arguments for a :class:`Shape`, the inputs it
    takes and the output the head reads."""

    key: str
    label: str
    backbone: str
    arguments: Callable[[Shape], dict]
    inputs: Callable[[Shape, object], dict] = _decoder_inputs
    output: str | None = None

    @property
    def name(self) -> str:
        """What ``--models`` matches (as :func:`memsave_grads.bench.models.select` does)."""
        return self.label


def _gqa(shape: Shape) -> dict:
    """A decoder with grouped-query attention (two query heads per key/value head)."""
    return {"num_layers": shape.layers, "num_query_heads": shape.heads,
            "num_key_value_heads": max(shape.heads // 2, 1), "hidden_dim": shape.hidden,
            "intermediate_dim": shape.intermediate}


ARCHITECTURES = (
    Architecture("gpt2", "GPT-2", "GPT2Backbone", lambda s: {
        "num_layers": s.layers, "num_heads": s.heads, "hidden_dim": s.hidden,
        "intermediate_dim": s.intermediate, "max_sequence_length": s.sequence,
        "dropout": 0.0}),
    Architecture("llama", "Llama", "LlamaBackbone", _gqa),
    Architecture("gemma", "Gemma", "GemmaBackbone",
                 lambda s: {**_gqa(s), "head_dim": s.hidden // s.heads}),
    Architecture("qwen3_moe", "Qwen3-MoE (4 experts, top 2)", "Qwen3MoeBackbone",
                 lambda s: {**_gqa(s), "head_dim": s.hidden // s.heads,
                            "moe_intermediate_dim": s.intermediate // 4, "num_experts": 4,
                            "top_k": 2}),
    Architecture("bert", "BERT", "BertBackbone", lambda s: {
        "num_layers": s.layers, "num_heads": s.heads, "hidden_dim": s.hidden,
        "intermediate_dim": s.intermediate, "max_sequence_length": s.sequence,
        "dropout": 0.0}, _encoder_inputs, "sequence_output"),
    Architecture("t5", "T5 (encoder-decoder)", "T5Backbone", lambda s: {
        "num_layers": s.layers // 2, "num_heads": s.heads, "hidden_dim": s.hidden,
        "intermediate_dim": s.intermediate, "dropout": 0.0}, _seq2seq_inputs,
        "decoder_sequence_output"),
)


def architecture(key: str) -> Architecture:
    return next(a for a in ARCHITECTURES if a.key == key)


def select(filters: Sequence[str]) -> list[Architecture]:
    """The architectures whose label contains one of ``filters``, as ``--models`` matches
    names (all of them when it is empty)."""
    return models.select(ARCHITECTURES, filters)


@dataclasses.dataclass
class Result:
    """One (architecture, method, compilation): the step's peak, its median step time (in the
    shared timing process), or why it failed."""

    architecture: str
    method: str
    jit_compile: bool
    peak_bytes: int | None = None
    step_seconds: float | None = None
    failed: str = ""


def build(arch: Architecture, shape: Shape, jit_compile: bool, seed: int = 0):
    """The compiled Keras 3 model (backbone + language-model head) and one batch for it."""
    import keras  # pylint: disable=import-outside-toplevel
    import keras_hub  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, arch.backbone)(
        vocabulary_size=shape.vocabulary, **arch.arguments(shape))
    inputs = {name: keras.Input(tensor.shape[1:], dtype=tensor.dtype, name=name)
              for name, tensor in backbone.input.items()}
    outputs = backbone(inputs)
    sequence = outputs[arch.output] if arch.output else outputs
    model = keras.Model(inputs, keras.layers.Dense(shape.vocabulary)(sequence))
    model.compile(optimizer=keras.optimizers.SGD(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    rng = np.random.default_rng(seed)
    batch = arch.inputs(shape, rng)
    labels = rng.integers(0, shape.vocabulary, (shape.batch, shape.sequence))
    return model, batch, labels


def measure(arch: Architecture, method: str, jit_compile: bool,
            shape: Shape = Shape()) -> Result:
    """The peak of one (architecture, method, compilation), in a fresh process."""
    request = {"architecture": arch.key, "methods": [method], "jit_compile": jit_compile,
               "measure": "peak", "shape": dataclasses.asdict(shape)}
    outcome = child.run(__name__, request)
    result = Result(arch.key, method, jit_compile)
    if outcome.returncode != 0 or outcome.result is None:
        result.failed = outcome.last_error_line()
        _LOG.error("%s / %s / jit_compile=%s failed:\n%s", arch.key, method, jit_compile,
                   outcome.stderr[-3000:])
        return result
    result.peak_bytes = outcome.result["peak_bytes"]
    _LOG.info("%s / %s / jit_compile=%s: peak %.1f MiB", arch.key, method, jit_compile,
              result.peak_bytes / measure_lib.MIB)
    return result


def measure_all(architectures: Sequence[Architecture], shape: Shape = Shape(),
                repeats: int = 3) -> list[list[Result]]:
    """Every architecture's cells, one list per architecture: the peaks, then the step times
    of each compilation, both methods in turns in one process."""
    all_results = []
    for arch in architectures:
        results = [measure(arch, method, jit, shape)
                   for jit in (False, True) for method, _ in METHODS]
        for jit in (False, True):
            request = {"architecture": arch.key, "methods": [m for m, _ in METHODS],
                       "jit_compile": jit, "measure": "time", "repeats": repeats,
                       "shape": dataclasses.asdict(shape)}
            outcome = child.run(__name__, request)
            if outcome.returncode != 0 or outcome.result is None:
                _LOG.error("%s / jit_compile=%s: timing failed:\n%s", arch.key, jit,
                           outcome.stderr[-3000:])
                continue
            for r in results:
                if r.jit_compile == jit:
                    r.step_seconds = outcome.result.get(r.method)
        all_results.append(results)
    return all_results


def _train_step(model, batch, labels):
    """``train_on_batch``, run to completion (it returns host values)."""
    return lambda: model.train_on_batch(batch, labels)


def _measure_here(request: dict) -> dict:
    """The child's side of :func:`measure` and :func:`measure_all`'s timing."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    measure_lib.reserve_cpu_heap()
    arch, shape = architecture(request["architecture"]), Shape(**request["shape"])
    steps = []
    for method in request["methods"]:
        model, batch, labels = build(arch, shape, request["jit_compile"])
        if method == "memory":
            mg.wrap_model(model, checkpoints="memory", fallback="error")
        steps.append(_train_step(model, batch, labels))
    if request["measure"] == "time":
        seconds = measure_lib.interleaved_median_seconds(steps, repeats=request["repeats"])
        return dict(zip(request["methods"], seconds))
    (step,) = steps
    step()  # traced, compiled and warmed up before the peak is read
    peaks = sorted(measure_lib.peak_bytes_of(step)[0] for _ in range(PEAK_RUNS))
    return {"peak_bytes": peaks[len(peaks) // 2]}


def _mib(value: int | None) -> str:
    return "-" if value is None else tables.number(value / measure_lib.MIB)


def table(results_per_architecture: Sequence[Sequence[Result]]) -> str:
    """One row per architecture: each compilation's stock and wrapped peaks, the saving and the
    time ratio."""
    rows = []
    labels = {a.key: a.label for a in ARCHITECTURES}
    for results in results_per_architecture:
        cells = {(r.method, r.jit_compile): r for r in results}
        row = [labels[results[0].architecture]]
        for jit in (False, True):
            stock, ours = cells[("stock", jit)], cells[("memory", jit)]
            saving = (f"{stock.peak_bytes / ours.peak_bytes:.2f}x"
                      if stock.peak_bytes and ours.peak_bytes else ours.failed[:60] or "-")
            time_ratio = (f"{ours.step_seconds / stock.step_seconds:.2f}x"
                          if stock.step_seconds and ours.step_seconds else "-")
            row += [_mib(stock.peak_bytes), _mib(ours.peak_bytes), saving, time_ratio]
        rows.append(row)
    return tables.markdown_table(
        ["architecture", "stock MiB", "wrap_model MiB", "less", "time",
         "stock MiB XLA", "wrap_model MiB XLA", "less XLA", "time XLA"], "lrrrrrrrr", rows)


TABLE_NOTES = (
    "Keras 3 fit steps (train_on_batch, SGD) of keras_hub backbones built from small "
    f"configurations ({Shape().layers} layers, hidden {Shape().hidden}, {Shape().heads} heads, "
    f"feed-forward {Shape().intermediate}, vocabulary {Shape().vocabulary}, batch "
    f"{Shape().batch} x {Shape().sequence} tokens; T5 {Shape().layers // 2} encoder and "
    f"{Shape().layers // 2} decoder layers) with a Dense language-model head. Peaks: the "
    "allocator's, above what is resident before the step, each cell a fresh process, the "
    f"median of {PEAK_RUNS} steps. time: the wrapped model's step against the stock one's, "
    "both stepping in turns in one process (median).")


if __name__ == "__main__":
    child.serve(_measure_here)
