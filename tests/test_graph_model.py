"""The TF-free graph model, planner and memory model, property-tested against brute force."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import planners
from strategies import chain, dags


def _reachable_without(g, start, blocked):
    """Nodes reachable downstream of ``start`` through non-blocked nodes."""
    consumers = g.consumers()
    seen, stack = set(), list(consumers[start])
    while stack:
        v = stack.pop()
        if v in seen or v in blocked:
            continue
        seen.add(v)
        stack.extend(consumers[v])
    return seen


@settings(max_examples=200, deadline=None)
@given(dags())
def test_frontier_cuts_cut_the_graph(g):
    """Keeping a cut's frontier separates what comes before it from what comes after it."""
    plan = planners.frontier_cuts(g, must_keep=[], candidates=range(g.num_nodes))
    if plan is None:
        return
    uses = graph_lib.last_uses(g)
    for position, live in zip(plan.cuts, graph_lib.frontiers(g, plan.cuts, uses=uses)):
        assert set(live) <= plan.kept
        for v in range(position + 1):
            if v not in plan.kept:
                assert all(c <= position for c in _reachable_without(g, v, plan.kept)), (
                    f"node {v} reaches past cut {position} around the kept nodes")
    # The plan is closed: every recomputed node has one owner (design note "single owner").
    assert graph_lib.close_segments(g, plan.kept) == plan.kept
    assert plan.predicted_peak_bytes == memory_model.plan_peak_bytes(g, plan.kept)


def test_frontier_is_what_crosses_the_cut():
    # 0 -> 1 -> 2 -> 3 (y), and 0 -> 3: a skip connection around 1 and 2.
    g = graph_lib.ForwardGraph(inputs=((), (0,), (1,), (0, 2)), size_bytes=(1, 1, 1, 1),
                               reads_source=(True, False, False, False),
                               feeds_sink=(False, False, False, True))
    assert graph_lib.frontiers(g, [0, 1, 2, 3]) == [[0], [0, 1], [0, 2], [3]]
    assert graph_lib.frontier(g, 1, always_live=[0]) == [1]


def test_chain_plan_keeps_about_sqrt_n_and_predicts_the_saving():
    g = chain(100)
    plan = planners.frontier_cuts(g, must_keep=[], candidates=range(99))
    assert 5 <= len(plan.kept) <= 20
    assert memory_model.plain_peak_bytes(g) >= 100
    assert plan.predicted_peak_bytes <= 30  # ~2 sqrt(100) plus gradients


def test_u_net_without_single_separators_is_cut():
    """An encoder-decoder whose every level has a long skip: no single node separates it."""
    inputs = []

    def node(*preds):
        inputs.append(tuple(sorted(preds)))
        return len(inputs) - 1

    skips, h = [], None
    for _ in range(4):
        h = node(*(() if h is None else (h,)))
        for _ in range(3):
            h = node(h)
        skips.append(h)
    for level in reversed(range(4)):
        h = node(h, skips[level])
        for _ in range(3):
            h = node(h)
    n = len(inputs)
    g = graph_lib.ForwardGraph(inputs=tuple(inputs), size_bytes=(10,) * n,
                               reads_source=(True,) + (False,) * (n - 1),
                               feeds_sink=(False,) * (n - 1) + (True,))
    plan = planners.frontier_cuts(g, must_keep=[], candidates=range(n - 1))
    assert plan is not None and plan.cuts
    assert plan.predicted_peak_bytes < memory_model.plain_peak_bytes(g)


def test_cut_prefers_an_expensive_op_output_at_equal_bytes():
    # matmul -> relu -> matmul -> relu ...: keeping matmul outputs recomputes only relus.
    n = 40
    g = chain(n, expensive=tuple(i % 2 == 0 for i in range(n)))
    plan = planners.frontier_cuts(g, must_keep=[], candidates=range(n - 1))
    assert plan.kept and all(g.expensive[v] for v in plan.kept)


@settings(max_examples=200, deadline=None)
@given(dags(), st.data())
def test_close_segments_gives_every_node_one_owner(g, data):
    kept = data.draw(st.sets(st.integers(0, g.num_nodes - 1)))
    closed = graph_lib.close_segments(g, kept)
    assert set(kept) <= closed
    consumers = g.consumers()
    # Brute force: the segments (kept node + non-kept ancestors up to kept nodes) are disjoint.
    owners = {}
    seeds = [(k, k) for k in closed] + [("top", v) for v in range(g.num_nodes)
                                        if g.feeds_sink[v] and v not in closed]
    for owner, start in seeds:
        stack = [start] if owner == "top" else [p for p in g.inputs[start]]
        while stack:
            v = stack.pop()
            if v in closed:
                continue
            assert owners.setdefault(v, owner) == owner, f"node {v} in two segments"
            stack.extend(g.inputs[v])
    assert consumers is not None


def test_close_segments_keeps_an_unkept_residual_stream():
    # h1 = h0 + t(m1); m2 = mm(h1); h2 = h1 + t(m2) ... with only the matmuls kept ("speed").
    # nodes: 0 h0(in), 1 m1, 2 t1, 3 h1, 4 m2, 5 t2, 6 h2, 7 m3, 8 t3, 9 h3(y)
    inputs = ((), (0,), (1,), (0, 2), (3,), (4,), (3, 5), (6,), (7,), (6, 8))
    g = graph_lib.ForwardGraph(inputs=inputs, size_bytes=(1,) * 10,
                               reads_source=(True,) + (False,) * 9,
                               feeds_sink=(False,) * 9 + (True,))
    assert graph_lib.close_segments(g, {1, 4, 7}) == {0, 1, 3, 4, 6, 7}


def test_a_long_lived_key_holds_neither_the_memo_nor_the_facts():
    g = chain(12)
    graph_lib.memo(g)["something"] = [0] * 1000
    facts = g.facts
    bare = graph_lib.without_memo(g)
    assert bare == g and "_memo" not in vars(bare) and "facts" not in vars(bare)
    assert bare.facts == facts  # made again where read, the same
    assert "facts" in vars(g) and graph_lib.memo(g)["something"]  # the model itself keeps both
