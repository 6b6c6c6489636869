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


def test_poisoned_empty_under_torch_compile_is_nan_without_an_in_place_fill():
    """Traced by torch.compile, torch.empty still reads NaN until written, and the graph holds no fill of a fresh
    buffer: on the H200 (torch 2.11) such a fill became copy_(empty, full), which inductor's functional-graph check
    rejected once the buffer went to a Triton kernel as a mutated argument (chunk_kda and the compiled decode step
    under torch.compile, 2026-11-30). The aten graph AOT autograd hands its compiler is checked."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        return torch.empty(x.shape, dtype=x.dtype) + x  # unwritten memory read: NaN in the tests

    x = torch.randn(8)
    torch._dynamo.reset()
    try:
        assert torch.isnan(torch.compile(f, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x)).all()
    finally:
        torch._dynamo.reset()
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets and not any("fill" in t or "copy" in t for t in targets), targets
