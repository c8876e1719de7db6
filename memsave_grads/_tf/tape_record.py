"""What a ``tf.GradientTape`` recorded in a graph, read from TensorFlow's own tape.

The TensorFlow side of tape routing (design note "tape routing" in docs/design.md; the public
side is :mod:`memsave_grads.tape`). It holds the tape methods as TensorFlow defines them, the
per-tape log of watches that the hooks keep, the thread-isolated query of
TensorFlow's C++ tape, the flattening of targets and sources exactly as
``GradientTape.gradient`` does it, and :func:`tape_view`: which ops of a graph the tape
recorded, as the ``stop_gradients`` that make ``tf.gradients`` see only those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Mapping, Sequence

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.framework import composite_tensor_gradient
from tensorflow.python.platform import tf_logging
from tensorflow.python.util import nest
from tensorflow.python.util import variable_utils

from memsave_grads._tf import graph as tf_graph

#: The methods of ``tf.GradientTape`` that routing replaces (on the class, while a routing is
#: active; :class:`memsave_grads.GradientTape` overrides them itself).
HOOKED_METHODS = ("_push_tape", "watch", "gradient", "jacobian", "batch_jacobian")

#: Those methods as TensorFlow defines them, captured when this module is imported: hooks call
#: these, never whatever the class holds at the time, so a hook never calls itself.
ORIGINAL_METHODS: Mapping[str, Callable] = {
    name: backprop.GradientTape.__dict__[name] for name in HOOKED_METHODS}

#: The attribute of a tape object that holds its :class:`TapeLog`.
_LOG_ATTRIBUTE = "_memsave_grads_tape_log"

#: Incremented each time the class hooks are installed. A log written under another
#: installation may have missed events while no hook was installed.
_hooks_generation = 0
#: The generation of logs kept by a tape class of our own (always hooked, never missed).
OWN_CLASS = -1


# --------------------------------------------------------------------------------------------
# Hooks on the class
# --------------------------------------------------------------------------------------------

def install_hooks(hooks: Mapping[str, Callable]) -> None:
    """Replace ``tf.GradientTape``'s methods named in ``hooks`` (a subset of
    :data:`HOOKED_METHODS`) on the class itself, so every tape, created before or after, and
    reached through any alias (``tf.GradientTape``, ``tf.autodiff``, tf_keras', Keras 3's),
    runs them."""
    global _hooks_generation
    _hooks_generation += 1
    for name, hook in hooks.items():
        setattr(backprop.GradientTape, name, hook)


def uninstall_hooks() -> None:
    """Put TensorFlow's own methods back on ``tf.GradientTape``."""
    for name, method in ORIGINAL_METHODS.items():
        setattr(backprop.GradientTape, name, method)


def hooks_generation() -> int:
    return _hooks_generation


# --------------------------------------------------------------------------------------------
# The log of a tape: its watches, and whether each watched tensor was tracked before
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TapeLog:
    """What the hooks saw of one TensorFlow tape (``tape._tape``; ``reset()`` and a finished
    non-persistent ``gradient`` start a new one)."""

    #: ``hooks_generation()`` when the log began, or :data:`OWN_CLASS`.
    generation: int
    #: Whether the hooks saw the tape from its creation (a tape entered before routing began
    #: was not: its earlier watches are unknown).
    complete: bool
    #: ``tensor.ref()`` -> whether the tape already tracked the tensor when it was first
    #: watched while a watch takes effect (``tape.watch`` does nothing while the thread's
    #: tapes are stopped or none is active). Before any watch, only the recording of its op
    #: makes a tensor tracked; so a watched tensor the tape did not track then is a leaf,
    #: however and whenever its op was made (under ``tape.stop_recording()``, before the
    #: ``with`` block, under TensorFlow's thread-wide ``record.stop_recording()``).
    tracked_when_watched: dict = dataclasses.field(default_factory=dict)

    def up_to_date(self) -> bool:
        """Whether no event since the log began can have gone unseen."""
        return self.complete and self.generation in (OWN_CLASS, _hooks_generation)


def log_of(tape) -> TapeLog | None:
    return tape.__dict__.get(_LOG_ATTRIBUTE)


