"""The memory model and the rewrite run the same schedule (docs/design.md, note "plan and
schedule"): on every graph of the catalogue, the nodes each level recomputes in the model's
replay are exactly the ops the rewrite copies, level by level, in the same order, nested levels
included. Both read the levels from ``core.schedule``, but each decides for itself which kept
nodes a gradient reached (the model from its bytes ledger, the rewrite from the gradients
TensorFlow returned), and the rewrite maps nodes to ops and copies of copies: a drift in either
shows up here. The segments themselves come from one walk; that the copies it makes really
recompute (read copies and boundaries, not the forward pass) is checked on the TF graph."""

import pytest

from memsave_grads import api
from memsave_grads._tf import rewrite
from memsave_grads.core import memory_model
from memsave_grads.core import multilevel
from memsave_grads.core import schedule as schedule_lib
from graphs import BUILDERS


def _rewrite_trace(prepared, plan, monkeypatch) -> list[list[int]]:
    """The node numbers of the forward ops each copy_ops call of the rewrite copies."""
    node_of = {op: i for i, op in enumerate(prepared.region)}
    calls = []
    original = rewrite.copy_ops

    region = set(prepared.region)

    def spy(ops, *args, **kwargs):
        copies = original(ops, *args, **kwargs)
        copied = set(ops)
        for op, copy in copies.items():
            if op in node_of:  # a copy (at any depth) stands for its original's node
                node_of[copy] = node_of[op]
            # The copies really recompute: they read boundaries, copies and tensors from
            # outside the region, never a forward op of the region or what this call copies.
            for t in copy.inputs:
                assert t.op not in region and t.op not in copied, \
                    f"copy {copy.name} reads {t.name}, which should have been copied or kept"
        nodes = sorted(node_of[op] for op in ops if op in node_of)
        if nodes:
            calls.append(nodes)
        return copies

    monkeypatch.setattr(rewrite, "copy_ops", spy)
    api.run_plan(prepared, plan)
    return calls


def _plans(prepared):
    ctx = prepared.selection
    yield "selected", prepared.plan
    candidates, must_keep, not_replayed = ctx.node_sets()
    nested = multilevel.balanced_plan(ctx.model, must_keep, candidates, 2, not_replayed)
    if nested.levels == 2:
        yield "nested", nested


@pytest.mark.parametrize("strategy", ["memory", "speed", "collection"])
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_model_and_rewrite_recompute_the_same_segments(builder, strategy, graph, monkeypatch):
    case = BUILDERS[builder]()
    prepared = api.prepare(case.ys, case.xs, case.grad_ys, strategy,
                           dict(case.kwargs))
    model = prepared.selection.model
    for name, plan in _plans(prepared):
        model_trace: list = []
        memory_model.replay(model, schedule_lib.of_plan(model, plan), trace=model_trace)
        with graph.as_default():
            rewrite_trace = _rewrite_trace(prepared, plan, monkeypatch)
        assert rewrite_trace == model_trace, f"{builder}, {strategy}, {name} plan"
        assert rewrite_trace, f"{builder}, {strategy}, {name} plan: nothing recomputed"
