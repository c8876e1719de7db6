"""``fit-limit``: the largest batch (or sequence length) of *your* model that trains within a
memory limit, with plain ``tf.gradients`` and with each memsave_grads strategy.

The question a user brings is not "how many MiB" but "how much larger can I train". This
module answers it the only honest way: it tries. Every try is one fresh process
(``python -m memsave_grads.fit_limit REQUEST``) whose allocator is capped before
TensorFlow starts: on CPU with ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (the BFC allocator then refuses
what would pass the limit; it grows in regions of doubling size, as a GPU's does with memory
growth on, unless ``reserve_limit`` takes the whole limit as one region first, as a GPU's does
by default), on a GPU with a logical device of that ``memory_limit``. The try
loads the model, runs one step to trace it and one or more measured steps; it fits when no
step ran out of memory. A search doubles the size from ``start`` until a try fails, then
bisects between the last size that fit and the first that did not.

What a model is (:func:`describe_source`):

- a ``.keras`` file saved after ``compile()``: Keras 3 loads it;
- a SavedModel folder written by tf_keras ``model.save(folder)``, or an ``.h5`` file tf_keras
  saved: tf_keras loads it (an ``.h5`` that Keras 3 saved is refused: see :func:`_h5_kind`);
- ``module:function`` or ``path/to/file.py:function``: called as ``function(batch_size)``
  (with ``--vary sequence``: ``function(batch_size, sequence_length)``), it returns a compiled
  Keras model (its data is made up from its input and output shapes, see
  :func:`memsave_grads.keras.synthetic_batch`), a ``(model, (x, y))`` pair with your data,
  or a no-argument training-step callable (a ``tf.function`` that computes its gradients with
  ``tf.gradients``; memsave_grads reaches it through :func:`memsave_grads.patch`).

Methods: ``tf.gradients`` (Keras' own ``train_on_batch``, or the step unpatched), one per
``--checkpoints`` strategy (Keras: :func:`memsave_grads.wrap_model`; a step: ``patch``, its
calls under :func:`memsave_grads.without_grappler_scheduling` as wrap_model runs ``fit``), and
for Keras 3 models ``keras.RematScope`` (Keras' own rematerialisation, the model built or
loaded inside ``RematScope(mode="full")``, trained by Keras' own step).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import time
from typing import Callable, Sequence

from memsave_grads import measure
from memsave_grads import _child as child
from memsave_grads import _tables as tables

#: The reference method's name, and Keras 3's own rematerialisation.
PLAIN = "tf.gradients"
KERAS_REMAT = "keras.RematScope"
#: Appended to a strategy's name: the same under wrap_model(..., release_gradients_early=True).
EARLY_RELEASE = " + early release"
#: The allocator cap on CPU, read once when TensorFlow's CPU allocator starts.
CPU_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
#: How long one process (a try, or the check before the search) may run.
PROCESS_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try: ``fits`` unless it ran out of memory (``error`` says how) or failed."""

    method: str
    size: int
    fits: bool
    peak_bytes: int | None = None
    #: the peak above what was in use when the step started (weights, optimizer state, data):
    #: what the step itself allocates, which a memory budget is about.
    step_peak_bytes: int | None = None
    step_seconds: float | None = None
    error: str = ""
    out_of_memory: bool = False
    #: how many fresh processes tried this size (all of them fit, where ``fits``).
    tries: int = 1

    @property
    def seconds_per_unit(self) -> float | None:
        """The step's seconds over its size: per example where the batch varies, per
        position where the sequence length does."""
        return None if self.step_seconds is None else self.step_seconds / self.size


