"""The static memory model against schedules worked out by hand."""

import dataclasses

from memsave_grads.core import graph as graph_lib
from memsave_grads.core import memory_model
from memsave_grads.core import schedule as schedule_lib
from strategies import chain


def test_plain_chain_by_hand():
    # Forward keeps all 3 outputs (each is read by the next node's gradient): 3 bytes. Backward
    # at node 2 allocates node 1's gradient (4 bytes: the peak), then frees node 2 and node 1's
    # output; at node 1 node 0's gradient replaces node 1's.
    assert memory_model.plain_peak_bytes(chain(3)) == 4


def test_outputs_no_gradient_reads_are_freed_in_the_forward_pass():
    # add -> add -> add: no gradient reads an input, so the forward pass holds two at a time.
    g = chain(10, grad_reads_inputs=(False,) * 10)
    assert memory_model.plain_peak_bytes(g) <= 3
    assert memory_model.plain_peak_bytes(chain(10)) == 11


def test_views_allocate_nothing_unless_kept():
    views = (False,) + (True,) * 9
    assert memory_model.plain_peak_bytes(chain(10, views=views)) < 5
    assert memory_model.plan_peak_bytes(chain(10, views=views), kept={5}) >= 2


def test_plan_on_a_chain_peaks_near_kept_plus_one_segment():
    n = 100
    kept = set(range(9, n - 1, 10))  # 9 checkpoints, segments of 10
    peak = memory_model.plan_peak_bytes(chain(n), kept)
    assert len(kept) + 10 <= peak <= len(kept) + 2 * 10 + 2
    assert memory_model.plain_peak_bytes(chain(n)) == n + 1


def test_segments_and_levels_mirror_the_rewrite():
    # 0 -> 1 -> 2 -> 3 -> 4 (y), kept {1, 3}: top {4}, segment of 3 is {2, 3}, of 1 is {0, 1}.
    sched = schedule_lib.build(chain(5), {1, 3})
    assert sched.top == (4,)
    assert sched.owned == {1: (0, 1), 3: (2, 3)}
    assert [level.nodes for level in sched.levels] == [[3], [1]]
    assert schedule_lib.build(chain(5), {1, 3}, not_replayed={1}).owned[1] == ()
    # A never-replayed kept node that reads nothing inside the graph (a variable read) is
    # deferred: the rewrite takes its gradient in one final call, the model at its level.
    sched = schedule_lib.build(chain(5), {0, 3}, not_replayed={0})
    assert sched.deferred == [0] and [lv.kept for lv in sched.levels] == [(3,), ()]
    assert [lv.nodes for lv in sched.levels] == [[3], [0]]


def test_variable_gradients_are_a_spike():
    g = chain(3, param_bytes=(0, 100, 0))
    assert memory_model.plain_peak_bytes(g) >= 100


def test_held_variable_gradients_accumulate_to_the_end_of_the_pass():
    # 0 -> 1 -> 2 -> 3 (1 byte each), every node reading a 100-byte variable. Applied at once,
    # each gradient is a spike of 2 x 100 bytes (its copy-on-write copy too) above a few bytes
    # of activations; held for an optimizer that applies them together, the four gradients
    # stay: 400 bytes at the last backward step (node 0's) beside node 0's own gradient (its
    # output was freed after node 1's step, the last that read it), and no copies.
    spiky = chain(4, param_bytes=(100,) * 4)
    held = dataclasses.replace(spiky, gradients_held=True)
    assert 200 < memory_model.plain_peak_bytes(spiky) < 210
    assert memory_model.plain_peak_bytes(held) == 400 + 1
    # Every plan holds them too: recomputation cannot lower a peak the gradients set.
    assert memory_model.plan_peak_bytes(held, {1}) >= 400
    assert memory_model.variable_step_bytes(held, 2) == 100
    assert memory_model.variable_step_bytes(spiky, 2) == 2 * 100


def test_elementwise_ops_write_into_a_freed_input():
    # Nine 4-byte adds, then a 1-byte y. Without forwarding the forward pass holds an input and
    # its output (8 bytes); with it, one buffer moves down the chain (4), and in the backward
    # pass one gradient buffer moves back up beside y's output (4 + 1).
    n = 10

    def adds(**fields):
        return graph_lib.ForwardGraph(
            inputs=((),) + tuple((i - 1,) for i in range(1, n)), size_bytes=(4,) * (n - 1) + (1,),
            reads_source=(True,) + (False,) * (n - 1), feeds_sink=(False,) * (n - 1) + (True,),
            grad_reads_inputs=(False,) * n, **fields)

    assert memory_model.plain_peak_bytes(adds()) == 8
    assert memory_model.plain_peak_bytes(adds(forwards=(True,) * n)) == 5
    # An input the backward pass keeps is not written over: no saving.
    assert memory_model.plain_peak_bytes(chain(n, forwards=(True,) * n)) == \
        memory_model.plain_peak_bytes(chain(n))


def test_an_input_only_a_constant_gradient_reads_is_not_kept():
    # 0 -> 1 -> 2 (y); node 1 is "0.5 * x": its gradient reads x only for the constant's own
    # gradient, which is pruned. Node 0's output is then freed once node 1 has run.
    reads_all = chain(3)
    scaled = chain(3, unread_inputs=(frozenset(), frozenset({0}), frozenset()))
    assert scaled.gradient_reads_input(1, 0) is False
    assert scaled.gradient_reads_input(2, 1) is True
    assert memory_model.plain_peak_bytes(scaled) == memory_model.plain_peak_bytes(reads_all) - 1
