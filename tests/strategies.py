"""Graph models for the core's tests: chain builders, Hypothesis strategies, seeded random DAGs.

Everything here builds :class:`memsave_grads.core.graph.ForwardGraph` models, never TensorFlow
graphs, so that the core's tests run without TensorFlow (tests/test_layering.py checks that
importing this module loads none). The TensorFlow builders live in ``tf_builders.py``.

Three kinds, one of each:

- :func:`chain` (and :func:`tanh_chain`, :func:`matmul_tanh_problem`): fixed graphs for tests
  worked out by hand;
- :func:`dags`: a Hypothesis strategy for property tests, shrinking to small counterexamples;
- :func:`random_graph` / :func:`random_problem`: seeded random DAGs for parametrized tests whose
  assertions depend on the exact graph of a seed (brute force over every plan, proven optima).
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from memsave_grads.core import graph as graph_lib
from memsave_grads.core.solvers import problem as problem_lib


def chain(n: int, size_bytes: int = 1, **fields) -> graph_lib.ForwardGraph:
    """``0 -> 1 -> ... -> n-1``: node 0 reads ``x``, node ``n-1`` is ``y``, each output
    ``size_bytes``. ``fields`` are further ForwardGraph fields (``expensive=``, ``views=``...),
    one entry per node; left out, they take the model's defaults (every gradient reads its
    inputs, none its output)."""
    return graph_lib.ForwardGraph(inputs=((),) + tuple((i - 1,) for i in range(1, n)),
                                  size_bytes=(size_bytes,) * n,
                                  reads_source=(True,) + (False,) * (n - 1),
                                  feeds_sink=(False,) * (n - 1) + (True,), **fields)


def tanh_chain(n: int, size_bytes: int) -> graph_lib.ForwardGraph:
    """A chain of tanh-like nodes: each gradient reads the node's own output, never its input
    (the model of ``h = tanh(h)`` repeated, as the measured tests build it)."""
    return chain(n, size_bytes, grad_reads_inputs=(False,) * n, grad_reads_output=(True,) * n)


def matmul_tanh_problem(n: int, size_bytes: int = 1000, *,
                        gradient_reads: bool = False) -> problem_lib.BudgetProblem:
    """A budget problem (budget 0: set it with ``with_budget``) on a chain of matmul -> tanh
    pairs (even nodes are matmuls, 10 flops per node; a tanh costs 1); every node but ``y`` is a
    candidate.

    With ``gradient_reads`` the nodes say what their gradients read as TensorFlow's do (a
    matmul's reads its input, a tanh's its output); without, every gradient reads its inputs
    (the model's conservative default).
    """
    reads = {}
    if gradient_reads:
        reads = {"grad_reads_inputs": tuple(i % 2 == 0 for i in range(n)),
                 "grad_reads_output": tuple(i % 2 == 1 for i in range(n))}
    graph = chain(n, size_bytes, expensive=tuple(i % 2 == 0 for i in range(n)),
                  costs=tuple(10.0 if i % 2 == 0 else 1.0 for i in range(n)), **reads)
    return problem_lib.BudgetProblem(graph, 0, candidates=frozenset(range(n - 1)))


# --------------------------------------------------------------------------------------------
# Hypothesis
# --------------------------------------------------------------------------------------------


@st.composite
def dags(draw, *, min_nodes: int = 2, max_nodes: int = 24, min_size_bytes: int = 1,
         max_size_bytes: int = 1000, max_extra_sinks: int = 2, gradient_flags: bool = False):
    """Random forward regions: node 0 reads ``x``; every node reads 1 to 3 earlier nodes, so
    every node reaches a sink (a node nothing reads is a ``y``).

    Args:
      min_nodes, max_nodes: the range of the node count.
      min_size_bytes, max_size_bytes: the range of each node's output size (0 allowed: a
        shape-only op).
      max_extra_sinks: up to this many nodes that other nodes read are ``y`` too.
      gradient_flags: also draw, per node, whether its gradient reads its inputs and its output
        and whether it is a view (else the model's defaults).
    """
    n = draw(st.integers(min_nodes, max_nodes))
    inputs = [()]
    for node in range(1, n):
        preds = draw(st.sets(st.integers(0, node - 1), min_size=1, max_size=min(3, node)))
        inputs.append(tuple(sorted(preds)))
    has_consumer = {p for preds in inputs for p in preds}
    extra_sinks = set()
    if max_extra_sinks:
        extra_sinks = draw(st.sets(st.integers(0, n - 1), max_size=max_extra_sinks))
    sizes = tuple(draw(st.lists(st.integers(min_size_bytes, max_size_bytes),
                                min_size=n, max_size=n)))
    flags = {}
    if gradient_flags:
        for name in ("grad_reads_inputs", "grad_reads_output", "views"):
            flags[name] = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return graph_lib.ForwardGraph(
        inputs=tuple(inputs), size_bytes=sizes, reads_source=(True,) + (False,) * (n - 1),
        feeds_sink=tuple(v not in has_consumer or v in extra_sinks for v in range(n)), **flags)


# --------------------------------------------------------------------------------------------
# Seeded random DAGs
# --------------------------------------------------------------------------------------------


def random_graph(rng: random.Random, n: int) -> graph_lib.ForwardGraph:
    """A random DAG with branches, joins, views, variables and dead ends, every field drawn
    from ``rng``: the same seed gives the same graph."""
    inputs = [()]
    for v in range(1, n):
        preds = {rng.choice(range(max(0, v - 4), v)) for _ in range(rng.choice([1, 1, 1, 2, 2, 3]))}
        if rng.random() < 0.1:
            preds.add(rng.randrange(v))
        inputs.append(tuple(sorted(preds)))
    read = {p for preds in inputs for p in preds}
    return graph_lib.ForwardGraph(
        inputs=tuple(inputs),
        size_bytes=tuple(rng.choice([0, 1, 2, 4, 8, 8, 16]) for _ in range(n)),
        reads_source=tuple(not preds for preds in inputs),
        feeds_sink=tuple(v == n - 1 or v not in read for v in range(n)),
        grad_reads_inputs=tuple(rng.random() < 0.6 for _ in range(n)),
        grad_reads_output=tuple(rng.random() < 0.4 for _ in range(n)),
        views=tuple(rng.random() < 0.15 for _ in range(n)),
        param_bytes=tuple(rng.choice([0, 0, 0, 3, 10]) for _ in range(n)),
        costs=tuple(float(rng.choice([1, 2, 5, 10, 50])) for _ in range(n)),
        unread_inputs=tuple(frozenset(p for p in preds if rng.random() < 0.3) for preds in inputs),
        forwards=tuple(rng.random() < 0.4 for _ in inputs))


def random_problem(seed: int, low: int = 5, high: int = 11) -> problem_lib.BudgetProblem:
    """A budget problem on :func:`random_graph` of ``low..high`` nodes, with must-keep,
    not-replayed and candidate sets drawn from the same seed (budget 0: set it with
    ``with_budget``)."""
    rng = random.Random(seed)
    n = rng.randint(low, high)
    graph = random_graph(rng, n)
    must = frozenset(v for v in range(n) if rng.random() < 0.1)
    not_replayed = frozenset(v for v in must if rng.random() < 0.5)
    # As in gradients(): the ops producing the ys are not candidates (most of the time).
    candidates = frozenset(v for v in range(n) if not graph.feeds_sink[v] or rng.random() < 0.2)
    return problem_lib.BudgetProblem(graph, 0, must_keep=must, candidates=candidates,
                                 not_replayed=not_replayed)
