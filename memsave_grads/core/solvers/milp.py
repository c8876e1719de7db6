"""An exact mixed-integer program over kept sets (``"milp"``), for small general graphs."""

from __future__ import annotations

import dataclasses
import logging
import time

from memsave_grads import errors
from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import plan as plan_lib
from memsave_grads.core.solvers import problem as problem_lib
from memsave_grads.core.solvers.dp import solve_dp
from memsave_grads.core.solvers.greedy import solve_greedy
from memsave_grads.core import schedule as schedule_lib

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: The MILP is built for graphs of at most this many nodes (it grows quadratically); larger
#: ones get the best of the greedy and anytime dp plans within the deadline.
MILP_MAX_NODES = 600
#: Solutions the MILP may reject (replay over budget, each then excluded) before it gives up
#: on optimality; the time limit usually ends it first.
MILP_MAX_ROUNDS = 1000
#: The default deadline of the whole solve (the greedy plan and the MILP rounds), in seconds.
MILP_TIME_LIMIT_SECONDS = 30.0
#: The MILP's pair variables (see :func:`_milp_model`) are limited to about this many; beyond
#: it each node looks back over a shorter window of ancestors (still a valid lower bound).
MILP_MAX_PAIRS = 40000
#: Single-owner rows are written for nodes whose branch region (up to their nearest
#: post-dominator) has at most this many nodes.
MILP_REGION_NODES = 60


