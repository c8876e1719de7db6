"""``gradients()``: check the arguments (``_validate``) -> make the plan (``_tf.selection``) ->
the never-worse decision -> run the plan's schedule (``_tf.stitch``)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from memsave_grads import _validate
from memsave_grads import errors
from memsave_grads._tf import early_release
from memsave_grads._tf import function_ops
from memsave_grads._tf import graph as tf_graph
from memsave_grads._tf import loops
from memsave_grads._tf import ordering
from memsave_grads._tf import selection
from memsave_grads._tf import stitch
from memsave_grads.core import budgets
from memsave_grads.core import op_types
from memsave_grads.core.checkpoints import ParsedCheckpoints
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import schedule as schedule_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

# Types of the public signatures (with py.typed, what type checkers and IDEs show).
#: ``ys``: a tensor or a list of tensors.
Targets = tf.Tensor | Sequence[tf.Tensor]
#: ``xs``: a tensor or resource variable, or a list of them.
Sources = tf.Tensor | tf.Variable | Sequence[tf.Tensor | tf.Variable]
#: ``checkpoints=``: a strategy name or ``"budget:..."`` string, a Budget, tensors or name
#: patterns, or None (plain tf.gradients, where a function accepts it).
Checkpoints = str | budgets.Budget | Sequence[tf.Tensor | str] | None
#: What tf.gradients returns: one gradient per x, None where y does not depend on it.
Gradients = list[tf.Tensor | tf.IndexedSlices | None]


#: Whether the gradients being planned stay alive together until an optimizer applies them all
#: (see :func:`gradients_applied_together`).
_GRADIENTS_HELD = contextvars.ContextVar("memsave_grads_gradients_held", default=False)


@contextlib.contextmanager
def gradients_applied_together():
    """Plan the ``gradients()`` calls inside for an optimizer that applies all the gradients
    together, after the backward pass (Keras ``fit``: its optimizer sums them over replicas in
    one op first), so that every weight gradient stays alive to the end of the pass
    (``ForwardGraph.gradients_held``). Outside it, each gradient is taken to be used up as soon
    as it is complete, as v1 optimizers' per-variable updates and ``minimize`` use them. Only
    the predicted peaks change (budgets, the never-worse rule, ``explain``); the gradients do
    not."""
    token = _GRADIENTS_HELD.set(True)
    try:
        yield
    finally:
        _GRADIENTS_HELD.reset(token)


#: Whether ``"memory"`` and budgets recompute loops' bodies inside (design note "control flow
#: and calls"); see :func:`loops_recomputed_inside`.
_LOOPS_RECOMPUTED = contextvars.ContextVar("memsave_grads_loops_recomputed", default=True)


@contextlib.contextmanager
def loops_recomputed_inside(enabled: bool):
    """Within ``loops_recomputed_inside(False)``, the ``gradients()`` calls leave while loops'
    bodies as they are: a loop is kept or recomputed whole, and its gradient stores every
    iteration. ``wrap_model(model, recompute_cells=False)`` promises Keras' recurrent loops as
    Keras builds them; its step plans under this. Outside it (the default), ``"memory"`` and
    budgets recompute a loop's body inside where that stores less."""
    token = _LOOPS_RECOMPUTED.set(bool(enabled))
    try:
        yield
    finally:
        _LOOPS_RECOMPUTED.reset(token)


@dataclasses.dataclass
class GradientsCall:
    """One outermost :func:`gradients` call made in a graph inside
    :func:`counting_gradients_calls`: what it differentiated and what it returned."""

    #: The graph the call built its gradients in (a nested ``tf.function``'s, maybe).
    graph: tf.Graph
    ys: list
    xs: list
    grads: list
    #: Creation indices (``tf_graph.creation_index``) bounding the ops the call made: every
    #: one is newer than ``before_op_id`` and none newer than ``after_op_id``.
    before_op_id: int
    after_op_id: int


@dataclasses.dataclass
class GradientsCalls:
    """The :func:`gradients` calls made inside :func:`counting_gradients_calls`: how many
    (nested ones too: a recomputed loop step's own), and the outermost ones made in a graph."""

    calls: int = 0
    made: list[GradientsCall] = dataclasses.field(default_factory=list)
    depth: int = 0


_GRADIENTS_CALLS: contextvars.ContextVar[GradientsCalls | None] = contextvars.ContextVar(
    "memsave_grads_gradients_calls", default=None)


