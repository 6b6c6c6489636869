"""Causal depthwise short conv vs a float64 loop reference: outputs, tails, continuation, varlen, gradients."""

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.conv import causal_conv1d, short_conv


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to OpenMP spin-waits on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def loop_reference(x, weight, tail, activation):
    """y[t, c] = act(sum_w weight[c, w] * x_ext[t + w, c]) over x_ext = [tail ; x], float64 loops; final tail."""
    x, weight = x.double(), weight.double()
    B, T, C = x.shape
    W = weight.shape[1]
    ext = torch.cat([tail.double() if tail is not None else torch.zeros(B, W - 1, C, dtype=torch.float64), x], 1)
    y = torch.zeros(B, T, C, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for w in range(W):
                y[b, t] += weight[:, w] * ext[b, t + w]
    if activation == "silu":
        y = F.silu(y)
    return y, ext[:, ext.shape[1] - (W - 1) :]


@pytest.mark.parametrize("B,T,C,W", [(2, 9, 5, 4), (1, 2, 3, 4), (3, 7, 4, 1), (1, 5, 6, 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_tail", [False, True])
def test_conv_matches_loop(B, T, C, W, activation, with_tail):
    x, weight = torch.randn(B, T, C), torch.randn(C, W)
    tail = torch.randn(B, W - 1, C) if with_tail else None
    y, final = causal_conv1d(x, weight, activation=activation, initial_tail=tail, output_final_tail=True)
    y_ref, final_ref = loop_reference(x, weight, tail, activation)
    assert y.dtype == x.dtype and final.shape == (B, W - 1, C)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), final_ref)  # T < W-1 reaches back into the initial tail


def test_matches_nn_conv1d_and_alias():
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, bias=False)
    x = torch.randn(2, 11, 6)
    y_ref = F.silu(conv(F.pad(x.transpose(1, 2), (3, 0)))).transpose(1, 2)
    y, final = short_conv(x, conv.weight[:, 0])
    assert final is None
    torch.testing.assert_close(y, y_ref)


def test_two_calls_equal_one():
    x, weight = torch.randn(2, 13, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    y_full, t_full = causal_conv1d(x, weight, output_final_tail=True)
    for split in (1, 2, 7):
        y1, t1 = causal_conv1d(x[:, :split], weight, output_final_tail=True)
        y2, t2 = causal_conv1d(x[:, split:], weight, initial_tail=t1, output_final_tail=True)
        torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=0, atol=1e-14)
        torch.testing.assert_close(t2, t_full, rtol=0, atol=0)


def test_varlen_resets_at_boundaries():
    cu = torch.tensor([0, 2, 2, 9, 14])  # includes an empty sequence and one shorter than W-1
    N, T, C, W = 4, 14, 5, 4
    x, weight = torch.randn(1, T, C, dtype=torch.float64), torch.randn(C, W, dtype=torch.float64)
    tails = torch.randn(N, W - 1, C, dtype=torch.float64)
    x.requires_grad_()
    y, final = causal_conv1d(x, weight, initial_tail=tails, output_final_tail=True, cu_seqlens=cu)
    ys, finals = [], []
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        y_n, f_n = loop_reference(x[:, a:b].detach(), weight, tails[n : n + 1], "silu")
        ys.append(y_n)
        finals.append(f_n)
    torch.testing.assert_close(y, torch.cat(ys, 1), rtol=0, atol=1e-12)
    torch.testing.assert_close(final, torch.cat(finals), rtol=0, atol=0)
    # gradient of the varlen path equals the gradient of per-sequence calls
    (y * torch.arange(T * C, dtype=torch.float64).view(1, T, C)).sum().backward()
    g_var = x.grad.clone()
    x.grad = None
    parts = [causal_conv1d(x[:, int(cu[n]) : int(cu[n + 1])], weight, initial_tail=tails[n : n + 1])[0]
             for n in range(N)]
    (torch.cat(parts, 1) * torch.arange(T * C, dtype=torch.float64).view(1, T, C)).sum().backward()
    torch.testing.assert_close(g_var, x.grad)


def test_conv_validation():
    x, weight = torch.randn(2, 5, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="initial_tail must be"):
        causal_conv1d(x, weight, initial_tail=torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="cu_seqlens requires B == 1"):
        causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="gelu")
