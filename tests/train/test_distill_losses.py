"""k3.train.distill_losses against float64 references written from the formulas (closed-form gradients, or central
differences of a naive numpy evaluation), on a tiny vocabulary."""

import math

import numpy as np
import pytest
import torch

from k3.train.distill_losses import LOSSES, distill_loss, jsd, token_reverse_kl

V, N = 7, 6


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (N,), generator=g)
    mask = torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.bool)
    return zs, zt, tokens, mask


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _naive(kind, zs, zt, tokens, mask, beta=0.5):
    """The loss of one (student logits, teacher logits) pair, summed by hand over rows and vocabulary."""
    total, count = 0.0, 0
    for i in range(zs.shape[0]):
        if not mask[i]:
            continue
        p, q = _softmax(zs[i]), _softmax(zt[i])
        if kind == "reverse_kl":
            v = sum(p[j] * math.log(p[j] / q[j]) for j in range(len(p)))
        elif kind == "forward_kl":
            v = sum(q[j] * math.log(q[j] / p[j]) for j in range(len(p)))
        else:  # jsd
            m = [beta * q[j] + (1 - beta) * p[j] for j in range(len(p))]
            v = (beta * sum(q[j] * math.log(q[j] / m[j]) for j in range(len(p)))
                 + (1 - beta) * sum(p[j] * math.log(p[j] / m[j]) for j in range(len(p))))
        total, count = total + v, count + 1
    return total / count


def _numeric_grad(kind, zs, zt, tokens, mask, beta=0.5, h=1e-6):
    zs = zs.numpy().copy()
    g = np.zeros_like(zs)
    for i in range(zs.shape[0]):
        for j in range(zs.shape[1]):
            zs[i, j] += h
            up = _naive(kind, zs, zt.numpy(), tokens, mask.numpy(), beta)
            zs[i, j] -= 2 * h
            dn = _naive(kind, zs, zt.numpy(), tokens, mask.numpy(), beta)
            zs[i, j] += h
            g[i, j] = (up - dn) / (2 * h)
    return torch.from_numpy(g)


def _grad(kind, zs, zt, tokens, mask, beta=0.5):
    z = zs.clone().requires_grad_(True)
    loss = distill_loss(kind, z, torch.log_softmax(zt, -1), tokens, mask, beta)
    loss.backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("kind", LOSSES)
def test_teacher_equal_to_student_gives_zero_loss_and_zero_gradient(kind):
    zs, _, tokens, mask = _case(1)
    loss, grad = _grad(kind, zs, zs, tokens, mask)
    assert abs(float(loss)) < 1e-12
    assert grad.abs().max() < 1e-12


def test_reverse_kl_value_and_gradient_equal_the_closed_form():
    zs, zt, tokens, mask = _case(2)
    loss, grad = _grad("reverse_kl", zs, zt, tokens, mask)
    assert float(loss) == pytest.approx(_naive("reverse_kl", zs.numpy(), zt.numpy(), tokens, mask.numpy()), abs=1e-12)
    p, q = zs.softmax(-1), zt.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1, keepdim=True)
    ref = p * (p.log() - q.log() - kl) * mask[:, None] / mask.sum()  # d KL(p || q) / d z_j
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-12)


def test_forward_kl_gradient_is_student_minus_teacher():
    zs, zt, tokens, mask = _case(3)
    loss, grad = _grad("forward_kl", zs, zt, tokens, mask)
    assert float(loss) == pytest.approx(_naive("forward_kl", zs.numpy(), zt.numpy(), tokens, mask.numpy()), abs=1e-12)
    ref = (zs.softmax(-1) - zt.softmax(-1)) * mask[:, None] / mask.sum()
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_value_and_gradient_equal_central_differences(beta):
    zs, zt, tokens, mask = _case(4)
    loss, grad = _grad("jsd", zs, zt, tokens, mask, beta)
    assert float(loss) == pytest.approx(_naive("jsd", zs.numpy(), zt.numpy(), tokens, mask.numpy(), beta), abs=1e-12)
    torch.testing.assert_close(grad, _numeric_grad("jsd", zs, zt, tokens, mask, beta), rtol=0, atol=1e-8)


def test_sampled_reverse_kl_gradient_is_the_log_ratio_times_the_score():
    zs, zt, tokens, mask = _case(5)
    _, grad = _grad("sampled_reverse_kl", zs, zt, tokens, mask)
    p, q = zs.softmax(-1), zt.softmax(-1)
    onehot = torch.nn.functional.one_hot(tokens, V).double()
    ratio = (p.gather(-1, tokens[:, None]) / q.gather(-1, tokens[:, None])).log()  # [N, 1]
    ref = ratio * (onehot - p) * mask[:, None] / mask.sum()  # advantage x d log p_s(x) / d z
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-12)


def test_sampled_reverse_kl_gradient_averaged_over_the_student_is_the_full_reverse_kl_gradient():
    # sum_x p_s(x) grad[(log p_s(x) - log p_t(x)) log p_s(x)] = grad KL(s || t): the estimator is unbiased
    zs, zt, _, _ = _case(6)
    zs, zt = zs[:1], zt[:1]
    mask = torch.ones(1, dtype=torch.bool)
    p = zs.softmax(-1)[0]
    expected = sum(p[x] * _grad("sampled_reverse_kl", zs, zt, torch.tensor([x]), mask)[1] for x in range(V))
    _, full = _grad("reverse_kl", zs, zt, torch.tensor([0]), mask)
    torch.testing.assert_close(expected, full, rtol=0, atol=1e-12)


def test_jsd_reduces_to_forward_and_reverse_kl_at_its_limits():
    zs, zt, tokens, mask = _case(7)
    lt = torch.log_softmax(zt, -1)
    fwd = distill_loss("forward_kl", zs, lt, tokens, mask)
    rev = distill_loss("reverse_kl", zs, lt, tokens, mask)
    assert float(jsd(zs, lt, tokens, mask, 0.0)) == float(fwd)
    assert float(jsd(zs, lt, tokens, mask, 1.0)) == float(rev)
    eps = 1e-7
    assert float(jsd(zs, lt, tokens, mask, eps)) / eps == pytest.approx(float(fwd), rel=1e-5)
    assert float(jsd(zs, lt, tokens, mask, 1 - eps)) / eps == pytest.approx(float(rev), rel=1e-5)


def test_jsd_at_one_half_is_symmetric():
    zs, zt, tokens, mask = _case(8)
    a = jsd(zs, torch.log_softmax(zt, -1), tokens, mask, 0.5)
    b = jsd(zt, torch.log_softmax(zs, -1), tokens, mask, 0.5)
    assert float(a) == pytest.approx(float(b), abs=1e-14)
    assert float(a) > 0


def test_masked_positions_change_nothing():
    zs, zt, tokens, mask = _case(9)
    zs2 = zs.clone()
    zs2[~mask] = 100.0  # masked rows may hold anything
    for kind in LOSSES:
        a = distill_loss(kind, zs, torch.log_softmax(zt, -1), tokens, mask)
        b = distill_loss(kind, zs2, torch.log_softmax(zt, -1), tokens, mask)
        assert float(a) == float(b), kind


def test_token_reverse_kl_is_nonnegative_and_errors_name_the_key():
    zs, zt, _, _ = _case(10)
    assert (token_reverse_kl(zs, torch.log_softmax(zt, -1)) >= 0).all()
    with pytest.raises(ValueError, match="distill.loss"):
        distill_loss("kl", zs, zt, torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.bool))
    with pytest.raises(ValueError, match="distill.beta"):
        jsd(zs, zt, torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.bool), 1.5)