@dataclasses.dataclass
class Search:
    """All tries of one method; ``largest`` is the largest size that fit (None: not even
    ``start``)."""

    method: str
    attempts: list = dataclasses.field(default_factory=list)

    @property
    def largest(self) -> Attempt | None:
        fitting = [a for a in self.attempts if a.fits]
        return max(fitting, key=lambda a: a.size) if fitting else None

    @property
    def reached_max(self) -> bool:
        """Whether every try fit: the search stopped at ``--max``, not at the limit, so
        :attr:`largest` is a lower bound."""
        return bool(self.attempts) and all(a.fits for a in self.attempts)

    @property
    def largest_text(self) -> str:
        """The largest size that fit, ``">= N"`` where it is a lower bound
        (:attr:`reached_max`); ``"-"`` where nothing fit."""
        best = self.largest
        if best is None:
            return "-"
        return f"{'>= ' if self.reached_max else ''}{best.size}"

    @property
    def failure(self) -> str:
        """Why the search stopped where it did (the first non-memory failure, if any)."""
        broken = [a for a in self.attempts if not a.fits and not a.out_of_memory]
        return broken[0].error if broken else ""


# --------------------------------------------------------------------------------------------
# The model argument (checked by the command line before TensorFlow is imported)
# --------------------------------------------------------------------------------------------

def describe_source(source: str) -> str:
    """``"keras file"``, ``"tf_keras h5"``, ``"saved model"`` or ``"function"``; ValueError
    saying what a model argument may be, for anything else."""
    if source.endswith((".keras", ".h5")) and not os.path.isfile(source):
        raise ValueError(f"expected a .keras or .h5 file saved with model.save(), but "
                         f"{source} does not exist (or is not a file)")
    if os.path.isfile(source) and source.endswith(".keras"):
        return "keras file"
    if os.path.isfile(source) and source.endswith(".h5"):
        return _h5_kind(source)
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "saved_model.pb")):
        return "saved model"
    module, sep, function = source.rpartition(":")
    if sep and module and function.isidentifier():
        if module.endswith(".py"):
            if os.path.isfile(module):
                return "function"
            raise ValueError(f"{module} does not exist (from {source!r})")
        if all(part.isidentifier() for part in module.split(".")):
            return "function"
    raise ValueError(
        f"expected a .keras/.h5 file, a SavedModel folder (saved by tf_keras), or "
        f"module:function / path/to/file.py:function returning a model; got {source!r}")


def _h5_kind(path: str) -> str:
    """``"tf_keras h5"`` for an HDF5 model tf_keras saved; ValueError with the remedy for one
    Keras 3 saved (its legacy loader builds the optimizer for other variables, and the first
    step fails with 'Unknown variable': seen with Keras 3.15) or for no saved model at all."""
    import h5py  # pylint: disable=import-outside-toplevel  # TensorFlow's dependency
    try:
        with h5py.File(path, "r") as file:
            version = file.attrs.get("keras_version")
    except OSError as e:
        raise ValueError(f"{path} is not an HDF5 file h5py can read ({e})") from None
    version = version.decode() if isinstance(version, bytes) else version
    if version is None:
        raise ValueError(f"{path} holds no Keras model (no keras_version attribute: weights "
                         "only?); save the whole model with model.save('model.keras')")
    if not str(version).startswith("2."):
        raise ValueError(
            f"{path} was saved by Keras {version} in the legacy HDF5 format, whose loaded "
            "optimizer cannot train the loaded model ('Unknown variable'); save it as a .keras "
            "file instead: model.save('model.keras')")
    return "tf_keras h5"


def _load_function(source: str) -> Callable:
    module_name, _, function_name = source.rpartition(":")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_fit_limit_user_module", module_name)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    return getattr(module, function_name)


# --------------------------------------------------------------------------------------------
# One try, in the child process
# --------------------------------------------------------------------------------------------