@contextlib.contextmanager
def counting_gradients_calls():
    """Count the :func:`gradients` calls made inside (on this thread): a routed tape's, a
    Keras step's, a patched ``tf.gradients``', a direct call. ``wrap_model`` tells with it
    whether a model's own ``train_step`` computed any gradient through memsave_grads."""
    counter = GradientsCalls()
    token = _GRADIENTS_CALLS.set(counter)
    try:
        yield counter
    finally:
        _GRADIENTS_CALLS.reset(token)


@dataclasses.dataclass(frozen=True)
class PlainGradients:
    """Who computes a call's gradients where the rewrite would save nothing, in its place.

    ``compute()`` returns the gradients of that one call, one per given x; ``name`` says who
    computes them in the messages. A routed tape hands TensorFlow's own tape here: exact by
    construction, where ``tf.gradients`` is not (from inside a cond branch, a while body or a
    nested function it gives None for targets of an enclosing graph, which the tape
    differentiates).
    """

    compute: Callable[[], list]
    name: str


#: Set by :func:`plain_gradients_by` around one call (see there).
_PLAIN_GRADIENTS: contextvars.ContextVar[PlainGradients | None] = contextvars.ContextVar(
    "memsave_grads_plain_gradients", default=None)


@contextlib.contextmanager
def plain_gradients_by(plain: PlainGradients):
    """Inside it, the :func:`gradients` (or :func:`gradients_or_fallback`) call made there
    has ``plain`` compute its gradients wherever it would otherwise compute plain
    ``tf.gradients``: the never-worse rule, a fallback, a budget that no plan beats. The
    rewrite's own gradient calls (a recomputed loop step's) do not see it."""
    token = _PLAIN_GRADIENTS.set(plain)
    try:
        yield
    finally:
        _PLAIN_GRADIENTS.reset(token)


def _plain_gradients(ys, xs, grad_ys, tf_gradients_kwargs: dict,
                     plain: PlainGradients | None) -> list:
    """The gradients without a rewrite: ``plain.compute()`` where the caller handed one in
    (:func:`plain_gradients_by`), else ``tf.gradients`` where a stop at a function call's
    output really stops (``tf_graph.gradients_stopped_at``), as it does in the rewrite, so
    that the never-worse rule never changes an answer."""
    if plain is not None:
        # A patched tf.gradients that a gradient function calls meanwhile is another call.
        token = _PLAIN_GRADIENTS.set(None)
        try:
            return plain.compute()
        finally:
            _PLAIN_GRADIENTS.reset(token)
    kwargs = dict(tf_gradients_kwargs)
    stops = kwargs.pop("stop_gradients", None)
    stops = [] if stops is None else _validate.as_list(stops, "stop_gradients")
    return tf_graph.gradients_stopped_at(ys, xs, grad_ys, stops, **kwargs)


def register_gradients() -> None:
    """Register, in this process, the gradients of the ops memsave_grads builds that
    TensorFlow registers none for: ``XlaOptimizationBarrier``'s, the identity (the rewrite
    passes kept sums through barriers where XLA compiles for a GPU; design note "memory under
    XLA"). :func:`gradients` does this on first use. Call it in a process that differentiates
    what such gradients became without building them there: a loaded SavedModel, an imported
    meta-graph. Nothing happens where a gradient is registered already."""
    ordering.register_barrier_gradient()


@contextlib.contextmanager
def assume_batch_size(batch_size: int):
    """Plan the ``gradients()`` calls inside for batches of ``batch_size`` examples where the
    traced graph leaves the batch dimension unknown (a ``tf.function`` whose input signature
    has a None batch size, Keras ``fit``'s step).

    The memory model sizes tensors from their static shapes. Without this, an unknown
    dimension counts as 1, so the plan is made for a batch of one example, where the weights
    and their gradients weigh as much as a whole batch's activations: fractional budgets
    (``"budget:50%"``) then keep far more than they need to, and budgets in bytes are refused.
    Inside it, the first unknown dimension of each shape counts as ``batch_size`` (any further
    unknown one as 1), and the plan is made for that batch (design note "unknown batch size").
    The gradients are the same either way; only the plan and the predicted peaks change.
    ``wrap_model`` does this for ``fit`` by itself, from the batch size of each ``fit`` call::

        with memsave_grads.assume_batch_size(256):
            grads = memsave_grads.gradients(loss, variables, checkpoints="budget:50%")

    Raises:
      InvalidTypeError, InvalidArgumentError: ``batch_size`` is not a positive int.
    """
    _validate.check_batch_size(batch_size)
    with tf_graph.assumed_batch_size(int(batch_size)):
        yield