def push(tape, generation: int) -> None:
    """``tape._push_tape()``, logged: a fresh TensorFlow tape (the first push, after
    ``reset()`` or after a non-persistent ``gradient``) starts a fresh log."""
    fresh = tape._tape is None  # pylint: disable=protected-access
    ORIGINAL_METHODS["_push_tape"](tape)
    if fresh or log_of(tape) is None:
        tape.__dict__[_LOG_ATTRIBUTE] = TapeLog(generation=generation, complete=fresh)


def watch(tape, tensor) -> None:
    """``tape.watch(tensor)``, logged: for each graph tensor watched for the first time,
    whether the tape tracked it just before (asked of TensorFlow's tape, :func:`tracked_by`)."""
    log = log_of(tape)
    if log is None or tape._tape is None or not _could_record():  # pylint: disable=protected-access
        ORIGINAL_METHODS["watch"](tape, tensor)
        return
    try:
        # pylint: disable-next=protected-access
        extracted = list(backprop._extract_tensors_and_variables(tensor))  # a generator
    except ValueError:
        extracted = []  # not a tensor: TensorFlow's watch below raises its own error
    first = [t for t in extracted if isinstance(t, tf.Tensor) and not tf_graph.is_eager_tensor(t)
             and t.ref() not in log.tracked_when_watched]
    # An output of an op without inputs (a placeholder, a constant) is never recorded: asking
    # would only start a thread.
    asked = [t for t in first if t.op.inputs]
    tracked = {t.ref() for t, yes in zip(asked, tracked_by(tape, asked) if asked else ()) if yes}
    ORIGINAL_METHODS["watch"](tape, tensor)
    for t in first:
        log.tracked_when_watched.setdefault(t.ref(), t.ref() in tracked)


def _could_record() -> bool:
    """Whether a watch takes effect now: TensorFlow ignores it while the thread's tapes are
    stopped or none is active."""
    return not pywrap_tfe.TFE_Py_TapeSetIsStopped() and not pywrap_tfe.TFE_Py_TapeSetIsEmpty()


# --------------------------------------------------------------------------------------------
# TensorFlow's own tape, asked
# --------------------------------------------------------------------------------------------

def tracked_by(tape, tensors: Sequence[tf.Tensor]) -> list[bool]:
    """For each tensor, whether ``tape`` tracks it: watched, or an output of an op it recorded,
    with a dtype gradients flow through. TensorFlow's own answer, from its C++ tape.

    TensorFlow only answers for the whole set of active tapes of a thread (``TFE_Py_TapeSet
    ShouldRecordBackprop``); the set is thread-local, so the question is asked from a new
    thread whose set holds this one tape alone. The tape is not changed.
    """
    c_tape = tape._tape._tape  # pylint: disable=protected-access
    answers: list[bool] = []
    failure: list[BaseException] = []

    def ask():
        pywrap_tfe.TFE_Py_TapeSetAdd(c_tape)
        try:
            answers.extend(bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop([t]))
                           for t in tensors)
        except BaseException as e:  # pylint: disable=broad-except
            failure.append(e)
        finally:
            pywrap_tfe.TFE_Py_TapeSetRemove(c_tape)

    thread = threading.Thread(target=ask, name="memsave_grads_tape_query")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return answers


def is_used_up(tape) -> bool:
    """Whether a non-persistent tape has given its one gradient (or jacobian)."""
    return tape._tape is None  # pylint: disable=protected-access


def stop_recording_for_gradient(tape) -> None:
    """What ``gradient`` does first: a non-persistent tape stops recording (a persistent one
    goes on, and records the gradient's ops on itself)."""
    if tape._recording and not tape._persistent:  # pylint: disable=protected-access
        tape._pop_tape()  # pylint: disable=protected-access


def release_after_gradient(tape) -> None:
    """What ``gradient`` does last: a non-persistent tape remembers its watched variables and
    lets TensorFlow's tape go; a persistent one still recording says, once, what TensorFlow's
    ``gradient`` says of it (in TensorFlow's words)."""
    if not tape._persistent:  # pylint: disable=protected-access
        tape._watched_variables = tape._tape.watched_variables()  # pylint: disable=protected-access
        tape._tape = None  # pylint: disable=protected-access
    elif tape._recording:  # pylint: disable=protected-access
        tf_logging.log_first_n(
            tf_logging.WARN, "Calling GradientTape.gradient on a persistent tape inside its "
            "context is significantly less efficient than calling it outside the context (it "
            "causes the gradient ops to be recorded on the tape, leading to increased CPU and "
            "memory usage). Only call GradientTape.gradient inside the context if you actually "
            "want to trace the gradient in order to compute higher order derivatives.", 1)