def _cap_allocator(limit_mib: int | None, reserve_limit: bool) -> None:
    """The cap inside the child: a GPU gets a logical device of the limit (which takes it as
    one region); on CPU the environment variable already caps the allocator, and
    ``reserve_limit`` takes the limit as one region. No limit (the uncapped retry of a crash,
    :func:`_crash_was_memory`): nothing."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if limit_mib is None:
        return
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)])
    elif reserve_limit:
        measure.reserve_cpu_heap(limit_mib * measure.MIB)


def build(source: str, batch: int, sequence: int | None = None):
    """What the model argument gives, built for one size: ("keras", model, (x, y)) or
    ("step", step, None)."""
    from memsave_grads import keras as keras_lib  # pylint: disable=import-outside-toplevel
    kind = describe_source(source)
    if kind == "keras file":
        import keras  # pylint: disable=import-outside-toplevel
        built = keras.saving.load_model(source)
    elif kind in ("saved model", "tf_keras h5"):
        import tf_keras  # pylint: disable=import-outside-toplevel
        built = tf_keras.models.load_model(source)
    else:
        function = _load_function(source)
        kwargs = {"sequence_length": sequence} if sequence is not None else {}
        if "batch_size" in inspect.signature(function).parameters:
            built = function(batch_size=batch, **kwargs)
        else:
            built = function(batch, **kwargs)
    if callable(built) and not hasattr(built, "trainable_weights"):
        return "step", built, None
    model, data = (built if isinstance(built, tuple) else (built, None))
    keras_lib.keras_version(model)   # our error for anything else
    if data is None:
        data = keras_lib.synthetic_batch(model, batch, sequence)
    return "keras", model, data


def _counting_rewrites():
    """Counts the calls that reach memsave_grads, so that a method is never reported as
    memsave_grads' when its gradients never came through it."""
    from memsave_grads import api  # pylint: disable=import-outside-toplevel
    calls = [0]
    real = api.gradients_or_fallback

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    api.gradients_or_fallback = counting
    return calls


def error_text(error: Exception) -> str:
    """An exception of the user's code, whole, on one line: its type and message (Keras 3's
    wrapper of a layer's error unwrapped as :func:`_error_line` does)."""
    if str(error).lstrip().startswith("Exception encountered when calling"):
        return f"{type(error).__name__}: {_error_line(error)}"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _error_line(error: Exception) -> str:
    """The line of an exception's message that says what went wrong: Keras 3 wraps a layer's
    error in "Exception encountered when calling X.call()" and ANSI-bolds the cause below it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        return f"{lines[1]} (in {lines[0].rsplit(' ', 1)[-1].rstrip('.')})"
    return lines[0] if lines else ""


def _check_here(request: dict) -> dict:
    """The child's side of :func:`check`: build once, uncapped, and say what was built (for a
    Keras model, with the bytes of its weights and of its optimizer's state)."""
    sequence = request.get("sequence_length")
    try:
        kind, target, data = build(request["source"], request["batch_size"], sequence)
        if kind == "step":
            return {"kind": "step"}
        from memsave_grads import keras as keras_lib  # pylint: disable=import-outside-toplevel
        flavour = keras_lib.flavour_of(target)
        keras_lib.check_trainable(target, flavour, "fit-limit")
        built = {"kind": "keras", "keras": flavour.name,
                 "weights_bytes": _bytes_of(target.weights),
                 "optimizer_state_bytes": _optimizer_state_bytes(target)}
        if sequence is not None:
            # A builder that ignores sequence_length (or a model of a fixed length) gives the
            # same batch at every length: a search over lengths would measure one model.
            try:
                _, _, longer = build(request["source"], request["batch_size"], sequence + 1)
            except Exception:  # pylint: disable=broad-except  # a length it refuses: no answer
                return built
            built["ignores_sequence_length"] = _shapes(data) == _shapes(longer)
        return built
    except Exception as e:  # pylint: disable=broad-except  # the user's model, reported whole
        return {"error": error_text(e)}


def _shapes(data) -> list[tuple]:
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return [tuple(np.shape(a)) for a in tf.nest.flatten(data)]


def _bytes_of(variables) -> int:
    import numpy as np  # pylint: disable=import-outside-toplevel
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype.name if hasattr(v.dtype, "name")
                                                else v.dtype).itemsize for v in variables)


def _optimizer_state_bytes(model) -> int:
    """The bytes of the optimizer's variables once made for the model's trainable weights
    (momentum, Adam's moments...): Keras 3 and tf_keras' optimizers make them in ``build``;
    a legacy tf_keras optimizer, which makes its slots in its first update, counts 0."""
    optimizer = model.optimizer
    build_for = getattr(optimizer, "build", None)
    # Keras 3 says ``built``; tf_keras' optimizers keep ``_built`` once they have built.
    built = getattr(optimizer, "built", getattr(optimizer, "_built", False))
    if callable(build_for) and not built:
        build_for(model.trainable_variables)
    return _bytes_of(getattr(optimizer, "variables", []) or [])


