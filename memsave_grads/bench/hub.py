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
machine; and the wrapped step's gradients are checked against the stock step's in another
(:func:`gradient_error`), since a saving is worth nothing on wrong gradients. Needs
``pip install keras-hub`` (not a dependency of memsave_grads).
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
    #: Whether the backbone builds and trains in float64 (the gradient check's precision,
    #: see :func:`gradient_error`).
    float64: bool = True

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
                            "top_k": 2},
                 # keras_hub 0.32's load-balancing loss multiplies a float32 mask into
                 # float64 routing weights: it cannot build in float64.
                 float64=False),
    # Three more mixtures of experts (four experts, top 2; each expert a quarter of the
    # feed-forward), whose expert weights XLA transposes for the dot like Qwen3-MoE's (design
    # note "memory under XLA", "An einsum's transposed operands wait too").
    Architecture("gpt_oss", "GPT-OSS (4 experts, top 2)", "GptOssBackbone",
                 lambda s: {**_gqa(s), "head_dim": s.hidden // s.heads,
                            "intermediate_dim": s.intermediate // 4, "num_experts": 4,
                            "top_k": 2}),
    Architecture("mixtral", "Mixtral (4 experts, top 2)", "MixtralBackbone",
                 lambda s: {**_gqa(s), "intermediate_dim": s.intermediate // 4,
                            "num_experts": 4, "top_k": 2},
                 float64=False),  # its sparse block mixes float32 into float64, as Qwen3-MoE's
    Architecture("qwen_moe", "Qwen2-MoE (4 experts, top 2, a shared expert)", "QwenMoeBackbone",
                 lambda s: {**_gqa(s), "moe_intermediate_dim": s.intermediate // 4,
                            "shared_expert_intermediate_dim": s.intermediate // 4,
                            "num_experts": 4, "top_k": 2},
                 float64=False),  # likewise
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
    #: The wrapped step's gradients against the stock step's (:func:`gradient_error`); on the
    #: wrapped method's results only.
    max_rel_error: float | None = None