#: Who the fallback's warnings name as the caller: ``gradients_or_fallback``'s callers
#: (``patch()``, the Keras step, a routed tape) set it for their call.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar(
    "memsave_grads_caller", default="memsave_grads.gradients")


@tf.autograph.experimental.do_not_convert
def gradients(ys: Targets, xs: Sources, grad_ys: Targets | None = None,
              checkpoints: Checkpoints = "memory", fallback: str = "warn",
              **tf_gradients_kwargs: Any) -> Gradients:
    """``tf.gradients(ys, xs, grad_ys)`` that recomputes forward activations to save memory.

    Keeps only the *checkpoint* tensors of the forward pass alive for the backward pass and
    recomputes the rest, segment by segment, as backprop reaches them. With the defaults it is
    a drop-in ``tf.gradients``: the same return value, a plan chosen automatically, and plain
    ``tf.gradients`` (with one warning) wherever no plan is predicted to save memory, as
    ``patch()``, ``GradientTape`` and ``wrap_model`` do.

    Args:
      ys: a tensor or list of tensors to differentiate.
      xs: a tensor, resource variable, or list of them.
      grad_ys: optional initial gradients, one per y (as in ``tf.gradients``).
      checkpoints: what to keep. ``"memory"`` (default: about sqrt(N) tensors that separate
        the graph, chosen automatically for the lowest predicted peak); ``"speed"`` (outputs
        of matmul/conv/einsum ops); a budget (``"budget:50%"``, :class:`Budget`);
        ``"collection"`` (tensors in the graph collection ``"checkpoints"``, as the TF1
        ``memory_saving_gradients`` defaulted to: pass it by name); or a list of tensors, or of
        name patterns (globs over op names, or over tensor names when they contain ``:``).
      fallback: ``"warn"`` (default): where the strategy finds nothing to keep or cannot
        rewrite the graph (``NoCheckpointsFoundError``, ``UnsupportedGraphError``,
        ``NotDifferentiableError``), log a warning and compute plain ``tf.gradients``; where a
        budget is below every plan's predicted peak, plan for the smallest (one warning with
        the numbers). ``"error"``: raise those errors instead.
      **tf_gradients_kwargs: passed on as in ``tf.gradients``: ``name``, ``gate_gradients``,
        ``aggregation_method``, ``stop_gradients``, ``unconnected_gradients``,
        ``colocate_gradients_with_ops``.

    Returns:
      What ``tf.gradients`` returns: a list with one gradient (tensor, ``IndexedSlices`` or
      ``None``) per x.

    Raises:
      MemsaveGradsError subclasses (also ValueError/TypeError/RuntimeError) on bad input; with
      ``fallback="error"``, ``NoCheckpointsFoundError`` when the strategy finds nothing to keep
      and ``InfeasibleBudgetError`` for a budget no plan meets.
    """
    _validate.check_fallback(fallback)
    calls = _GRADIENTS_CALLS.get()
    if calls is None:
        return _gradients_checked(ys, xs, grad_ys, checkpoints, fallback, tf_gradients_kwargs)
    calls.calls += 1
    if calls.depth or tf.executing_eagerly():
        return _gradients_checked(ys, xs, grad_ys, checkpoints, fallback, tf_gradients_kwargs)
    graph = tf.compat.v1.get_default_graph()
    before_op_id = tf_graph.last_op_id(graph)
    calls.depth += 1
    try:
        grads = _gradients_checked(ys, xs, grad_ys, checkpoints, fallback, tf_gradients_kwargs)
    finally:
        calls.depth -= 1
    calls.made.append(GradientsCall(
        graph=graph, ys=tf.nest.flatten(ys), xs=tf.nest.flatten(xs), grads=list(grads),
        before_op_id=before_op_id, after_op_id=tf_graph.last_op_id(graph)))
    return grads


def _gradients_checked(ys, xs, grad_ys, checkpoints, fallback: str,
                       tf_gradients_kwargs: dict) -> Gradients:
    """:func:`gradients` once its ``fallback`` is checked."""
    if fallback == "warn":
        return _gradients_falling_back(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)
    return _rewritten_or_plain(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)


_TAPE_WRAPPED_WARNING = "tape-wrapped control flow"


