"""The static memory model against schedules worked out by hand."""

from memsave_grads import graph as graph_lib
from memsave_grads import memory_model


def _chain(n, **fields):
    return graph_lib.ForwardGraph(inputs=((),) + tuple((i - 1,) for i in range(1, n)),
                                  size_bytes=(1,) * n, reads_source=(True,) + (False,) * (n - 1),
                                  feeds_sink=(False,) * (n - 1) + (True,), **fields)


def test_plain_chain_by_hand():
    # Forward keeps all 3 outputs (each is read by the next node's gradient): 3 bytes. Backward
    # at node 2 allocates node 1's gradient (4 bytes: the peak), then frees node 2 and node 1's
    # output; at node 1 node 0's gradient replaces node 1's.
    assert memory_model.plain_peak_bytes(_chain(3)) == 4


def test_outputs_no_gradient_reads_are_freed_in_the_forward_pass():
    # add -> add -> add: no gradient reads an input, so the forward pass holds two at a time.
    g = _chain(10, grad_reads_inputs=(False,) * 10)
    assert memory_model.plain_peak_bytes(g) <= 3
    assert memory_model.plain_peak_bytes(_chain(10)) == 11


def test_views_allocate_nothing_unless_kept():
    views = (False,) + (True,) * 9
    assert memory_model.plain_peak_bytes(_chain(10, views=views)) < 5
    assert memory_model.plan_peak_bytes(_chain(10, views=views), kept={5}) >= 2


def test_plan_on_a_chain_peaks_near_kept_plus_one_segment():
    n = 100
    kept = set(range(9, n - 1, 10))  # 9 checkpoints, segments of 10
    peak = memory_model.plan_peak_bytes(_chain(n), kept)
    assert len(kept) + 10 <= peak <= len(kept) + 2 * 10 + 2
    assert memory_model.plain_peak_bytes(_chain(n)) == n + 1


def test_segments_and_levels_mirror_the_rewrite():
    # 0 -> 1 -> 2 -> 3 -> 4 (y), kept {1, 3}: top {4}, segment of 3 is {2, 3}, of 1 is {0, 1}.
    segs = memory_model.segments(_chain(5), {1, 3})
    assert segs.top == [4]
    assert segs.owned == {1: [0, 1], 3: [2, 3]}
    assert segs.levels() == [[3], [1]]
    assert memory_model.segments(_chain(5), {1, 3}, not_replayed={1}).owned[1] == []


def test_variable_gradients_are_a_spike():
    g = _chain(3, param_bytes=(0, 100, 0))
    assert memory_model.plain_peak_bytes(g) >= 100
