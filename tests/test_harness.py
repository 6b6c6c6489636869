"""The shared test setup itself (conftest.py): the NaN-poisoned torch.empty."""

import torch


def test_poisoned_empty_fills_nan_and_allows_leaves_that_require_grad():
    """Every float allocation reads NaN until written, including a leaf created with requires_grad=True (inductor
    allocates such leaves while setting up its pattern passes under torch.compile; an in-place fill of one under
    autograd raised "a leaf Variable that requires grad is being used in an in-place operation", H200 2026-11-30)."""
    t = torch.empty(3, 4)
    assert torch.isnan(t).all()
    leaf = torch.empty(4, 4, requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf and leaf.grad_fn is None and torch.isnan(leaf).all()
    assert torch.empty(3, dtype=torch.int64).dtype == torch.int64  # integers are left as allocated


def test_poisoned_empty_is_the_real_allocation_under_torch_compile():
    """Traced by torch.compile, torch.empty adds no NaN fill to the graph: the fill's copy_ into a fresh buffer,
    handed to a Triton kernel as a mutated argument, failed inductor's functional-graph check (chunk_kda under
    torch.compile, H200 2026-11-30). The aten graph AOT autograd hands its compiler holds the allocation and the
    caller's own ops only."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = torch.empty(x.shape, dtype=x.dtype)
        y.copy_(x)
        return y * 2

    x = torch.randn(8)
    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(f, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x), x * 2)
    finally:
        torch._dynamo.reset()
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("empty" in t for t in targets), targets
    assert not any("fill" in t or "full" in t for t in targets), targets