def _warn_tape_wrapped_once(region) -> None:
    """Say once per process where TensorFlow wrapped the region's conds or loops in calls for
    higher-order tape gradients: each is one op to the plan, and the remedy is the caller's
    (measured in docs/usage.md, "Tapes that TensorFlow wraps")."""
    if ordering.warned(_TAPE_WRAPPED_WARNING):
        return  # said once; its clause walks the calls' bodies, so not every call again
    wrapped = [op for op in region if function_ops.tape_wrapped(op)]
    if not wrapped:
        return
    # Loops built while tapes were routed read their variables once (loops.
    # hoist_reads_in_tape_wrappers); one built before stores every read per iteration.
    reads_per_iteration = any(function_ops.loop_reads_variables(op) for op in wrapped)
    ordering.warn_once(
        _TAPE_WRAPPED_WARNING,
        "memsave_grads: TensorFlow wrapped %d control-flow op(s) of this step (tf.cond, "
        "tf.case, tf.while_loop) in function calls (%s), as it does while a persistent "
        "tf.GradientTape or two tapes at once record them; each call is one op to the plan, "
        "nothing inside it is planned%s. Take the step's gradient with one non-persistent "
        "tape, or call memsave_grads.gradients in the tf.function with no persistent tape "
        "recording the forward pass (docs/usage.md, \"Tapes that TensorFlow wraps\").",
        len(wrapped), ", ".join(op.name for op in wrapped[:3]),
        ", and TensorFlow's gradient of a wrapped loop stores a copy of each variable it "
        "reads per iteration" if reads_per_iteration else "")


def _rewritten_or_plain(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs: dict,
                        tell_plain: Callable[[str, str], None] | None = None) -> Gradients:
    """:func:`gradients` with ``fallback="error"``: the plan through the rewrite, or plain
    gradients where the never-worse rule says so; the strategy's errors raised.
    ``tell_plain(reason, computed_by)``: told instead of the user where the rule keeps plain
    gradients (a caller that words it itself)."""
    plain = _PLAIN_GRADIENTS.get()
    prepared = prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)
    _warn_tape_wrapped_once(prepared.region)
    decision = selection.decide_schedule(prepared.selection, prepared.checkpoints, prepared.plan)
    # The calls the backward pass makes itself (a recomputed loop step's gradients) hold no
    # weight gradients for an optimizer, and compute their own plain gradients, whatever this
    # call's caller said.
    held_token = _GRADIENTS_HELD.set(False)
    plain_token = _PLAIN_GRADIENTS.set(None)
    try:
        if not decision.rewrite:  # design note "never worse"
            computed_by = "plain tf.gradients" if plain is None else plain.name
            if tell_plain is None:
                _warn_plain_once(prepared.checkpoints.given, prepared, decision.reason,
                                 computed_by)
            else:
                tell_plain(decision.reason, computed_by)
            if plain is None:
                # As the plan would (run_plan); a caller's own plain gradients (a tape's
                # recorded backward functions) see the graph as it was recorded.
                loops.hoist_reads(prepared.region)
            return _plain_gradients(ys, xs, grad_ys, tf_gradients_kwargs, plain)
        return run_plan(prepared, prepared.plan)
    finally:
        _PLAIN_GRADIENTS.reset(plain_token)
        _GRADIENTS_HELD.reset(held_token)


#: (checkpoints, forward ops) of the calls already warned about: a model traced again, or
#: patched tf.gradients called once per trace, says so once.
_WARNED_PLAIN: set = set()