def build(arch: Architecture, shape: Shape, jit_compile: bool, seed: int = 0,
          optimizer=None):
    """The compiled Keras 3 model (backbone + language-model head) and one batch for it;
    trained by SGD unless ``optimizer`` is given."""
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
    model.compile(optimizer=optimizer or keras.optimizers.SGD(1e-3),
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


#: The largest gradient error (:func:`gradient_error`) the benchmark accepts: float32's
#: tolerance (see there for why, although the check runs in float64 where it can).
GRADIENT_TOLERANCE = 1e-5


def gradient_error(arch: Architecture, jit_compile: bool,
                   shape: Shape = Shape()) -> float | None:
    """The wrapped fit step's gradients against the stock one's, in a fresh process: both
    models built from the same seed, in float64 where the architecture builds in it, take one
    ``train_on_batch`` step with an optimizer that records each gradient instead of applying
    it (:func:`_recording_sgd`).

    In float64 because float32 cannot tell: T5's freshly initialized attention kernels get
    gradients near 1e-6 out of sums that cancel, and the stock step compiled with and without
    XLA differs by 3.6e-4 there, more than the wrapped step does (1.3e-4); in float64 the
    wrapped step's error is 4e-13, and a real error stays as large as it was. The tolerance
    stays float32's (:data:`GRADIENT_TOLERANCE`): some layers compute in float32 whatever the
    model's dtype (Gemma's RMS norms: 6e-7 under XLA), and Qwen3-MoE checks in float32. The
    error is the largest over the variables of ``max|ours - stock| / max(max|stock|, floor)``,
    where the floor, 1e-3 of the largest gradient of any variable, keeps a gradient that is
    zero by cancellation (an attention key bias) from reading as 100%. ``None`` (and an error
    logged) where the check failed to run."""
    request = {"architecture": arch.key, "methods": [m for m, _ in METHODS],
               "jit_compile": jit_compile, "measure": "gradients",
               "shape": dataclasses.asdict(shape)}
    outcome = child.run(__name__, request)
    if outcome.returncode != 0 or outcome.result is None:
        _LOG.error("%s / jit_compile=%s: gradient check failed:\n%s", arch.key, jit_compile,
                   outcome.stderr[-3000:])
        return None
    error = outcome.result["max_rel_error"]
    log = _LOG.error if error > GRADIENT_TOLERANCE else _LOG.info
    log("%s / jit_compile=%s: max rel grad err %.2g (tolerance %g)", arch.key, jit_compile,
        error, GRADIENT_TOLERANCE)
    return error


def gradients_wrong(result: Result) -> bool:
    """Whether a wrapped result's gradient check failed to run or found an error above
    :data:`GRADIENT_TOLERANCE` (a stock result: never)."""
    if result.method == METHODS[0][0]:
        return False
    return result.max_rel_error is None or result.max_rel_error > GRADIENT_TOLERANCE


def measure_all(architectures: Sequence[Architecture], shape: Shape = Shape(),
                repeats: int = 3) -> list[list[Result]]:
    """Every architecture's cells, one list per architecture: the peaks, the gradients'
    error, then the step times of each compilation, both methods in turns in one process."""
    all_results = []
    for arch in architectures:
        results = [measure(arch, method, jit, shape)
                   for jit in (False, True) for method, _ in METHODS]
        for r in results:
            if r.method != METHODS[0][0]:
                r.max_rel_error = gradient_error(arch, r.jit_compile, shape)
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


def _recording_sgd():
    """An SGD whose update records each variable's gradient (densified) in a slot instead of
    applying it: what the fit step computed, read back after the step."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class RecordingSGD(keras.optimizers.SGD):
        def build(self, variables):
            super().build(variables)
            self.recorded = [self.add_variable_from_reference(v, "recorded") for v in variables]

        def update_step(self, gradient, variable, learning_rate):
            if isinstance(gradient, tf.IndexedSlices):
                gradient = tf.convert_to_tensor(gradient)
            self.recorded[self._get_variable_index(variable)].assign(gradient)

    return RecordingSGD(1e-3)


def _max_rel_error(gradients, reference) -> float:
    import numpy as np  # pylint: disable=import-outside-toplevel
    floor = 1e-3 * max((float(np.abs(r).max()) for r in reference if r.size), default=0.0)
    worst = 0.0
    for g, r in zip(gradients, reference):
        if r.size:
            scale = max(float(np.abs(r).max()), floor) or 1.0
            difference = np.abs(g - r)
            # A NaN where the other is not: max() would pass it over, so it counts as infinite.
            error = float(np.nanmax(np.where(np.isnan(g) != np.isnan(r), np.inf, difference)))
            worst = max(worst, error / scale)
    return worst


def _measure_here(request: dict) -> dict:
    """The child's side of :func:`measure`, :func:`gradient_error` and :func:`measure_all`'s
    timing."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    measure_lib.reserve_cpu_heap()
    arch, shape = architecture(request["architecture"]), Shape(**request["shape"])
    checking = request["measure"] == "gradients"
    if checking and arch.float64:
        import keras  # pylint: disable=import-outside-toplevel
        keras.config.set_floatx("float64")  # see gradient_error
    steps, recorded = [], []
    for method in request["methods"]:
        model, batch, labels = build(arch, shape, request["jit_compile"],
                                     optimizer=_recording_sgd() if checking else None)
        if method == "memory":
            mg.wrap_model(model, checkpoints="memory", fallback="error")
        steps.append(_train_step(model, batch, labels))
        if checking:
            steps[-1]()
            recorded.append([v.numpy() for v in model.optimizer.recorded])
    if checking:
        reference, ours = recorded
        return {"max_rel_error": _max_rel_error(ours, reference)}
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
            error = "-" if ours.max_rel_error is None else f"{ours.max_rel_error:.1e}"
            row += [_mib(stock.peak_bytes), _mib(ours.peak_bytes), saving, time_ratio, error]
        rows.append(row)
    return tables.markdown_table(
        ["architecture", "stock MiB", "wrap_model MiB", "less", "time", "grad err",
         "stock MiB XLA", "wrap_model MiB XLA", "less XLA", "time XLA", "grad err XLA"],
        "lrrrrrrrrrr", rows)


TABLE_NOTES = (
    "Keras 3 fit steps (train_on_batch, SGD) of keras_hub backbones built from small "
    f"configurations ({Shape().layers} layers, hidden {Shape().hidden}, {Shape().heads} heads, "
    f"feed-forward {Shape().intermediate}, vocabulary {Shape().vocabulary}, batch "
    f"{Shape().batch} x {Shape().sequence} tokens; T5 {Shape().layers // 2} encoder and "
    f"{Shape().layers // 2} decoder layers) with a Dense language-model head. Peaks: the "
    "allocator's, above what is resident before the step, each cell a fresh process, the "
    f"median of {PEAK_RUNS} steps. time: the wrapped model's step against the stock one's, "
    "both stepping in turns in one process (median). grad err: the wrapped step's gradients "
    "against the stock step's (same seed, same batch, both in float64; Qwen3-MoE in float32), "
    "the largest over the variables of the maximum difference over the stock gradient's "
    "maximum (floored at 1e-3 of the largest gradient, for gradients that are zero by "
    f"cancellation); above {GRADIENT_TOLERANCE:g} fails the benchmark.")


if __name__ == "__main__":
    child.serve(_measure_here)
