"""A static memory model of the backward pass, on the TensorFlow-free graph model.

It replays, in bytes, the schedule (``core.schedule``) that the rewrite runs (docs/design.md,
notes "memory model" and "plan and schedule") and returns the peak:

* **forward**: nodes run in topological order; a node's outputs are freed once its last
  consumer has run, unless the backward pass needs them: with plain ``tf.gradients`` every
  output the backward pass reads stays (an op's gradient may read its inputs or its output; see
  ``op_types``) until the last step that reads it; with a plan only kept nodes and
  the saved outputs of the top segment (which is not recomputed) stay.
* **backward**: plain ``tf.gradients`` walks the nodes in reverse topological order; a node's
  gradient is allocated when the first partial reaches it and freed once its own backward step
  has run, and a saved output is freed after its node's backward step. With a plan, the top
  segment is walked first, then one *level* at a time (design note "levels"): the level's
  segments are recomputed (forward, keeping what their backward reads), walked backward, and
  dropped; a kept output is freed when its own level begins, since every segment that reads it
  belongs to a lower level and is done by then.

An input is kept for the backward pass only when its reader's gradient actually reads it
(``ForwardGraph.gradient_reads_input``: ``0.5 * x`` keeps no ``x``), and elementwise ops write
into an input nothing else holds, as TensorFlow's kernels do (``ForwardGraph.forwards_buffer``).

Sizes come from static shapes (unknown dimensions count as 1, so the result scales linearly
with an unknown batch size). Scratch buffers of gradient kernels enter only when the caller
passes ``workspace_bytes`` (see :func:`conv2d_gradient_workspace_bytes`): they do not depend on
the batch, so they cannot be added to sizes counted per example, and the planners leave them
out (every plan runs each gradient kernel once, so they shift every plan alike). What the model
leaves out: other op workspaces, the executor running independent ops in parallel, the
allocator serving a request from a larger free chunk, and partials that are summed (each
gradient is counted once). It is an estimate for comparing plans and for a report, not a
measurement; the benchmark prints both.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import plan as plan_lib
from memsave_grads.core import schedule as schedule_lib


#: Bytes per variable byte at the backward step of the op that reads the variable: its
#: gradient, and the copy the optimizer's update makes of the variable while that step still
#: reads it (measured on MLPs: two weight-sized buffers above the activations).
VARIABLE_UPDATE_FACTOR = 2

#: TensorFlow's CPU ``Conv2DBackpropFilter`` kernel (``Conv2DCustomBackpropFilterOp``) im2cols as
#: many images at once as fill a working set of this size (its guess of an L3 cache), whatever
#: the batch size: tens of MiB of scratch at every convolution's backward step, which is most of
#: a small batch's peak (measured: 22.5 MiB for a 3x3 conv of 64 channels on 16x16 images at
#: batch 1 and 2 alike, as the formula gives). Where TensorFlow runs its CPU kernels through
#: oneDNN (the default on x86 CPUs with AVX-512 VNNI/BF16 or AMX), the convolution gradients
#: allocate no such scratch (measured: 0.2 MiB for the same convolution, and peaks of about twice
#: the output from batch 1 to 32): the TensorFlow front end then passes no workspace.
CONV_FILTER_GRADIENT_WORKING_SET_BYTES = 30 * 2**20


class Ledger:
    """Bytes in use and the highest value seen."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


class _PeakAbove(Exception):
    """A capped replay's peak passed its cap (:func:`replay`'s ``stop_above_bytes``)."""