def _warn_plain_once(checkpoints, prepared: "Prepared", reason: str, computed_by: str) -> None:
    """Tell the user, once per kind of call, that the strategy saves nothing here."""
    key = (repr(checkpoints)[:200], len(prepared.region))
    if key in _WARNED_PLAIN:
        return
    if not prepared.region:
        # Nothing lies between xs and ys (a variable the loss does not read, its gradient
        # asked as zeros): no memory to save, and nothing to tell.
        _LOG.debug("memsave_grads: no forward op between xs and ys; %s computes the "
                   "gradients", computed_by)
        return
    if tf_graph.in_replay_backward():
        # A recomputed step differentiating its copies under patch(): the step is the saving.
        _LOG.debug("memsave_grads: a replay's own gradient call of %d forward ops keeps plain "
                   "tf.gradients' schedule (%s)", len(prepared.region), reason)
        return
    _WARNED_PLAIN.add(key)
    while_ops = [op for op in prepared.region if op.type in op_types.WHILE_OP_TYPES]
    if while_ops and all(tf_graph.loop_body_has_custom_gradient(op) for op in while_ops):
        # Keras 3 recurrent layers under wrap_model, or a user's recompute(step): the saving
        # is inside the loops, which plain tf.gradients differentiates as they are.
        _LOG.info(
            "memsave_grads: checkpoints=%.80r: outside its %d loop(s), whose steps recompute "
            "inside, this graph of %d forward ops has nothing to save (%s); %s "
            "differentiates it.", checkpoints, len(while_ops), len(prepared.region), reason,
            computed_by)
        return
    loop_hint = _loop_hint(while_ops) if while_ops else ""
    compiled = function_ops.kept_compiled_calls(prepared.region)
    compiled_hint = (
        f" {len(compiled)} of those ops are calls of tf.function(jit_compile=True) functions "
        "that read variables: such a call is kept whole, with everything its gradient needs; "
        "to recompute inside, compile the whole step instead of each block." if compiled else "")
    customs = tf_graph.recomputing_custom_gradients(prepared.region)
    custom_hint = (
        f" {len(customs)} of those ops end tf.recompute_grad blocks (keras.RematScope, "
        "memsave_grads.recompute): their gradients run each block again from its arguments, "
        "read from the forward pass, which stay alive whatever a plan keeps; without "
        "tf.recompute_grad (RematScope), 'memory' plans the whole graph." if customs else "")
    unknown_hint = (
        " Its batch dimension is unknown (a None in a placeholder or an input signature), so "
        "sizes count it as 1 and the plan is made for one example, where the weights weigh "
        "as much as the activations: plan for your batch with `with memsave_grads."
        "assume_batch_size(n):` around the call." if prepared.selection.unknown_dimensions
        else "")
    _LOG.warning(
        "memsave_grads: checkpoints=%.80r saves no memory on this graph of %d forward ops: "
        "%s; %s computes its gradients, at tf.gradients' own peak.%s%s%s%s "
        "memsave_grads.explain(...) shows the plan.", checkpoints, len(prepared.region), reason,
        computed_by, unknown_hint, loop_hint, compiled_hint, custom_hint)


def _loop_hint(while_ops: list) -> str:
    """The no-saving warning's sentence about the region's loops: why their bodies were not
    recomputed inside, and what would save there."""
    loops_said = (f" {len(while_ops)} of those ops are loops whose gradients store what every "
                  "iteration needs")
    remedy = "memsave_grads.recompute(step_fn) (docs/recurrent.md)."
    if not _LOOPS_RECOMPUTED.get():
        return (f"{loops_said}; here loops are kept as they are built (wrap_model(..., "
                f"recompute_cells=False)): to save inside such a loop, recompute its step with "
                f"{remedy}")
    differentiated = [op for op in while_ops if function_ops.gradient_built(op)]
    if differentiated:
        # Seen in practice: tf.gradients (or a tape) was called over the same loops first,
        # and while_v2 rewrote them to output what their gradient stores.
        return (f"{loops_said}, and {len(differentiated)} of them were differentiated before "
                "in this graph (an earlier tf.gradients or tape call over them made "
                "TensorFlow rewrite them), after which no loop body is recomputed inside, nor "
                "a loop that reads variables copied: take these gradients in the first call "
                f"over the loops, or recompute each step with {remedy}")
    if all(loops.eligible(op) for op in while_ops):
        return ""  # the plan could recompute every body inside: the graph is too small to gain
    return (f"{loops_said}; 'memory' and budgets recompute a loop's body inside where that "
            "stores less, but not where a stateful op of the body reads a value the iteration "
            "computes (nor, under XLA, where the body writes a variable): to save inside such "
            f"a loop, recompute its step with {remedy}")