def _milp_facts(graph: graph_lib.ForwardGraph, not_replayed, candidates) -> dict:
    """Plan-independent facts the MILP's memory rows rest on (see :func:`_milp_model`).

    * ``runs[v]``: v's backward step runs under every plan: it produces a ``y`` and may not be
      kept, or its gradient is allocated, i.e. it has bytes and some reader's step runs.
    * ``has_grad[v]``: v's own gradient is allocated before its step.
    * ``release[u]``: the step after which a non-kept ``u`` is freed, when all its readers are
      in its own segment (true for every non-kept node of a closed plan: single owner); ``None``
      if nothing retains it.
    * ``bad[v]``: v is a never-replayed node or an ancestor of one (its step may never run).
    * ``ancestors[v]``: bitset of v's ancestors along paths that pass no never-replayed node.
    """
    n = graph.num_nodes
    consumers = graph.consumers()
    nr = set(not_replayed)
    bad, runs, has_grad = [False] * n, [False] * n, [False] * n
    for v in reversed(range(n)):
        bad[v] = v in nr or any(bad[c] for c in consumers[v])
        has_grad[v] = graph.size_bytes[v] > 0 and any(runs[c] for c in consumers[v])
        # A kept node that produces a y but gets no gradient is never backpropagated.
        runs[v] = (graph.feeds_sink[v] and v not in candidates) or has_grad[v]
    release = []
    for u in range(n):
        readers = [c for c in consumers[u] if graph.gradient_reads_input(c, u)]
        if graph.gradient_reads_output(u):
            readers.append(u)
        release.append(min(readers) if readers else (u if graph.feeds_sink[u] else None))
    ancestors = [0] * n
    for v in range(n):
        bits = 0
        for p in set(graph.inputs[v]):
            bits |= (1 << p) | (0 if p in nr else ancestors[p])
        ancestors[v] = bits
    return {"bad": bad, "runs": runs, "has_grad": has_grad, "release": release,
            "ancestors": ancestors}


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _milp_model(problem: problem_lib.BudgetProblem, max_pairs: int | None = None):
    """The MILP (see :func:`solve_milp`) as a dict of numpy/scipy parts.

    Variables per node v: x_v (kept, binary), t_v (in the top segment, binary), y_v (a retained
    output of the top), h_v / l_v (the largest / smallest t over v's readers); and per pair
    (u, v), u an ancestor of v: s_uv, at least 1 when u is not kept and reaches v along nodes
    that are not kept (so u is recomputed in v's segment, or is in the top with v).

    The memory rows ``A z + c <= budget`` are a *valid relaxation*: for every closed kept set
    (with t its top, and y, s at their smallest) each left-hand side is at most the replay's
    peak (``memory_model.plan_peak_bytes``); tests/test_solvers.py checks this by enumeration.
    Rows: (a) bytes alive when the forward pass ends; (b) when node v is allocated in the
    forward pass; (c) at the backward step of a top node v: every kept node, the top's
    retained outputs not freed yet, v's step (its gradient, its inputs' gradients, its
    variables' gradients); (d) at the backward step of any node v, in whatever segment: the
    kept ancestors of v (a kept ancestor has a higher level than v's segment, so it is still
    held), v's inputs its gradient reads (kept, or retained in v's segment), the retained
    outputs of v's own segment not freed yet (the s terms), v's own output if its gradient
    reads it, gradients already produced for its ancestors, and v's step. A buffer that an
    elementwise op may take over (``forwards_buffer``) is counted once. Single-owner rows
    between segments: see the comment above them. Returns the MILP's parts, the memory rows'
    constants and labels, and the pair variables' columns.
    """
    import numpy as np  # pylint: disable=import-outside-toplevel
    from scipy import sparse  # pylint: disable=import-outside-toplevel

    max_pairs = MILP_MAX_PAIRS if max_pairs is None else max_pairs
    graph = problem.graph
    n = graph.num_nodes
    consumers = graph.consumers()
    size = graph.size_bytes
    buffer = [0 if graph.is_view(v) else size[v] for v in range(n)]
    facts = _milp_facts(graph, problem.not_replayed, problem.candidates)
    x, t, y, h, l = (lambda v: v), (lambda v: n + v), (lambda v: 2 * n + v), \
        (lambda v: 3 * n + v), (lambda v: 4 * n + v)
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add(terms, lo, hi):
        r = len(lower)
        for col, val in terms:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    for v in range(n):
        sink = graph.feeds_sink[v]
        add([(x(v), 1), (t(v), 1)], -np.inf, 1)  # kept or top or recomputed
        if sink:
            add([(x(v), 1), (t(v), 1)], 1, np.inf)
        # In the top exactly when not kept and a y or a top node reads it.
        add([(t(v), 1)] + [(t(c), -1) for c in consumers[v]], -np.inf, 1 if sink else 0)
        for c in consumers[v]:
            add([(t(v), 1), (t(c), -1), (x(v), 1)], 0, np.inf)
            add([(h(v), 1), (t(c), -1)], 0, np.inf)
            add([(t(c), 1), (l(v), -1)], 0, np.inf)
            if graph.gradient_reads_input(c, v):
                add([(y(v), 1), (t(c), -1), (x(v), 1)], 0, np.inf)
        # Read by the top and by a recomputed segment: kept (single owner).
        add([(x(v), 1), (h(v), -1), (l(v), 1)], 0, np.inf)
        if graph.gradient_reads_output(v) or sink:
            add([(y(v), 1), (t(v), -1)], 0, np.inf)

    # Single owner between recomputed segments: a kept w that does not post-dominate u (here:
    # w strictly between u and its nearest post-dominator) gives u two owners unless u is kept
    # or some node between u and w is (then w need not own u). x_w <= x_u + sum of x between.
    descendants = [0] * n
    for v in reversed(range(n)):
        for c in consumers[v]:
            descendants[v] |= (1 << c) | descendants[c]
    sink_bit = 1 << n
    post = [0] * n  # post-dominators (bit n: the virtual sink)
    for v in reversed(range(n)):
        if not consumers[v] and not graph.feeds_sink[v]:
            continue  # dead: nothing reads it
        common = sink_bit if graph.feeds_sink[v] else -1
        for c in consumers[v]:
            common &= post[c] if post[c] else 0
        post[v] = (1 << v) | (common if common != -1 else 0)
    for u in range(n):
        nearer = post[u] & ~(1 << u)
        if not nearer or u in problem.must_keep:
            continue
        nearest = (nearer & -nearer).bit_length() - 1
        if nearest == n:
            continue  # only the virtual sink post-dominates u: the top owns it anyway
        region = descendants[u] & ~descendants[nearest] & ~(1 << nearest)
        region_nodes = _bits(region)
        if len(region_nodes) > MILP_REGION_NODES:
            continue
        for w in region_nodes:
            between = [a for a in region_nodes if a != w and (descendants[a] >> w) & 1]
            if w in problem.candidates:
                add([(x(w), 1), (x(u), -1)] + [(x(a), -1) for a in between], -np.inf, 0)

    # Pair variables s_uv, for the nodes v that get a row (d), over a window of ancestors.
    step = [(size[v] if facts["has_grad"][v] else 0)
            + memory_model.variable_step_bytes(graph, v)
            + sum(size[p] for p in set(graph.inputs[v])) for v in range(n)]
    for v in range(n):
        # An elementwise op's gradient may become one input's gradient: count that once.
        if facts["has_grad"][v] and graph.forwards_buffer(v) and any(
                size[p] == size[v] for p in graph.inputs[v]):
            step[v] -= size[v]
    row_nodes = [v for v in range(n) if facts["runs"][v] and not facts["bad"][v]]
    ancestors = facts["ancestors"]
    # later[v]: descendants of v whose step runs; reader_bits[u]: u's readers whose step runs.
    later, reader_bits = [0] * n, [0] * n
    for v in reversed(range(n)):
        for c in consumers[v]:
            if facts["runs"][c]:
                later[v] |= 1 << c
                reader_bits[v] |= 1 << c
            later[v] |= later[c]
    window = n
    while window > 1 and sum(len(_bits(ancestors[v] >> max(v - window, 0)))
                             for v in row_nodes) > max_pairs:
        window //= 2
    pair_index: dict[tuple[int, int], int] = {}
    pair_rows = []  # (v, [(u, coefficient)]) of row (d), built below
    for v in row_nodes:
        first = max(v - window, 0)
        near = [u + first for u in _bits(ancestors[v] >> first)]
        reads_inputs = {p for p in graph.inputs[v] if graph.gradient_reads_input(v, p)}
        release = facts["release"]
        # Retained outputs of v's segment that are still held at v's step.
        held = {u for u in near if u not in reads_inputs and buffer[u]
                and release[u] is not None and release[u] <= v}
        # Nodes on paths from a held node to v (descendants of one, in the window): their s
        # variables carry the path.
        on_path = set()
        for u in sorted(near):
            if u in held or any(p in on_path for p in graph.inputs[u]):
                on_path.add(u)
        for u in on_path:
            pair_index[(u, v)] = 5 * n + len(pair_index)
        pair_rows.append((v, near, reads_inputs, held, on_path))

    # s_uv >= s_cv - x_u for each reader c of u on the way to v (s_vv = 1).
    for (u, v), col in pair_index.items():
        for c in consumers[u]:
            if c == v:
                add([(col, 1), (x(u), 1)], 1, np.inf)
            elif (c, v) in pair_index:
                add([(col, 1), (pair_index[(c, v)], -1), (x(u), 1)], 0, np.inf)

    # Memory rows come last: A z <= budget - c, with c in ``constants``.
    first_memory_row = len(lower)
    constants, labels = [], []

    def memory(terms, constant, label):
        labels.append(label)
        terms = [(col, val) for col, val in terms if val]
        add(terms, -np.inf, 0.0)  # the upper bound is set per budget
        constants.append(float(constant))

    kept_terms = [(x(v), size[v]) for v in range(n) if size[v]]
    # (a) when the forward pass ends.
    memory(kept_terms + [(y(v), buffer[v]) for v in range(n) if buffer[v]], 0, "end")
    # (b) when v is allocated in the forward pass.
    for v in range(n):
        inputs = set(graph.inputs[v])
        terms = [(x(u), size[u]) for u in range(v) if size[u] and u not in inputs]
        terms += [(y(u), buffer[u]) for u in range(v) if buffer[u] and u not in inputs]
        terms += [(x(p), size[p] - buffer[p]) for p in inputs]
        terms.append((x(v), size[v] - buffer[v]))
        # An elementwise op may take over an input's buffer instead of allocating its own.
        donated = max((buffer[p] for p in inputs if buffer[p] in (buffer[v], size[v])),
                      default=0) if graph.forwards_buffer(v) else 0
        memory(terms, buffer[v] + sum(buffer[p] for p in inputs) - donated, ("forward", v))
    # (c) at the backward step of top node v.
    last_reader = [max(consumers[u], default=u) for u in range(n)]
    for v in range(n):
        if not facts["runs"][v] or not step[v]:
            continue
        alive = [(y(u), buffer[u]) for u in range(v + 1) if buffer[u] and last_reader[u] <= v]
        memory(kept_terms + alive + [(t(v), step[v])], 0, ("top", v))
    # (d) at the backward step of v, in any segment.
    for v, near, reads_inputs, held, on_path in pair_rows:
        coefficient = {}
        for u in near:
            coefficient[x(u)] = size[u] - (buffer[u] if u in reads_inputs else 0)
        for u in held:
            coefficient[pair_index[(u, v)]] = buffer[u]
        own = buffer[v] if facts["release"][v] == v else 0
        # Gradients already allocated and not yet freed: of every ancestor u (not an input of
        # v: counted in the step) that a descendant of v reads, whose step has run (it comes
        # before v's: in v's segment, the top or a lower level); u's own step comes after.
        inputs = set(graph.inputs[v])
        pending = sum(size[u] for u in _bits(ancestors[v])
                      if u not in inputs and reader_bits[u] & later[v])
        memory(list(coefficient.items()),
               step[v] + own + pending + sum(buffer[u] for u in reads_inputs), ("step", v))
    num_vars = 5 * n + len(pair_index)
    cost = np.zeros(num_vars)
    for v in range(n):
        # Minimise what is neither kept nor top. An ancestor of a never-replayed node may be
        # in no segment at all (free): it counts 0, so the optimum stays a lower bound.
        if v not in problem.must_keep and not facts["bad"][v]:
            cost[x(v)] = cost[t(v)] = -graph.cost_of(v)
    lo_bounds, hi_bounds = np.zeros(num_vars), np.ones(num_vars)
    hi_bounds[5 * n:] = np.inf
    for v in range(n):
        # A node that is not a candidate may still be kept by the single-owner closure, so
        # its x stays free: the plan taken from a solution keeps candidates only.
        if v in problem.must_keep:
            lo_bounds[x(v)] = 1
        if graph.feeds_sink[v]:
            lo_bounds[h(v)] = 1
    integrality = np.zeros(num_vars)
    integrality[:2 * n] = 1
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lower), num_vars))
    return {"cost": cost, "matrix": matrix, "lower": np.array(lower), "upper": np.array(upper),
            "lo_bounds": lo_bounds, "hi_bounds": hi_bounds, "integrality": integrality,
            "first_memory_row": first_memory_row, "constants": np.array(constants),
            "labels": labels,
            "pairs": pair_index, "window": window,
            "fixed_cost": -float(cost.sum()) / 2}