class _CappedLedger(Ledger):
    """A ledger that ends the replay once the bytes in use pass ``cap``."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def alloc(self, nbytes: int) -> None:
        super().alloc(nbytes)
        if self.live > self.cap:
            raise _PeakAbove()


def variable_step_bytes(graph: graph_lib.ForwardGraph, v: int) -> int:
    """Bytes the variables' side of ``v``'s backward step allocates: their gradients and,
    where each is applied at once, the copies the updates make (an update that runs while this
    step still reads the variable copies it first: copy-on-write); where the gradients are held
    for an optimizer that applies them together (``ForwardGraph.gradients_held``), the gradients
    alone, which then stay."""
    factor = 1 if graph.gradients_held else VARIABLE_UPDATE_FACTOR
    return factor * graph.params_of(v)


def conv2d_gradient_workspace_bytes(output_pixels: int, window_pixels: int, in_channels: int,
                                    out_channels: int, itemsize: int, filter_gradient: bool,
                                    input_gradient: bool) -> int:
    """Scratch bytes TensorFlow's CPU kernels allocate while differentiating one 2-D convolution
    (``output_pixels`` per image, a window of ``window_pixels`` x ``in_channels``).

    The filter gradient im2cols ``ceil(working set / work unit)`` images at once, a count that
    ignores the batch size (``Conv2DCustomBackpropFilterOp``); the input gradient im2cols one
    image. Both buffers live only while their kernel runs.
    """
    window = window_pixels * in_channels
    columns = output_pixels * window  # one image's im2col matrix, in elements
    workspace = 0
    if filter_gradient and columns:
        work_unit = columns + output_pixels * out_channels + window * out_channels
        working_set = CONV_FILTER_GRADIENT_WORKING_SET_BYTES // itemsize
        images_at_once = -(-working_set // work_unit)
        workspace += images_at_once * columns * itemsize
    if input_gradient:
        workspace += columns * itemsize
    return workspace


def plain_peak_bytes(graph: graph_lib.ForwardGraph,
                     workspace_bytes: Sequence[int] | None = None) -> int:
    """Predicted peak of forward + backward with plain ``tf.gradients``.

    ``workspace_bytes``: scratch each node's backward step allocates for its duration (see
    :func:`conv2d_gradient_workspace_bytes`); none when not given.
    """
    n = graph.num_nodes
    consumers = graph.consumers()
    release_at, retained = backward_readers(graph, consumers, range(n))
    ledger = Ledger()
    inside: set[int] = set()
    forward_sweep(graph, range(n), consumers, retained, ledger, kept=(), differentiated=range(n),
             inside=inside)
    backward_steps(graph, reversed(range(n)), set(), ledger, release_at, workspace_bytes, inside)
    return ledger.peak


def plan_peak_bytes(graph: graph_lib.ForwardGraph, kept: Iterable[int],
                    not_replayed: Iterable[int] = (),
                    workspace_bytes: Sequence[int] | None = None) -> int:
    """Predicted peak of forward + backward when ``kept`` are the only outputs kept (a
    single-level plan; ``workspace_bytes`` as in :func:`plain_peak_bytes`). With its schedule
    at hand, call :func:`replay`."""
    return replay(graph, schedule_lib.build(graph, kept, not_replayed), workspace_bytes)[0]


def plan_peak_and_cost(graph: graph_lib.ForwardGraph, plan: plan_lib.Plan,
                       workspace_bytes: Sequence[int] | None = None,
                       stop_above_bytes: int | None = None) -> tuple[int, float]:
    """(predicted peak bytes, recompute cost) of a plan, nested levels included
    (``stop_above_bytes`` as in :func:`replay`)."""
    return replay(graph, schedule_lib.of_plan(graph, plan), workspace_bytes,
                  stop_above_bytes=stop_above_bytes)


def copied_cost(graph: graph_lib.ForwardGraph, plan: plan_lib.Plan) -> float:
    """The cost of every op the rewrite copies for ``plan``, each level's kept nodes included
    (a level copies them to differentiate them: its targets), nested levels each time they
    run. :func:`replay`'s cost leaves the kept nodes out, nearly nothing where a kept node is
    a sum or a view, but a whole block where it is a call of the block's function: on 16
    calls of one block each, a nested plan replays 31 blocks, cost 16 (design note "nested by
    default")."""
    trace: list = []
    replay(graph, schedule_lib.of_plan(graph, plan), trace=trace)
    return sum(graph.cost_of(v) for level in trace for v in level)


def replay(graph: graph_lib.ForwardGraph, sched: schedule_lib.Schedule,
           workspace_bytes: Sequence[int] | None = None,
           trace: list | None = None,
           stop_above_bytes: int | None = None) -> tuple[int, float]:
    """Replay a schedule in bytes, as the rewrite runs it: (peak bytes, recompute cost).

    The cost counts a node once per time it is replayed (at depth d: d times); kept nodes
    themselves are not counted. ``trace``, if given, receives the nodes each level recomputes,
    in the order the levels run (what the rewrite copies; tests compare the two).
    ``stop_above_bytes``: a caller that wants only plans peaking at most that gets, for the
    others, the bytes in use when they passed it (above it; the cost so far), without the
    rest of the replay (design note "planning cost").
    """
    replayer = _Replayer(graph, workspace_bytes, trace, stop_above_bytes)
    try:
        replayer.run(sched)
    except _PeakAbove:
        pass
    return replayer.ledger.peak, replayer.cost


class _Replayer:
    """One replay: the ledger, the gradients alive, the recompute cost so far."""

    def __init__(self, graph, workspace_bytes, trace, stop_above_bytes=None):
        self.graph = graph
        self.consumers = graph.consumers()
        self.workspace_bytes = workspace_bytes
        self.trace = trace
        self.ledger = Ledger() if stop_above_bytes is None else _CappedLedger(stop_above_bytes)
        self.grads: set[int] = set()
        self.cost = 0.0
        #: Nodes whose internal saved bytes are allocated (ForwardGraph.internal_saved_bytes).
        self.inside: set[int] = set()
        #: Nodes whose exposed bytes are held until their level (ForwardGraph.exposed_bytes).
        self.exposing: set[int] = set()

    def run(self, sched: schedule_lib.Schedule, outermost: bool = True) -> None:
        """Forward over the members keeping the kept nodes and what the top's backward reads,
        the top backward, then each level: free its kept outputs (every reader is in a lower
        level, done by now), replay its active segments forward and backward (or, with
        sub-plans, as a schedule of their own), and step through never-replayed kept nodes.

        Function ops keep their internal saved bytes wherever they are differentiated: the
        top's and the never-replayed kept nodes where they ran, the others in the level that
        recomputes them; in the forward pass those others output their exposed bytes instead,
        held until that level (design note "control flow and calls")."""
        graph, ledger, grads, workspace = self.graph, self.ledger, self.grads, self.workspace_bytes
        kept = sched.kept
        release_at, top_retained = backward_readers(graph, self.consumers, sched.top)
        retained = {v: v in kept or top_retained.get(v, False) for v in sched.members}
        in_place = set(sched.top) | {k for k, owned in sched.owned.items() if not owned}
        exposing = ({v for v in sched.members if v not in in_place and graph.exposed(v)}
                    if outermost else set())
        forward_sweep(graph, sched.members, self.consumers, retained, ledger, kept,
                 differentiated=in_place, inside=self.inside, exposing=exposing)
        self.exposing |= exposing
        backward_steps(graph, reversed(sched.top), grads, ledger, release_at, workspace,
                       self.inside)
        for level in sched.levels:
            group = level.nodes
            for k in group:
                ledger.free(graph.size_bytes[k])  # kept: a view's buffer counts too
            active = [k for k in group if k in grads]
            recomputed = sched.recomputed_by(active)
            self.cost += sum(graph.cost_of(v) for v in recomputed if v not in kept)
            if self.trace is not None and recomputed:
                self.trace.append(recomputed)
            nested = sched.nested(graph, active)
            if nested is not None:
                self.run(nested, outermost=False)
            else:
                release, saved = backward_readers(graph, self.consumers, recomputed)
                forward_sweep(graph, recomputed, self.consumers, saved, ledger, kept=(),
                         differentiated=recomputed, inside=self.inside)
                backward_steps(graph, reversed(recomputed), grads, ledger, release, workspace,
                               self.inside)
            for v in recomputed:  # the replays have read what their originals exposed
                if v in self.exposing:
                    self.exposing.discard(v)
                    ledger.free(graph.exposed(v))
            for k in active:
                if k in grads or k in self.inside:
                    # A never-replayed kept node: its gradient goes to xs.
                    backward_step(graph, k, grads, ledger, {}, workspace, self.inside)


def retained_bytes(graph: graph_lib.ForwardGraph) -> list[int]:
    """Bytes of each node that the backward pass over a segment containing the node and its
    readers keeps alive: its output when a gradient reads it (or it is a ``y``; views: none),
    and what a function op keeps inside for its gradient (``internal_saved_bytes``)."""
    consumers = graph.consumers()
    out = []
    for v in range(graph.num_nodes):
        read = graph.gradient_reads_output(v) or graph.feeds_sink[v] or any(
            graph.gradient_reads_input(c, v) for c in consumers[v])
        own = 0 if graph.is_view(v) or not read else graph.size_bytes[v]
        out.append(own + graph.internal_saved(v))
    return out


def backward_readers(graph, consumers, members) -> tuple[dict, dict]:
    """Which outputs the backward pass over ``members`` reads, and after which step it may
    free them: the last of its readers in reverse order, i.e. the lowest-numbered one.
    (``consumers``: ``graph.consumers()``, whose readers that read each node are
    ``graph.facts.gradient_readers``.)"""
    members = list(members)
    member_set = set(members)
    facts = graph.facts
    gradient_readers, reads_output, feeds_sink = (facts.gradient_readers, facts.reads_output,
                                                  graph.feeds_sink)
    release_at: dict[int, list[int]] = collections.defaultdict(list)
    retained = {}
    for v in members:
        readers = member_set.intersection(gradient_readers[v])
        if reads_output[v]:
            readers.add(v)
        retained[v] = bool(readers) or feeds_sink[v]
        if readers:
            release_at[min(readers)].append(v)
        elif feeds_sink[v]:
            release_at[v].append(v)
    return release_at, retained


def _buffer_bytes(graph, v, kept) -> int:
    """Bytes ``v`` allocates: none for a view (it shares its input's buffer) unless kept."""
    return graph.size_bytes[v] if v in kept or not graph.is_view(v) else 0


def forward_sweep(graph, order, consumers, retained, ledger, kept, differentiated=(),
             inside: set | None = None, exposing=()) -> None:
    """Run ``order`` forward, freeing each output after its last consumer in ``order`` unless
    ``retained``. Nodes in ``differentiated`` (their gradient is taken from this run) allocate
    their internal saved bytes, recorded in ``inside``; nodes in ``exposing`` their exposed
    bytes (both freed by the caller's backward steps)."""
    order = list(order)
    member_set = set(order)
    differentiated = set(differentiated)
    facts = graph.facts
    unique_inputs, forwards, internal = facts.unique_inputs, facts.forwards, facts.internal
    size_bytes, unkept_bytes = graph.size_bytes, facts.buffer_bytes
    pending = {v: len(member_set.intersection(consumers[v])) for v in order}  # distinct readers
    for v in order:
        if internal[v] and v in differentiated and inside is not None:
            ledger.alloc(internal[v])
            inside.add(v)
        if v in exposing:
            ledger.alloc(graph.exposed(v))
        size = size_bytes[v] if v in kept else unkept_bytes[v]  # _buffer_bytes
        done = []  # inputs whose last reader is v
        for p in unique_inputs[v]:
            if p in pending:
                pending[p] -= 1
                if pending[p] == 0 and not retained[p]:
                    done.append(p)
        # An elementwise op writes into an input nothing else holds (design note "memory
        # model"): no new buffer, and that input's is not freed.
        donor = None
        if size and forwards[v]:
            for p in done:
                if (size_bytes[p] if p in kept else unkept_bytes[p]) == size:
                    donor = p
                    break
        if donor is None:
            ledger.alloc(size)
        for p in done:
            if p != donor:
                ledger.free(size_bytes[p] if p in kept else unkept_bytes[p])
        if pending[v] == 0 and not retained[v]:
            ledger.free(size)


def backward_step(graph, v, grads: set, ledger, release_at,
                  workspace_bytes: Sequence[int] | None = None,
                  inside: set | None = None) -> None:
    """Backprop through ``v``: :func:`backward_steps` of one node."""
    backward_steps(graph, (v,), grads, ledger, release_at, workspace_bytes, inside)


def backward_steps(graph, nodes: Iterable[int], grads: set, ledger, release_at,
                   workspace_bytes: Sequence[int] | None = None,
                   inside: set | None = None) -> None:
    """Backprop through each of ``nodes`` in the order given: allocate its inputs' gradients
    and its variables' gradients (a spike where each is applied at once, as is the kernels'
    scratch; held to the end of the pass where the optimizer applies them together), free its
    own gradient, what it kept inside (``inside``) and the outputs no later step reads.
    Partials for kept nodes stay in ``grads`` until their level. (One loop over the nodes, its
    tables read once: the replays run hundreds of thousands of steps in a search.)"""
    facts = graph.facts
    size_bytes, carries, forwards, unique_inputs = (graph.size_bytes, facts.carries,
                                                    facts.forwards, facts.unique_inputs)
    params_of, internal, buffer_bytes, feeds_sink = (facts.params, facts.internal,
                                                     facts.buffer_bytes, graph.feeds_sink)
    held_params = graph.gradients_held
    update_factor = 1 if held_params else VARIABLE_UPDATE_FACTOR
    alloc, free = ledger.alloc, ledger.free
    for v in nodes:
        if v in grads or feeds_sink[v]:
            # An elementwise op's gradient kernel writes one input's gradient into its own
            # buffer.
            reuse = v in grads and forwards[v]
            for p in unique_inputs[v]:
                if p not in grads and size_bytes[p] and carries[p]:
                    grads.add(p)
                    if reuse and size_bytes[p] == size_bytes[v]:
                        reuse = False
                        grads.discard(v)  # its buffer now holds p's gradient
                        continue
                    alloc(size_bytes[p])
            # The variables' gradients stay when they are held for the optimizer (until after
            # this pass), else they are a spike with their updates' copies
            # (variable_step_bytes).
            params = params_of[v]
            spike = workspace_bytes[v] if workspace_bytes else 0
            if params:  # (most steps take no variable: nothing to allocate, as the ledger's 0)
                held = params if held_params else 0
                alloc(held)
                spike += update_factor * params - held
            if spike:
                alloc(spike)
                free(spike)
            if v in grads:
                grads.discard(v)
                free(size_bytes[v])
        if inside is not None and v in inside:
            inside.discard(v)
            free(internal[v])
        for u in release_at.get(v, ()):
            free(buffer_bytes[u])