def run_plan(prepared: "Prepared", plan: plan_lib.Plan) -> list:
    """Run ``plan`` (node numbers of ``prepared.selection.model``) through the rewrite: the
    gradients, one per given x. ``gradients()`` runs the selected plan; tests force others."""
    model = prepared.selection.model
    arguments = prepared.arguments
    # Under XLA, loops read their variables once, before they run (design note "loop reads
    # under XLA"); the memory model counted them so.
    loops.hoist_reads(prepared.region)
    floor = tf_graph.last_op_id(arguments.graph)  # ops newer than this are the rewrite's
    loops.recompute_bodies(prepared.selection.recomputed_loops)
    options = stitch.CallOptions(
        user_stops=arguments.user_stops, tf_kwargs=arguments.tf_kwargs,
        unconnected_zero=arguments.unconnected == tf.UnconnectedGradients.ZERO,
        scope_prefix=f"{arguments.scope}_memsave",
        xla=ordering.xla_in_effect(arguments.graph),
        materialize=ordering.compiled_by_xla(arguments.graph))
    with arguments.graph.as_default():
        grads = stitch.backprop(arguments.ys, prepared.xs, arguments.grad_ys, model,
                                dict(enumerate(prepared.region)),
                                schedule_lib.of_plan(model, plan), options)
        # A variable's gradient is computed after the backward ops reading its value from the
        # same incoming gradient, so that the update it feeds does not copy the weight
        # (design note "writes after reads").
        for x, g in zip(prepared.xs, grads):
            if g is not None and x.dtype == tf.resource:
                early_release.producers_after_sibling_reads(g, x, floor)
        return prepared.per_given_x(grads)


@dataclasses.dataclass
class Prepared:
    """Validated arguments and the chosen plan: everything up to (not including) the rewrite."""

    #: The checked arguments, as ys' graph reads them (design note "captured xs"): ``ys`` and
    #: ``grad_ys`` only those ys' graph reads (the others are ``outer_targets``); per given
    #: x, ``x_slots`` holds the tensor the rewrite differentiates for it in ys' graph (None
    #: where that gradient comes only from beyond the captures, or where ys' graph never
    #: reads it).
    arguments: _validate.Arguments
    #: Captured placeholders through which ys depend on xs of enclosing graphs: differentiated
    #: here, then carried out with tf.gradients (design note "captured xs").
    crossing: list
    #: ``(y, grad_y)`` for ys of enclosing graphs that ys' graph never captured.
    outer_targets: list
    #: ``checkpoints=`` as ``_validate.check_checkpoints`` parsed it (None: not selecting).
    checkpoints: ParsedCheckpoints | None
    selection: selection.SelectionContext
    #: What to keep, in node numbers of ``selection.model`` (design note "plan and schedule").
    plan: plan_lib.Plan

    @property
    def graph(self) -> tf.Graph:
        return self.arguments.graph

    @property
    def scope(self) -> str:
        return self.arguments.scope

    @property
    def region(self) -> list:
        return self.selection.region

    @property
    def xs(self) -> list:
        """The xs that ys' graph reads: what the rewrite differentiates with respect to."""
        return [x for x in self.arguments.x_slots if x is not None] + self.crossing

    def per_given_x(self, grads: list) -> list:
        """``grads`` (one per :attr:`xs`) as tf.gradients returns them, one per given x.

        The partials of crossing captures are carried out to the enclosing graphs' xs by one
        tf.gradients call and added; an x with no gradient gets None, or zeros for
        ``unconnected_gradients='zero'``.
        """
        arguments = self.arguments
        own = len(grads) - len(self.crossing)
        slot_grads = iter(grads[:own])
        out = [next(slot_grads) if slot is not None else None for slot in arguments.x_slots]
        carried = [(tf_graph.captured_value(p), tf.convert_to_tensor(g))
                   for p, g in zip(self.crossing, grads[own:]) if g is not None]
        carried += self.outer_targets
        given_xs = arguments.given_xs
        outer = [i for i, x in enumerate(given_xs)
                 if not tf_graph.is_eager_tensor(x) and x.graph is not arguments.graph]
        if carried and outer:
            further = tf_graph.gradients_stopped_at(
                [y for y, _ in carried], [given_xs[i] for i in outer],
                [g for _, g in carried], arguments.user_stops, **arguments.tf_kwargs)
            for i, g in zip(outer, further):
                out[i] = stitch.aggregate([out[i], g], given_xs[i])
        if arguments.unconnected == tf.UnconnectedGradients.ZERO:
            out = [stitch.zeros_like(x) if g is None else g for x, g in zip(given_xs, out)]
        return out