def check(source: str, batch_size: int, sequence_length: int | None = None,
          timeout_s: float = PROCESS_TIMEOUT_S) -> dict | None:
    """Build the model argument once in a fresh process before any try, so that a model that
    cannot train at all is reported once, whole, instead of as every method's failure:
    ``{"kind": "step"}`` or ``{"kind": "keras", "keras": KERAS2 or KERAS3}`` (of
    :mod:`memsave_grads.keras`); ValueError with the loader's or our error otherwise. None
    where the process was killed or ran out of time (the machine's memory at this size, say):
    that says nothing about the model, and the search can still answer."""
    outcome = child.run(__name__, {"check": True, "source": source, "batch_size": batch_size,
                                   "sequence_length": sequence_length}, timeout_s=timeout_s)
    if outcome.timed_out or outcome.crashed:
        return None
    if outcome.result is None:
        raise ValueError(f"building {source} failed: {outcome.last_error_line()}")
    if "error" in outcome.result:
        raise ValueError(f"building {source} failed: {outcome.result['error']}")
    return outcome.result


class _NotApplicable(Exception):
    """A method that does not apply to what the model argument built (its reason)."""


def _method_step(method: str, source: str, batch_size: int, sequence_length: int | None):
    """One training step of the model argument under ``method``, ready to run: ``(run,
    undo)``. ``run()`` trains one step (the first call traces it); ``undo()`` ends what
    ``method`` started in this process (a patch). Raises :class:`_NotApplicable` where the
    method does not apply to what was built."""
    import memsave_grads as mg  # pylint: disable=import-outside-toplevel
    from memsave_grads import keras as keras_lib  # pylint: disable=import-outside-toplevel
    arguments = (source, batch_size, sequence_length)
    if method == KERAS_REMAT:
        import keras  # pylint: disable=import-outside-toplevel
        with keras.RematScope(mode="full"):
            kind, target, data = build(*arguments)
    else:
        kind, target, data = build(*arguments)
    if kind == "keras":
        if method == KERAS_REMAT and keras_lib.keras_version(target) != keras_lib.KERAS3:
            # RematScope leaves a tf_keras model as it is: that row would be stock fit's.
            raise _NotApplicable("keras.RematScope applies to Keras 3 models only")
        if method not in (PLAIN, KERAS_REMAT):
            strategy = method.removesuffix(EARLY_RELEASE)
            mg.wrap_model(target, checkpoints=strategy, fallback="warn",
                          release_gradients_early=strategy != method)
        x, y = data
        return (lambda: target.train_on_batch(x, y)), (lambda: None)
    if method == KERAS_REMAT:
        raise _NotApplicable("keras.RematScope applies to Keras models only")
    if method.endswith(EARLY_RELEASE):
        raise _NotApplicable("early release applies to Keras models only (for a step, call "
                             "memsave_grads.minimize in it)")
    if method == PLAIN:
        return target, lambda: None
    mg.patch(method)

    def run():  # as the docs tell a step's user (wrap_model does it for Keras)
        with mg.without_grappler_scheduling():
            return target()
    return run, lambda: mg.unpatch() if mg.is_patched() else None


