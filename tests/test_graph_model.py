"""The TF-free graph model and planner, property-tested against brute force."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memsave_grads import graph as graph_lib
from memsave_grads import planners


@st.composite
def region_dags(draw, max_nodes=24):
    """Random forward regions: one entry node reading x, every node reaches a sink."""
    n = draw(st.integers(2, max_nodes))
    inputs = [()]
    for node in range(1, n):
        preds = draw(st.sets(st.integers(0, node - 1), min_size=1, max_size=min(3, node)))
        inputs.append(tuple(sorted(preds)))
    has_consumer = {p for preds in inputs for p in preds}
    extra_sinks = draw(st.sets(st.integers(0, n - 1), max_size=2))
    feeds_sink = tuple(v not in has_consumer or v in extra_sinks for v in range(n))
    sizes = tuple(draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n)))
    return graph_lib.ForwardGraph(inputs=tuple(inputs), size_bytes=sizes,
                                  reads_source=(True,) + (False,) * (n - 1), feeds_sink=feeds_sink)


def _brute_force_separators(g):
    consumers = g.consumers()
    result = []
    for v in range(g.num_nodes):
        if v == 0:
            result.append(v)
            continue
        seen, stack, escapes = set(), [0], False
        while stack and not escapes:
            u = stack.pop()
            if u in seen or u == v:
                continue
            seen.add(u)
            escapes = g.feeds_sink[u]
            stack.extend(consumers[u])
        if not escapes:
            result.append(v)
    return result


@settings(max_examples=300, deadline=None)
@given(region_dags())
def test_separator_sweep_matches_brute_force(g):
    assert graph_lib.separators(g) == _brute_force_separators(g)


@settings(max_examples=100, deadline=None)
@given(region_dags())
def test_planner_returns_separators_and_never_worsens_the_estimate(g):
    chosen = planners.sqrt_n_separators(g, must_keep=[], candidates=range(g.num_nodes))
    assert set(chosen) <= set(graph_lib.separators(g))
    assert planners.estimated_peak_bytes(g, chosen) <= sum(g.size_bytes)


def test_chain_keeps_about_sqrt_n():
    n = 100
    g = graph_lib.ForwardGraph(inputs=((),) + tuple((i - 1,) for i in range(1, n)),
                               size_bytes=(1,) * n, reads_source=(True,) + (False,) * (n - 1),
                               feeds_sink=(False,) * (n - 1) + (True,))
    chosen = planners.sqrt_n_separators(g, must_keep=[], candidates=range(n - 1))
    assert 5 <= len(chosen) <= 20
    assert planners.estimated_peak_bytes(g, chosen) <= 25


def test_always_live_edges_do_not_block_separators():
    # 0 -> 1 -> 2 -> 3, and 0 feeds every node (a weight read kept anyway).
    g = graph_lib.ForwardGraph(inputs=((), (0,), (0, 1), (0, 2)), size_bytes=(1, 1, 1, 1),
                               reads_source=(True, False, False, False),
                               feeds_sink=(False, False, False, True))
    assert graph_lib.separators(g) == [0, 3]  # 3 produces y: every path ends there
    assert graph_lib.separators(g, always_live=[0]) == [1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(region_dags(), st.data())
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