def prepare(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs,
            select: bool = True) -> Prepared:
    """Validate the arguments and choose what to keep (unless not ``select``); adds nothing to
    the graph. What ``gradients()`` does before the rewrite (``explain`` stops there)."""
    arguments = _validate.check_arguments(ys, xs, grad_ys, tf_gradients_kwargs)
    # The other arguments are checked first and checkpoints before selection, whose own errors
    # (NoCheckpointsFoundError) would otherwise blame checkpoints for a bad grad_ys.
    parsed = _validate.check_checkpoints(checkpoints) if select else None
    graph, ys, given_xs, x_slots = (arguments.graph, arguments.ys, arguments.given_xs,
                                    arguments.x_slots)
    user_stops, grad_ys = arguments.user_stops, arguments.grad_ys
    # A y of an enclosing graph is differentiated through its capture where ys' graph
    # captured it, and otherwise entirely beyond the captures (design note "captured xs").
    y_slots = [y if y.graph is graph else tf_graph.as_seen_from(y, graph) for y in ys]
    outer_targets = [(y, gy) for y, slot, gy in zip(ys, y_slots, grad_ys) if slot is None]
    grad_ys = [gy for slot, gy in zip(y_slots, grad_ys) if slot is not None]
    ys = [slot for slot in y_slots if slot is not None]
    # An x of an enclosing graph that is a value (not an eager constant, not a variable
    # handle) may reach ys through several captures: its gradient is carried out through all
    # of them, its own capture included (design note "captured xs").
    outer_xs = [given for given, seen in zip(given_xs, x_slots) if given is not seen]
    crossing = tf_graph.crossing_captures(ys, outer_xs, stop_ops={t.op for t in user_stops})
    x_slots = [None if slot is not None and tf_graph.is_captured_value(given, slot)
               else slot for given, slot in zip(given_xs, x_slots)]
    xs = [x for x in x_slots if x is not None] + crossing

    with graph.as_default():
        region = tf_graph.forward_region(ys, xs, stop_ops={t.op for t in user_stops})
        # The strategies that choose for memory also recompute loops' bodies inside, where
        # that stores less (design note "control flow and calls").
        recomputed_loops = (loops.chosen(region) if select and _recomputes_loops(parsed)
                            else {})
        must_keep = selection.forced_keep(region, xs, recomputed_loops)
        ctx = selection.SelectionContext(graph=graph, region=region, xs=xs, ys=ys,
                                         must_keep=must_keep,
                                         gradients_held=_GRADIENTS_HELD.get(),
                                         recomputed_loops=recomputed_loops)
        # No forward op between xs and ys (ys do not depend on xs): nothing to choose; the
        # gradients are None (or zeros), as tf.gradients gives.
        plan = (selection.make_plan(ctx, parsed) if select and region
                else selection.keep_ops(ctx, (), "none"))
    _LOG.debug("memsave_grads: %d forward ops, %d checkpoints chosen, %d kept in all",
               len(region), len(plan.chosen or ()), len(plan.kept))
    arguments = dataclasses.replace(arguments, ys=ys, grad_ys=grad_ys, x_slots=x_slots)
    return Prepared(arguments=arguments, crossing=crossing, outer_targets=outer_targets,
                    checkpoints=parsed, selection=ctx, plan=plan)


def _recomputes_loops(checkpoints: _validate.ParsedCheckpoints) -> bool:
    """``"memory"`` and budgets, the strategies that choose what to keep for memory, unless
    :func:`loops_recomputed_inside` turned it off."""
    return _LOOPS_RECOMPUTED.get() and (checkpoints.strategy == "memory"
                                        or checkpoints.budget is not None)


def gradients_or_fallback(ys, xs, grad_ys, checkpoints, fallback: str, caller: str,
                          **tf_gradients_kwargs):
    """:func:`gradients` with ``fallback``, its warnings naming ``caller`` (``patch()``, the
    Keras step, a routed tape)."""
    token = _CALLER.set(caller)
    try:
        return gradients(ys, xs, grad_ys, checkpoints=checkpoints, fallback=fallback,
                         **tf_gradients_kwargs)
    finally:
        _CALLER.reset(token)


def _gradients_falling_back(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs: dict):
    """``fallback="warn"``: :func:`gradients`, or the original ``tf.gradients`` (or whoever
    :func:`plain_gradients_by` named) where the strategy has nothing to gain or the graph
    cannot be rewritten (``errors.FALLBACK_ERRORS``), with a warning; a budget no plan meets
    (``InfeasibleBudgetError``) gets the plan with the smallest predicted peak and one
    warning stating the numbers."""
    plain = _PLAIN_GRADIENTS.get()
    caller = _CALLER.get()
    try:
        try:
            return _rewritten_or_plain(ys, xs, grad_ys, checkpoints, tf_gradients_kwargs)
        except errors.InfeasibleBudgetError as exc:
            return _gradients_at_smallest_peak(ys, xs, grad_ys, checkpoints, exc, caller,
                                               tf_gradients_kwargs)
    except errors.FALLBACK_ERRORS as exc:
        computed_by = "tf.gradients" if plain is None else plain.name
        # Once per message: a patched tf.hessians asks once per element, a model per trace.
        ordering.warn_once(f"fallback: {caller}, {computed_by}, {exc}",
                           "%s: falling back to %s: %s", caller, computed_by, exc)
        return _plain_gradients(ys, xs, grad_ys, tf_gradients_kwargs, plain)