def _natural_assignment(problem: problem_lib.BudgetProblem, model: dict, kept):
    """The MILP variables of a closed kept set: x, its top, and y, h, l, s at their smallest."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    graph = problem.graph
    n = graph.num_nodes
    consumers = graph.consumers()
    kept = set(kept)
    top = set(schedule_lib.build(graph, kept, problem.not_replayed).top)
    z = np.zeros(len(model["cost"]))
    for v in range(n):
        z[v] = v in kept
        z[n + v] = v in top
    for v in range(n):
        readers_top = [z[n + c] for c in consumers[v]]
        y = [z[n + c] - z[v] for c in consumers[v] if graph.gradient_reads_input(c, v)]
        if graph.gradient_reads_output(v) or graph.feeds_sink[v]:
            y.append(z[n + v])
        z[2 * n + v] = max([0.0] + y)
        z[3 * n + v] = max(readers_top + ([1.0] if graph.feeds_sink[v] else []) + [0.0])
        z[4 * n + v] = min(readers_top + [1.0])
    pairs = model["pairs"]
    for (u, v), col in sorted(pairs.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
        best = 0.0
        for c in consumers[u]:
            if c == v:
                best = max(best, 1.0 - z[u])
            elif (c, v) in pairs:
                best = max(best, z[pairs[(c, v)]] - z[u])
        z[col] = best
    return z


def milp_lower_bound(problem: problem_lib.BudgetProblem, kept, model: dict | None = None) -> int:
    """The largest left-hand side of the MILP's memory rows for a closed kept set: a lower
    bound of its replayed peak (for tests: the relaxation is valid)."""
    model = _milp_model(problem) if model is None else model
    z = _natural_assignment(problem, model, kept)
    first = model["first_memory_row"]
    values = model["matrix"][first:] @ z + model["constants"]
    return int(round(max(values)))


def solve_milp(problem: problem_lib.BudgetProblem,
               time_limit_seconds: float | None = None) -> plan_lib.Plan:
    """The cheapest kept set under the budget (exact; small graphs; needs scipy).

    The greedy plan comes first: its cost caps the MILP's objective (a plan must not recompute
    more) and it is the answer if the MILP finds nothing better in time. Each MILP solution is
    closed and replayed; one the replay rejects is excluded (a no-good cut) and the MILP solved
    again. Because the memory rows are a valid relaxation, the MILP's optimum is a lower bound
    of the true optimum at every round, so the plan is proven optimal as soon as the best plan
    replayed costs no more than that bound (``optimal=True``); never otherwise.

    Anytime: everything (the greedy plan included) runs within ``time_limit_seconds`` (else
    ``problem.deadline_seconds``, else :data:`MILP_TIME_LIMIT_SECONDS`), after which the best
    plan found stands. On graphs of more than :data:`MILP_MAX_NODES` nodes the MILP is not
    built (its memory rows hold a term per kept ancestor: quadratic, 9 million terms on 1300
    nodes): the plan is the best of the greedy solver's and the anytime ``"dp"``'s in the time
    left, never flagged optimal (design note "budget solvers").
    """
    try:
        import numpy as np  # pylint: disable=import-outside-toplevel
        from scipy import optimize, sparse  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.MissingDependencyError(
            "checkpoints: the 'milp' solver needs scipy (scipy.optimize.milp, HiGHS), which is "
            "not installed. Install it with `pip install scipy` (or memsave-grads[milp]), or use "
            "the 'greedy' or 'dp' solver.") from e
    graph = problem.graph
    started = time.perf_counter()
    if time_limit_seconds is None:
        time_limit_seconds = (MILP_TIME_LIMIT_SECONDS if problem.deadline_seconds is None
                              else problem.deadline_seconds)
    scorer = problem_lib.Scorer(problem)
    try:
        scorer(solve_greedy(problem).kept)
        seed_error = None
    except errors.InfeasibleBudgetError as e:
        seed_error = e
    if scorer.best is not None and scorer.best[2] == 0:
        return scorer.plan("milp", started, optimal=True)
    if graph.num_nodes > MILP_MAX_NODES:
        return _without_the_milp(problem, scorer, started, time_limit_seconds, seed_error)
    model = _milp_model(problem)
    num_vars = len(model["cost"])
    upper = model["upper"].copy()
    first = model["first_memory_row"]
    scale = 1.0 / max(problem.budget_bytes, 1)
    matrix = model["matrix"].tocsr().copy()
    matrix = sparse.diags(np.concatenate([np.ones(first), np.full(
        matrix.shape[0] - first, scale)])) @ matrix
    upper[first:] = (problem.budget_bytes - model["constants"]) * scale
    cost_scale = 1.0 / max(model["fixed_cost"], 1e-30)
    objective = model["cost"] * cost_scale
    free = [v for v in sorted(problem.candidates) if model["lo_bounds"][v] == 0]
    extra_rows, extra_lower = [], []
    if scorer.best is not None:
        # No plan worth finding recomputes more than the greedy one.
        extra_rows.append(sparse.csr_matrix(-objective))
        extra_lower.append(model["fixed_cost"] * cost_scale - scorer.best[2] * cost_scale
                           * (1 + 1e-9))
    proven = False
    for round_index in range(MILP_MAX_ROUNDS):
        remaining = time_limit_seconds - (time.perf_counter() - started)
        if remaining <= 0:
            break
        constraints = [optimize.LinearConstraint(matrix, model["lower"], upper)]
        if extra_rows:
            constraints.append(optimize.LinearConstraint(
                sparse.vstack(extra_rows), np.array(extra_lower), np.inf))
        result = optimize.milp(objective, constraints=constraints,
                               integrality=model["integrality"],
                               bounds=optimize.Bounds(model["lo_bounds"], model["hi_bounds"]),
                               options={"time_limit": remaining, "mip_rel_gap": 1e-7})
        if result.status == 2:
            # Infeasible: no kept set not yet excluded beats (or, without a greedy plan,
            # meets) the budget's lower bounds, so the best plan replayed is optimal.
            proven = True
            break
        if result.x is None:
            break  # out of time without a solution
        bound = getattr(result, "mip_dual_bound", None)
        if bound is None or not np.isfinite(bound):
            bound = result.fun if result.status == 0 else -np.inf
        lowest_cost = (model["fixed_cost"] * cost_scale + bound) / cost_scale
        kept = {v for v in problem.candidates if result.x[v] > 0.5}
        _, peak, _ = scorer(kept)
        _LOG.debug("memsave_grads: milp round %d (%.2f s): status %d, bound %.4g, "
                   "replay peak %d of %d, best %s", round_index,
                   time.perf_counter() - started, result.status, lowest_cost, peak,
                   problem.budget_bytes, scorer.best and scorer.best[2])
        if scorer.best is not None and scorer.best[2] <= lowest_cost * (1 + 1e-6) + 1e-9:
            proven = True
            break
        if result.status != 0:
            break  # out of time: the bound does not close
        # The replay rejects this kept set: exclude it, and every set of candidates between
        # it and its closure (they close to the same plan), and solve again.
        closed = scorer(kept)[0]
        row = np.zeros(num_vars)
        for v in free:
            if v in kept:
                row[v] = -1.0
            elif v not in closed:
                row[v] = 1.0
        extra_rows.append(sparse.csr_matrix(row))
        extra_lower.append(1 - sum(1 for v in free if v in kept))
    if scorer.best is None:
        # Nothing fits (proven when the MILP is infeasible): the greedy solver's error, whose
        # smallest peak is one its plans reach.
        raise seed_error
    return scorer.plan("milp", started, optimal=proven)



def _without_the_milp(problem: problem_lib.BudgetProblem, scorer: problem_lib.Scorer,
                      started: float, time_limit_seconds: float,
                      seed_error: Exception | None) -> plan_lib.Plan:
    """A graph too large for the MILP: the anytime DP in the time left, then the best plan
    scored (the greedy one, or the DP's), not flagged optimal."""
    left = time_limit_seconds - (time.perf_counter() - started)
    _LOG.info("memsave_grads: milp: %d forward ops, more than the %d the MILP is built for; "
                 "the best of the greedy and dp plans found in %.1f s", problem.graph.num_nodes,
                 MILP_MAX_NODES, time_limit_seconds)
    if left > 0:
        try:
            scorer(solve_dp(dataclasses.replace(problem, deadline_seconds=left)).kept)
        except errors.InfeasibleBudgetError:
            pass
    if scorer.best is None:
        raise seed_error
    return scorer.plan("milp", started)