# --------------------------------------------------------------------------------------------
# Targets, sources and results, as GradientTape.gradient flattens and packs them
# --------------------------------------------------------------------------------------------

def _handle_or_self(value):
    return backprop._handle_or_self(value)  # pylint: disable=protected-access


def flat_targets(target) -> list:
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients(nest.flatten(target))
    return [_handle_or_self(t) for t in flat]


def flat_sources(sources) -> tuple[list, list]:
    """``(raw, flat)``: the sources flattened as given, and as tensors (variables as their
    handles, composite tensors as their components)."""
    raw = nest.flatten(sources)
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients(
        [_handle_or_self(t) for t in raw])
    return raw, flat


def flat_output_gradients(output_gradients) -> list | None:
    if output_gradients is None:
        return None
    flat = nest.flatten(variable_utils.convert_variables_to_tensors(output_gradients))
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients(flat)
    return [None if g is None else tf.convert_to_tensor(g) for g in flat]


def flat_gradients(raw: list, grads: list) -> list:
    """``grads``, one per raw source as TensorFlow's ``gradient`` returns them for the list
    ``raw`` (composite gradients rebuilt), as one per flat source (:func:`flat_sources`):
    what :func:`pack_gradients` packs back into the same gradients."""
    flat: list = []
    for source, grad in zip(raw, grads):
        if grad is None:
            components = composite_tensor_gradient.get_flat_tensors_for_gradients(
                [_handle_or_self(source)])
            flat += [None] * len(components)
        else:
            flat += composite_tensor_gradient.get_flat_tensors_for_gradients([grad])
    return flat


def pack_gradients(sources, raw: list, flat_grads: list):
    """The flat gradients in the structure of ``sources``, composite tensors rebuilt."""
    raw = nest.map_structure(_handle_or_self, raw)
    grads = composite_tensor_gradient.replace_flat_tensors_for_gradients(raw, flat_grads)
    return nest.pack_sequence_as(sources, grads)


# --------------------------------------------------------------------------------------------
# What the tape recorded, as stop_gradients
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TapeView:
    """The tape's view of one ``gradient`` call, or why it cannot be taken exactly."""

    #: Tensors to pass as ``stop_gradients``: inputs of recorded ops (and targets) whose ops the
    #: tape did not record. ``tf.gradients`` treats them as constants, as the tape does.
    stops: list
    #: Why the call must go to TensorFlow's own tape; None where the view is exact.
    reason: str | None = None
    #: The kind of call ``reason`` makes it, one notice each (``tape._notice``).
    kind: str | None = None


def _elsewhere(kind: str, reason: str) -> TapeView:
    return TapeView([], reason, kind)


def _graph_of(targets: Sequence) -> tf.Graph | None:
    graphs = {id(t.graph): t.graph for t in targets
              if isinstance(t, tf.Tensor) and not tf_graph.is_eager_tensor(t)}
    return next(iter(graphs.values())) if len(graphs) == 1 else None