#: Solves at the reported smallest peak before settling for plain tf.gradients. The minimum
#: an error states does not depend on the budget and a plan meets it
#: (``revolve.smallest_peak_plan``), so the first normally succeeds; the others guard a
#: budget's rounding (a fraction of the plain peak) against an off-by-a-byte miss.
SMALLEST_PEAK_ATTEMPTS = 3


def _gradients_at_smallest_peak(ys, xs, grad_ys, checkpoints, infeasible, caller: str,
                                tf_gradients_kwargs: dict):
    """Under ``fallback="warn"``, a budget below every plan's predicted peak gets the plan with
    the smallest predicted peak (or plain tf.gradients where no plan beats it), and one warning
    with the numbers; a training loop goes on with the least memory we can offer."""
    parsed = _validate.check_checkpoints(checkpoints)  # a budget, as gradients() parsed it
    asked, checkpoints = parsed.budget, parsed.given
    plain = _PLAIN_GRADIENTS.get()
    computed_by = "plain tf.gradients" if plain is None else plain.name
    plain_bytes = infeasible.plain_peak_bytes

    def mib(nbytes):  # the numbers one message compares, in one unit
        return budgets.format_bytes(nbytes, "MiB")

    def share(nbytes):
        return f"{nbytes / plain_bytes:.1%}" if plain_bytes and nbytes is not None else "n/a"

    def warn(error, outcome):
        _LOG.warning(
            "%s: checkpoints=%r: the budget of %s (%s of plain tf.gradients' predicted peak, "
            "%s) is below the smallest feasible predicted peak, %s (%s of plain); %s Raise the "
            "budget to at least that, or pass fallback='error' to raise.", caller, checkpoints,
            mib(infeasible.budget_bytes), share(infeasible.budget_bytes), mib(plain_bytes),
            mib(error.min_feasible_bytes), share(error.min_feasible_bytes), outcome)

    error = infeasible
    for _ in range(SMALLEST_PEAK_ATTEMPTS):
        retry = budgets.smallest_peak_budget(error, asked)
        if retry is None:
            warn(error, "no plan is predicted to peak below plain tf.gradients here, so "
                 f"{computed_by} computes these gradients.")
            return _plain_gradients(ys, xs, grad_ys, tf_gradients_kwargs, plain)
        kept_plain = []  # the never-worse rule's (reason, computed_by), where it said plain
        try:
            grads = _rewritten_or_plain(ys, xs, grad_ys, retry, tf_gradients_kwargs,
                                        tell_plain=lambda *told: kept_plain.append(told))
        except errors.InfeasibleBudgetError as again:
            error = again
            continue
        if kept_plain:
            reason, by = kept_plain[0]
            warn(error, f"a plan at that peak saves too little ({reason}), so {by} computes "
                 "these gradients.")
        else:
            warn(error, "planned for that peak instead.")
        return grads
    warn(error, f"the solver found no plan at that peak in {SMALLEST_PEAK_ATTEMPTS} attempts, "
         f"so {computed_by} computes these gradients.")
    return _plain_gradients(ys, xs, grad_ys, tf_gradients_kwargs, plain)


def _shortcut(strategy: str):
    @tf.autograph.experimental.do_not_convert
    def shortcut(ys, xs, grad_ys=None, fallback="warn", **tf_gradients_kwargs):
        return gradients(ys, xs, grad_ys, checkpoints=strategy, fallback=fallback,
                         **tf_gradients_kwargs)

    shortcut.__name__ = f"gradients_{strategy}"
    shortcut.__qualname__ = shortcut.__name__
    shortcut.__doc__ = f"``gradients(..., checkpoints={strategy!r})``."
    return shortcut


gradients_speed = _shortcut("speed")
gradients_memory = _shortcut("memory")
gradients_collection = _shortcut("collection")