def _run_to_end(run) -> None:
    """One step, its results fetched: the step has really run when this returns."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    _ = [float(v) for v in tf.nest.flatten(run()) if hasattr(v, "__float__")]


def _try_here(request: dict) -> dict:
    """The child's side of :func:`attempt` (build, trace, measure; a dict of the result), of
    :func:`check` and of :func:`time_against`."""
    if request.get("check"):
        return _check_here(request)
    if request.get("time"):
        return _time_here(request)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    _cap_allocator(request["limit_mib"], request.get("reserve_limit", False))
    method = request["method"]
    device = measure.default_device()
    calls = _counting_rewrites()
    undo = lambda: None  # noqa: E731
    try:
        run, undo = _method_step(method, request["source"], request["batch_size"],
                                 request.get("sequence_length"))
        run()   # trace and warm up: the measured steps allocate only what they use
        if method not in (PLAIN, KERAS_REMAT) and calls[0] == 0:
            return {"fits": False, "error": (
                "the step's gradients never reached memsave_grads (patch() routes "
                "tf.gradients, and tf.GradientTape inside a tf.function: an eager step, or a "
                "tape entered before the patch, is not)")}
        peaks, step_peaks, seconds = [], [], []
        for _ in range(request["steps"]):
            tf.config.experimental.reset_memory_stats(device)
            before = measure.memory_info(device)["current"]
            start = time.perf_counter()
            _run_to_end(run)
            seconds.append(time.perf_counter() - start)
            peaks.append(measure.memory_info(device)["peak"])
            step_peaks.append(peaks[-1] - before)
    except _NotApplicable as e:
        return {"fits": False, "error": str(e)}
    except tf.errors.ResourceExhaustedError as e:
        lines = str(e).strip().splitlines() or ["out of memory"]
        line = next((x for x in lines if "OOM" in x), lines[0])
        return {"fits": False, "out_of_memory": True, "error": line.strip()[:300]}
    except Exception as e:  # pylint: disable=broad-except  # reported as this try's failure
        return {"fits": False, "error": f"{type(e).__name__}: {_error_line(e)}"[:300]}
    finally:
        undo()
    seconds.sort()
    return {"fits": True, "peak_bytes": max(peaks), "step_peak_bytes": max(step_peaks),
            "step_seconds": seconds[len(seconds) // 2]}


# --------------------------------------------------------------------------------------------
# Timing the methods against each other
# --------------------------------------------------------------------------------------------

#: Rounds of :func:`time_against`: each method runs one step per round, in turn.
TIMING_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class Timing:
    """A method's time per sample (or position) against the reference's, from steps run in
    turn in one process: the median over rounds of the per-round ratio, and its spread."""

    method: str
    ratio: float
    lowest: float
    highest: float

    @property
    def text(self) -> str:
        return f"{self.ratio:.2f}x ({self.lowest:.2f}-{self.highest:.2f})"


def _time_here(request: dict) -> dict:
    """The child's side of :func:`time_against`: every entry's step built and traced, then
    ``rounds`` rounds in which each runs one step, in an order that turns each round."""
    entries = request["entries"]
    runs, undos = [], []
    try:
        for entry in entries:
            run, undo = _method_step(entry["method"], request["source"], entry["batch_size"],
                                     entry.get("sequence_length"))
            undos.append(undo)
            _run_to_end(run)  # trace and warm up
            undo()  # the traced step keeps what the patch made
            runs.append(run)
        seconds = [[] for _ in entries]
        for round_ in range(request["rounds"]):
            for k in range(len(entries)):
                i = (k + round_) % len(entries)
                start = time.perf_counter()
                _run_to_end(runs[i])
                seconds[i].append(time.perf_counter() - start)
    except Exception as e:  # pylint: disable=broad-except  # the timing is left out, said why
        return {"error": error_text(e)}
    finally:
        for undo in undos:
            undo()
    return {"seconds": seconds}


def time_against(source: str, reference: Attempt, others: Sequence[Attempt],
                 sequence_length_fixed: int | None = None, rounds: int = TIMING_ROUNDS,
                 timeout_s: float = PROCESS_TIMEOUT_S) -> tuple[list[Timing], str]:
    """Each of ``others`` (a method at the size it reached) timed against ``reference`` (the
    plain step at its own largest size) in ONE uncapped fresh process, one step each per
    round, in turn: per round, a method's time per unit over the reference's, then the
    median and the spread over the rounds. Times of separate processes at separate moments
    are not compared: on a shared machine they differ by more than the methods do.
    ``sequence_length_fixed``: where the sequence length varies, the batch size it runs at.
    Returns the timings and, where there are none, why."""
    attempts = [reference, *others]

    def entry(a: Attempt) -> dict:
        if sequence_length_fixed is None:
            return {"method": a.method, "batch_size": a.size}
        return {"method": a.method, "batch_size": sequence_length_fixed,
                "sequence_length": a.size}

    outcome = child.run(__name__, {"time": True, "source": source, "rounds": rounds,
                                   "entries": [entry(a) for a in attempts]},
                        env={CPU_LIMIT_ENV: None}, timeout_s=timeout_s)
    result = outcome.result or {}
    if "seconds" not in result:
        why = ("ran past its time" if outcome.timed_out else
               result.get("error") or outcome.last_error_line())
        return [], why
    per_unit = [[t / a.size for t in seconds] for a, seconds in zip(attempts, result["seconds"])]
    timings = []
    for a, mine in zip(others, per_unit[1:]):
        ratios = sorted(m / r for m, r in zip(mine, per_unit[0]))
        timings.append(Timing(a.method, ratios[len(ratios) // 2], ratios[0], ratios[-1]))
    return timings, ""


def attempt(source: str, method: str, batch_size: int, limit_mib: int,
            sequence_length: int | None = None, steps: int = 3,
            timeout_s: float = PROCESS_TIMEOUT_S, reserve_limit: bool = False) -> Attempt:
    """One try in a fresh process under the memory cap (see the module's docstring);
    ``reserve_limit``: on CPU, the whole limit as one allocator region from the start."""
    request = {"source": source, "method": method, "batch_size": batch_size,
               "sequence_length": sequence_length, "limit_mib": limit_mib, "steps": steps,
               "reserve_limit": reserve_limit}
    size = batch_size if sequence_length is None else sequence_length
    outcome = child.run(__name__, request, env={CPU_LIMIT_ENV: str(limit_mib)},
                        timeout_s=timeout_s)
    if outcome.timed_out:
        return Attempt(method, size, False, error=f"ran past {timeout_s:.0f} s")
    if outcome.result is None:
        # A process the allocator could not serve may also die outright.
        out_of_memory = "OOM" in outcome.stderr or "out of memory" in outcome.stderr.lower()
        error = outcome.last_error_line()
        if not out_of_memory and outcome.crashed:
            out_of_memory, error = _crash_was_memory(request, error, timeout_s)
        return Attempt(method, size, False, error=error[:300], out_of_memory=out_of_memory)
    return Attempt(method, size, **outcome.result)


def attempt_repeatedly(try_once: Callable[[], Attempt], tries: int,
                       on_try: Callable[[Attempt, int], None] = lambda a, i: None) -> Attempt:
    """One size tried ``tries`` times, each try its own process: it fits only if every try fit.

    Near the limit a size can fit in one process and run out in the next (the executor orders
    independent ops differently, and the allocator's chunks fall differently), so a largest
    size found with one try per size is partly luck; requiring every one of ``tries`` tries
    to fit makes it less so. Stops at the first try that does not fit and returns it (its
    error says which try it was); otherwise the peak is the largest of the tries' and the
    step time their median (the upper middle one for an even ``tries``, as within a try).
    ``on_try(attempt, index)`` sees each try as it ends.
    """
    fitted = []
    for index in range(1, tries + 1):
        outcome = try_once()
        on_try(outcome, index)
        if not outcome.fits:
            if tries == 1:
                return outcome
            after = f" (after {index - 1} that fit)" if index > 1 else ""
            return dataclasses.replace(
                outcome, tries=index, error=f"try {index} of {tries}{after}: {outcome.error}")
        fitted.append(outcome)
    seconds = sorted(a.step_seconds for a in fitted)
    return dataclasses.replace(
        fitted[0], tries=tries, peak_bytes=max(a.peak_bytes for a in fitted),
        step_peak_bytes=(None if any(a.step_peak_bytes is None for a in fitted)
                         else max(a.step_peak_bytes for a in fitted)),
        step_seconds=seconds[len(seconds) // 2])


def _crash_was_memory(request: dict, error: str, timeout_s: float) -> tuple[bool, str]:
    """A try killed by a signal under the cap: TensorFlow's oneDNN CPU kernels crash (SIGSEGV)
    where the capped allocator refuses them (seen on Keras 3 ResNet50 at the batch after the
    last that fit), but so would a bug. The same try, one step, without the cap tells them
    apart: if it runs, the crash was the cap's."""
    uncapped = child.run(__name__, dict(request, limit_mib=None, steps=1),
                         env={CPU_LIMIT_ENV: None}, timeout_s=timeout_s)
    result = uncapped.result or {}
    if result.get("fits"):
        return True, f"{error} under the cap, and ran without it"
    if result.get("out_of_memory") or uncapped.returncode == -signal.SIGKILL:
        # Too large for the machine itself (the kernel's out-of-memory killer sends SIGKILL).
        return True, f"{error} under the cap, and ran out of the machine's memory without it"
    why = result.get("error") or uncapped.last_error_line()
    return False, f"{error} (also without the cap: {why})"


def search(method: str, try_size: Callable[[int], Attempt], start: int, maximum: int,
           on_attempt: Callable[[Attempt], None] = lambda a: None,
           precision: float = 1 / 16) -> Search:
    """Double from ``start`` while tries fit (up to ``maximum``), then bisect between the last
    size that fit and the first that did not, until they are ``precision`` apart (relative,
    at least 1). Stops at the first failure that is not running out of memory."""
    result = Search(method)

    def run(size: int) -> Attempt:
        outcome = try_size(size)
        result.attempts.append(outcome)
        on_attempt(outcome)
        return outcome

    fit, failed, size = 0, None, start
    while size <= maximum:
        outcome = run(size)
        if not outcome.fits:
            if not outcome.out_of_memory:
                return result
            failed = size
            break
        fit, size = size, size * 2
    if failed is None:
        return result   # fits at maximum, or start > maximum
    while failed - fit > max(1, int(fit * precision)):
        size = (fit + failed) // 2
        outcome = run(size)
        if outcome.fits:
            fit = size
        elif outcome.out_of_memory:
            failed = size
        else:
            return result
    return result


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def progress_line(attempt_: Attempt, dimension: str, baseline: str = PLAIN) -> str:
    """One progress line; the reference method named ``baseline``, as the table names it."""
    method = baseline if attempt_.method == PLAIN else attempt_.method
    if attempt_.fits:
        every = f" in all {attempt_.tries} tries" if attempt_.tries > 1 else ""
        return (f"{method}: {dimension} {attempt_.size} fits{every}, peak "
                f"{attempt_.peak_bytes / measure.MIB:.1f} MiB, {attempt_.step_seconds * 1e3:.0f} ms "
                "per step")
    what = "out of memory" if attempt_.out_of_memory else "failed"
    return f"{method}: {dimension} {attempt_.size} {what}: {attempt_.error[:160]}"


def baseline_name(kind: str | None) -> str:
    """What the reference method is, as the table names it: Keras' own ``fit`` step (which
    differentiates with a tape), or the step as written (``tf.gradients`` unpatched)."""
    return "stock fit" if kind == "keras" else PLAIN


def ratio_text(ratio: float, at_least: bool, at_most: bool) -> str:
    """A size ratio, with ">=" where it is a lower bound (the method still fit at --max) and
    "<=" where it is an upper bound (the reference did); "-" where it is both."""
    if at_least and at_most:
        return "-"
    return f"{'>= ' if at_least else '<= ' if at_most else ''}{ratio:.2f}x"


def table(searches: Sequence[Search], dimension: str, limit_mib: int,
          timings: Sequence[Timing] = (), baseline: str = PLAIN) -> str:
    """One row per method: the largest size that fit (in every try), against the reference's,
    and the time per unit against the reference's where :func:`time_against` measured it."""
    reference = next((s for s in searches if s.method == PLAIN), None)
    reference_best = reference.largest if reference else None
    timed = {t.method: t for t in timings}
    unit = "sample" if dimension == "batch" else "position"   # Attempt.seconds_per_unit
    rows = []
    for s in searches:
        name = baseline if s.method == PLAIN else s.method
        best = s.largest
        if best is None:
            smallest = min((a.size for a in s.attempts), default=None)
            why = s.failure or (f"does not fit at {dimension} {smallest}"
                                if smallest is not None else "not tried")
            rows.append([name, "-", "-", "-", "-", "-", why[:80]])
            continue
        ratio = "-" if reference_best is None or s is reference else ratio_text(
            best.size / reference_best.size, s.reached_max, reference.reached_max)
        timing = timed.get(s.method)
        rows.append([name, s.largest_text, ratio,
                     tables.number(best.seconds_per_unit * 1e3),
                     timing.text if timing else "-",
                     tables.number(best.peak_bytes / measure.MIB), s.failure[:80]])
    return tables.markdown_table(
        ["method", f"largest {dimension}", f"vs {baseline}", f"ms per {unit}",
         f"time per {unit} vs {baseline}", f"peak MiB (limit {limit_mib})", "note"],
        "lrrrrrl", rows)


def search_record(search_: Search, searches: Sequence[Search],
                  baseline: str = PLAIN) -> dict:
    """One method's search as data (``--format json``): its largest size, whether that is a
    lower bound, its ratio to the reference's (None where there is none), and every try. The
    reference is named ``baseline``, as the table names it (``"stock fit"`` for a Keras model),
    so the record's ``method`` matches the JSON's ``reference``."""
    reference = next((s for s in searches if s.method == PLAIN), None)
    best, reference_best = search_.largest, reference.largest if reference else None
    ratio = (best.size / reference_best.size
             if best and reference_best and search_ is not reference else None)
    name = baseline if search_.method == PLAIN else search_.method
    attempts = [dataclasses.replace(a, method=name) for a in search_.attempts]
    return {"method": name, "largest": best.size if best else None,
            "lower_bound": search_.reached_max,
            "reference_lower_bound": bool(reference and reference.reached_max),
            "size_ratio": ratio, "failure": search_.failure, "attempts": attempts}


TABLE_NOTES = (
    "Each try is a fresh process with its allocator capped at the limit (CPU: "
    f"{CPU_LIMIT_ENV}; GPU: a logical device's memory_limit); it fits when one traced step "
    "and the measured steps ran without running out of memory. largest: the largest size that "
    "fit (the search doubles, then bisects to within 1/16); '>=' where it still fit at "
    "--max, and then its ratio is a lower bound ('<=': the reference's was). ms per sample "
    "(or position, where the sequence length varies): the median measured step of the search "
    "at that size over its examples (or positions), under the cap. time per sample vs the "
    "reference: each method at its largest size and the reference at its own, run in turn in "
    f"one uncapped process, {TIMING_ROUNDS} rounds of one step each; the median of the "
    "per-round ratios, and their range in parentheses. peak: the allocator's peak during a "
    "measured step, weights and optimizer state included. With --tries K a size fits only "
    "if each of K fresh processes fit it (peak: the largest of theirs; time: their median).")


def plot(searches: Sequence[Search], dimension: str, limit_mib: int, path: str,
         title: str) -> None:
    """Peak memory against size, every try that fit, one line per method, the limit drawn."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    figure, axes = pyplot.subplots(figsize=(6.5, 4))
    for s in searches:
        fitting = sorted((a for a in s.attempts if a.fits), key=lambda a: a.size)
        if fitting:
            line, = axes.plot([a.size for a in fitting],
                              [a.peak_bytes / measure.MIB for a in fitting], "o-",
                              label=f"{s.method} (largest {s.largest_text})")
            failed = [a.size for a in s.attempts if a.out_of_memory]
            if failed:
                axes.plot(failed, [limit_mib] * len(failed), "x", color=line.get_color())
    axes.axhline(limit_mib, color="gray", linestyle=":", label=f"limit {limit_mib} MiB")
    axes.set_xscale("log", base=2)
    axes.set_xlabel(f"{dimension} (x: out of memory)")
    axes.set_ylabel("peak memory of a training step (MiB)")
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    child.serve(_try_here)
