"""KimiDeltaAttention layer: cache continuation, gate ranges, gradients, and equality with a naive-pieces layer."""

import copy

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.kda import naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda
from k3.model.cache import KDACache
from k3.model.config import ModelConfig
from k3.model.kda import KimiDeltaAttention


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to OpenMP spin-waits on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


GATES = {"lowerbound": -5.0, "softplus": None}


def make_layer(lb, dtype=torch.float32, H=2, K=16, d=32, chunk=32):
    cfg = ModelConfig(d_model=d, kda_num_heads=H, kda_head_dim=K, kda_gate_lower_bound=lb, kda_chunk_size=chunk)
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    with torch.no_grad():  # non-trivial norm gain and conv weights so every piece matters
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.A_log.normal_(0.0, 0.5)
    return layer.to(dtype)


def rel_rms(ref, out):
    ref, out = ref.double(), out.double()
    return ((ref - out).pow(2).mean().sqrt() / (ref.pow(2).mean().sqrt() + 1e-8)).item()


def naive_layer_forward(layer, x):
    """The same layer built from independent naive pieces: nn.functional conv, explicit l2norm / gate / sigmoid,
    naive_recurrent_kda, explicit gated RMSNorm."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_k_dim
    W = layer.q_conv1d.weight.shape[-1]

    def conv(proj, conv_mod):
        y = F.conv1d(F.pad(proj(x).transpose(1, 2), (W - 1, 0)), conv_mod.weight, groups=conv_mod.weight.shape[0])
        return F.silu(y.transpose(1, 2)).view(B, T, H, K)

    q, k, v = conv(layer.q_proj, layer.q_conv1d), conv(layer.k_proj, layer.k_conv1d), conv(layer.v_proj, layer.v_conv1d)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K)
    if layer.lower_bound is None:
        g = naive_kda_gate(z, layer.A_log, layer.dt_bias)
    else:
        g = naive_kda_lowerbound_gate(z, layer.A_log, layer.dt_bias, layer.lower_bound)
    beta = torch.sigmoid(layer.b_proj(x))
    o, _ = naive_recurrent_kda(q, k, v, g, beta)
    gate = layer.g_proj(x).view(B, T, H, K)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight * torch.sigmoid(gate)
    return layer.o_proj(o.reshape(B, T, H * K))


def test_module_names_shapes_and_init():
    layer = make_layer(-5.0)
    H, K = 2, 16
    assert layer.num_heads == H
    assert layer.q_conv1d.weight.shape == (H * K, 1, 4)
    assert layer.A_log.shape == (H,) and layer.A_log.dtype == torch.float32
    assert layer.dt_bias.shape == (H * K,) and layer.dt_bias.dtype == torch.float32
    names = {n for n, _ in layer.named_parameters()}
    for n in ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias", "b_proj.weight",
              "g_proj.weight", "o_norm.weight", "o_proj.weight"]:
        assert n in names, n
    fresh = KimiDeltaAttention(ModelConfig(kda_gate_lower_bound=-5.0), 0)
    assert torch.equal(fresh.A_log, torch.zeros_like(fresh.A_log))
    dt = F.softplus(fresh.dt_bias)
    assert bool((dt >= 1e-4 * 0.999).all()) and bool((dt <= 0.1 * 1.001).all())
    soft = KimiDeltaAttention(ModelConfig(kda_gate_lower_bound=None, kda_num_heads=64), 0)
    A = soft.A_log.exp()
    assert bool((A >= 1).all()) and bool((A <= 16).all()) and A.std() > 1


@pytest.mark.parametrize("gate", list(GATES))
def test_gate_range(gate):
    lb = GATES[gate]
    layer = make_layer(lb)
    x = torch.randn(2, 30, 32) * 3
    g = layer.compute_gate(layer.gate_input(x)).detach().double()
    assert g.shape == (2, 30, 2, 16)
    if lb is None:
        assert bool((g < 0).all())
    else:
        assert bool((g > lb).all()) and bool((g < 0).all())


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_full_forward_equals_prefill_plus_decode(gate, dtype):
    layer = make_layer(GATES[gate], dtype).eval()
    x = torch.randn(2, 90, 32, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    with torch.no_grad():
        y_full = layer(x)
        cache = KDACache()
        ys = [layer(x[:, :70], cache=cache)]  # > 64 new tokens: chunk kernel with a cache
        assert cache.state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert cache.state.shape == (2, 2, 16, 16) and cache.conv_q.shape == (2, 3, 32)
        for t in range(70, 90):  # decode: recurrent kernel
            ys.append(layer(x[:, t : t + 1], cache=cache))
        y_inc = torch.cat(ys, 1)
        assert rel_rms(y_full, y_inc) < tol
        # prefill in two chunks == one, then the caches agree too
        c1, c2 = KDACache(), KDACache()
        y_one = layer(x, cache=c1)
        y_two = torch.cat([layer(x[:, :66], cache=c2), layer(x[:, 66:], cache=c2)], 1)
    assert rel_rms(y_one, y_two) < tol and rel_rms(y_full, y_one) < tol
    for f in ("state", "conv_q", "conv_k", "conv_v"):
        assert rel_rms(getattr(c1, f), getattr(c2, f)) < tol, f


@pytest.mark.parametrize("gate", list(GATES))
def test_layer_equals_naive_pieces(gate):
    layer = make_layer(GATES[gate], torch.float64).train()
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    assert rel_rms(naive_layer_forward(layer, x), layer(x)) < 1e-10
    layer.eval()
    with torch.no_grad():  # the recurrent-kernel path with an (empty) cache agrees as well
        assert rel_rms(naive_layer_forward(layer, x[:, :20]), layer(x[:, :20], cache=KDACache())) < 1e-10


def test_varlen_equals_separate_sequences():
    layer = make_layer(-5.0, torch.float64).eval()
    lens = [5, 40, 19]
    xs = [torch.randn(1, n, 32, dtype=torch.float64) for n in lens]
    cu = torch.tensor([0, 5, 45, 64])
    with torch.no_grad():
        y_packed = layer(torch.cat(xs, 1), cu_seqlens=cu)
        y_sep = torch.cat([layer(x) for x in xs], 1)
        cache = KDACache()
        layer(torch.cat(xs, 1), cache=cache, cu_seqlens=cu)
    assert rel_rms(y_sep, y_packed) < 1e-10
    assert cache.state.shape[0] == 3 and cache.conv_v.shape == (3, 3, 32)


def test_gradients_reach_every_parameter():
    for lb in GATES.values():
        layer = make_layer(lb).train()
        x = torch.randn(2, 40, 32, requires_grad=True)
        layer(x).pow(2).sum().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        assert x.grad.abs().sum() > 0


def test_cache_is_updated_in_place_and_training_uses_chunk_kernel():
    layer = make_layer(-5.0).train()
    x = torch.randn(1, 10, 32)
    cache = KDACache()
    ref = copy.deepcopy(layer).eval()
    y_train = layer(x, cache=cache)  # training mode: chunk kernel even for 10 tokens
    c2 = KDACache()
    with torch.no_grad():
        y_eval = ref(x, cache=c2)  # eval mode, 10 tokens: recurrent kernel
    assert cache.state is not None and cache.conv_k is not None
    assert rel_rms(y_eval, y_train.detach()) < 1e-5
    assert rel_rms(c2.state, cache.state.detach()) < 1e-5