def tape_view(tape, log: TapeLog, targets: Sequence, sources: Sequence) -> TapeView:
    """Which ops of the targets' graph ``tape`` recorded, as the stops of a ``tf.gradients``
    call that then gives the tape's gradients (design note "tape routing").

    An op was recorded when TensorFlow's tape tracks one of its outputs (:func:`tracked_by`)
    and that output was not merely watched: a watched output the tape did not track before
    the watch is a leaf (:class:`TapeLog`). ``reason`` is set where the tape's answer cannot
    be had this way: targets of several graphs or eager ones, a source the tape does not
    track that a recorded op reads (the C++ tape computes a gradient for it, then deletes it
    once its last reader is processed, unless some reader never is), a recorded dependence
    that leaves the graph through a captured value other than a source, or a recorded op
    whose gradient ``Graph.gradient_override_map`` replaced (tf.gradients follows the
    override; the tape looks gradient functions up by op type).
    """
    graph = _graph_of(targets)
    if graph is None or len(targets) != sum(1 for t in targets if isinstance(t, tf.Tensor)):
        return _elsewhere("gradient of targets in several graphs",
                          "its targets are not tensors of one graph")
    closure = list(tf_graph.walk([t.op for t in targets], tf_graph.input_ops,
                                 include=lambda op: op.graph is graph))
    slots = [tf_graph.as_seen_from(s, graph) for s in sources]
    queried = [t for op in closure for t in op.outputs if tf_graph.carries_gradients(t)]
    queried += [s for s in slots if s is not None]
    # What each capture of the graph (a placeholder; a constant for a small eager tensor)
    # captured, from one pass over the captures.
    captured = {inner.ref(): outer for outer, inner in getattr(graph, "captures", ())
                if isinstance(inner, tf.Tensor)}
    # A capture of an eager value (a variable's handle) is asked as that value: the tape
    # records a variable read, and a call of a function that captured it, against the eager
    # value itself, not against the placeholder the graph op reads.
    probes = []
    for t in queried:
        value = captured.get(t.ref())
        probes.append(value if value is not None and tf_graph.is_eager_tensor(value) else t)
    tracked = {t.ref() for t, yes in zip(queried, tracked_by(tape, probes)) if yes}
    recorded = {op: _recorded(op, tracked, log) for op in closure}

    walked = list(tf_graph.walk([t.op for t in targets if recorded.get(t.op)],
                                tf_graph.input_ops,
                                include=lambda op: op.graph is graph and recorded.get(op)))
    for op in walked:
        override = tf_graph.gradient_override(op)
        # tf.custom_gradient's IdentityN carries an override too, and the tape records its
        # outputs again with the same custom function: there the two agree.
        if override is not None and not tf_graph.is_custom_gradient_override(override):
            return _elsewhere(
                "gradient through an op with a gradient_override_map",
                f"it recorded {op.name!r} ({op.type}), whose gradient Graph."
                f"gradient_override_map replaced with {override!r}, which tf.gradients "
                "follows and the tape does not")

    def must_stop(u) -> bool:
        """Whether tf.gradients would go on beyond ``u`` where the tape does not: into the
        inputs of an op it did not record, or out through a capture of a graph value (not an
        eager one: nothing computes those) that it did not record."""
        if recorded.get(u.op) or not tf_graph.carries_gradients(u):
            return False
        value = captured.get(u.ref())
        captures_graph_value = value is not None and not tf_graph.is_eager_tensor(value)
        return bool(u.op.inputs) or (captures_graph_value and u.ref() not in tracked)

    stops = {u.ref(): u for u in [*targets, *(u for op in walked for u in op.inputs)]
             if must_stop(u)}
    reading = {u.ref() for op in walked for u in op.inputs}
    for source, slot in zip(sources, slots):
        if slot is not None and slot.ref() in reading and slot.ref() not in tracked:
            return _elsewhere("gradient of a source the tape does not track",
                              f"a source it does not track ({_name(source)}) is read by an "
                              "op it recorded")
    stop_ops = {t.op for t in stops.values()}
    outer = [s for s in sources if not tf_graph.is_eager_tensor(s) and s.graph is not graph]
    for placeholder in tf_graph.crossing_captures(targets, outer, stop_ops=stop_ops):
        value = tf_graph.captured_value(placeholder)
        if not any(value is s for s in outer):
            return _elsewhere("gradient through a captured value that is not a source",
                              f"what it recorded leaves the graph through the captured "
                              f"{value.name!r}, which is not a source")
    return TapeView(sorted(stops.values(), key=lambda t: tf_graph.creation_index(t.op)))


def _name(t) -> str:
    return "an eager tensor" if tf_graph.is_eager_tensor(t) else repr(t.name)


def _recorded(op, tracked: set, log: TapeLog) -> bool:
    """Whether the tape recorded ``op``: one of its outputs is tracked, and not only because
    it was watched (it was tracked already when first watched, or never watched)."""
    if not op.inputs:
        return False
    return any(t.ref() in tracked and log.tracked_when_watched.get(t.ref(), True)
               for t in op.outputs)


# --------------------------------------------------------------------------------------------
# Routing off while a gradient is being built
# --------------------------------------------------------------------------------------------

_building = threading.local()


@contextlib.contextmanager
def building_gradients():
    """Within it (on this thread), tapes are not routed: it surrounds every gradient
    computation we run or hand to TensorFlow, so a tape that a gradient function opens
    itself (``tf.recompute_grad``'s) runs as TensorFlow's."""
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1


def is_building_gradients() -> bool:
    return getattr(_building, "depth", 0) > 0
