"""What the Triton KDA chunk forward keeps for its backward (kda/chunk.py's _ChunkKDATriton).

A forward that needs gradients stores Akk in its intra kernel and saves Gamma, Aqk, Akk and M, and by default also
w, v_new, the states, kg and qg (not u: the backward takes v_new = u - w h): the backward then launches only its
gradient kernels; with K3_KDA_RECOMPUTE=1 it reruns w/u and the state scan (chunk_fwd_states) first.
An inference forward (no_grad, or no input requiring grad) stores no Akk and saves nothing. Kernel launches are
counted by wrapping the module-level kernels (the launch code looks them up at call time); what is saved is read
from the autograd node and from a spy on save_for_backward. Gradients: bitwise equal to a full-recompute
backward (the forward pipeline rerun with Akk and fp32 states, then chunk_bwd_triton on its Gamma, Aqk, Akk, M);
test_kda_triton.py checks them against the float64 recurrence. CPU: Triton's interpreter (tiny shapes).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

# after the skip; conftest imported the kernel modules under the interpreter on a CPU
from k3.kernels.kda import chunk_kda, l2norm
from k3.kernels.kda.checks import SUB_CHUNK
from k3.kernels.kda.chunk import recompute_states
from k3.kernels.kda.triton import chunk_bwd as bwd_mod
from k3.kernels.kda.triton import chunk_fwd as fwd_mod
from k3.kernels.kda.triton import common as common_mod
from k3.kernels.kda.triton import launch as launch_mod

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FWD = ("_intra_sub_kernel", "_solve_kernel", "_wu_kernel", "_scan_kernel", "_output_kernel")
BWD = ("_bwd_scan_kernel", "_bwd_inter_kernel", "_bwd_intra_kernel", "_bwd_dg_kernel")
LB = -5.0  # lower bound of the safe-gate cases


pytestmark = pytest.mark.usefixtures("triton_kda_backward")  # tests/kernels/conftest.py


class _Counted:
    """A kernel whose launches `kernel[grid](...)` are logged as (name, STORE_AKK or None), then run."""

    def __init__(self, name, kernel, log):
        # __name__: common.launch_fitting keys a launch by it once any launch has fallen back to 1 stage
        # (its _UNFIT set is per process, so an earlier test on the same worker decides whether it is read)
        self.name, self.kernel, self.log, self.__name__ = name, kernel, log, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, kwargs.get("STORE_AKK")))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch):
    """The list every forward and backward kernel launch is appended to. A refused launch on record (as after an
    earlier test on the same worker fell back to 1 stage): launch_fitting then keys every launch by the kernel's
    name, which the wrappers must have (an H200 run fails without it)."""
    monkeypatch.setattr(common_mod, "_UNFIT", {("no kernel of this test",)})
    log = []
    for mod, names in ((fwd_mod, FWD), (bwd_mod, BWD)):
        for name in names:
            monkeypatch.setattr(mod, name, _Counted(name, getattr(mod, name), log))
    return log


@pytest.fixture
def saves(monkeypatch):
    """The tensors of every save_for_backward call made by _ChunkKDATriton's forward."""
    calls = []
    real = torch.autograd.function.FunctionCtx.save_for_backward

    def spy(ctx, *tensors):
        if type(ctx).__name__.startswith("_ChunkKDATriton"):
            calls.append(tensors)
        return real(ctx, *tensors)

    monkeypatch.setattr(torch.autograd.function.FunctionCtx, "save_for_backward", spy)
    return calls


def _inputs(T=40, HV=2, D=32, N=1, dtype=torch.float32):
    """q, k (L2-normalized), v, g = logsigmoid (>= LB after the clamp), beta, h0 on DEV."""
    q, k = l2norm(torch.rand(1, T, 1, D)), l2norm(torch.rand(1, T, 1, D))
    v = torch.rand(1, T, HV, D)
    g = F.logsigmoid(torch.randn(1, T, HV, D)).clamp_min(LB)
    beta = torch.randn(1, T, HV).sigmoid()
    h0 = torch.randn(N, HV, D, D)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [g.to(DEV), beta.to(DEV, dtype), h0.to(DEV)]


def _run(xs, *, BT=32, safe=True, cu=None):
    return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=BT, safe_gate=safe,
                     lower_bound=LB if safe else None, cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))


def _forward_launches(store_akk, HV=2, D=32):
    """The kernels a forward of _inputs' shapes launches, in order: the output kernel only when the scan does not
    compute the output itself (launch.fuse_output; test_kda_fused_output.py tests both paths)."""
    fused = launch_mod.fuse_output(1, HV, D, D, torch.device(DEV))
    return [("_intra_sub_kernel", store_akk), ("_solve_kernel", None), ("_wu_kernel", None), ("_scan_kernel", None),
            *([] if fused else [("_output_kernel", None)])]


def _kda_node(o):
    """The _ChunkKDATriton node of o's autograd graph."""
    todo, seen = [o.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("_ChunkKDATriton"):
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError("no _ChunkKDATriton node in the graph of o")


@pytest.mark.parametrize("recompute", ["0", "1"], ids=["keep-states", "recompute"])
def test_training_forward_saves_gamma_aqk_akk_m_and_backward_skips_intra_and_solve(monkeypatch, launches, saves,
                                                                                   recompute, kernel_env):
    """K3_KDA_RECOMPUTE=0 (the default): the forward also keeps w, v_new, the states entering each chunk, kg and
    qg, and the backward launches only its four gradient kernels; =1: the backward reruns w/u and the scan first."""
    kernel_env(K3_KDA_RECOMPUTE=recompute)
    T, HV, D, BT = 40, 2, 32, 32
    xs = [x.requires_grad_() for x in _inputs(T, HV, D)]
    o, s = _run(xs, BT=BT)
    assert launches == _forward_launches(True)
    keep = recompute == "0" and launch_mod.fuse_output(1, HV, D, D, torch.device(DEV))
    assert len(saves) == 1 and len(saves[0]) == (14 if keep else 9)
    saved = _kda_node(o).saved_tensors
    q, k, v, beta, h0, Gam, Aqk, Akk, Mm = saved[:9]
    assert [x.shape for x in (q, k, v, beta, h0)] == [xs[i].shape for i in (0, 1, 2, 4, 5)]
    assert Gam.shape == (T, HV, D) and Gam.dtype == torch.float32
    assert Aqk.shape == Akk.shape == Mm.shape == (T, HV, BT)
    assert (Aqk.dtype, Akk.dtype, Mm.dtype) == (q.dtype, torch.float32, q.dtype)
    assert not any(x is not None and x.data_ptr() == xs[3].data_ptr() for x in saved), "g is kept alive"
    lower = torch.arange(BT)[None, :] // SUB_CHUNK <= torch.arange(T)[:, None] % BT // SUB_CHUNK  # blocks j <= i
    assert torch.isfinite(Akk[lower[:, None, :].expand(-1, HV, -1).to(Akk.device)]).all(), \
        "Akk not written by the forward's intra kernel (NaN-poisoned empty)"
    if keep:
        w, vnew, hbuf, kg, qg = saved[9:]
        NT = -(-T // BT)
        assert [x.shape for x in (w, vnew, kg, qg)] == [(T, HV, D)] * 4 and hbuf.shape == (NT, HV, D, D)
        for name, x in zip(("w", "vnew", "hbuf", "kg", "qg"), saved[9:], strict=True):
            assert x.dtype == q.dtype and torch.isfinite(x).all(), f"{name} not written by the forward"
        assert torch.equal(hbuf[0], h0[0]), "the state entering the first chunk is h0"
    launches.clear()
    torch.autograd.grad((o.sum() + s.sum()), xs)
    recomputed = [] if keep else [("_wu_kernel", None), ("_scan_kernel", None)]
    assert launches == [*recomputed, ("_bwd_scan_kernel", None), ("_bwd_inter_kernel", None),
                        ("_bwd_intra_kernel", None), ("_bwd_dg_kernel", None)]


def test_recompute_setting_rejects_unknown_values(monkeypatch, kernel_env):
    kernel_env(K3_KDA_RECOMPUTE="sometimes")
    xs = [x.requires_grad_() for x in _inputs()]
    with pytest.raises(ValueError, match="K3_KDA_RECOMPUTE must be 0 .* or 1"):
        _run(xs)


@pytest.mark.parametrize("mode", ["no_grad", "no_input_requires_grad"])
def test_inference_forward_stores_no_akk_and_saves_nothing(launches, saves, mode):
    xs = _inputs()
    if mode == "no_grad":
        xs = [x.requires_grad_() for x in xs]
        with torch.no_grad():
            o, s = _run(xs)
    else:
        o, s = _run(xs)
    assert o.grad_fn is None
    assert launches == _forward_launches(False)
    assert saves == []
    # storing Akk changes no output beyond rounding: the training solve applies beta to its row sums, the inference
    # intra kernel to L's entries (solve._times_beta), the same products in another order
    o_train, s_train = _run([x.detach().requires_grad_() for x in xs])
    torch.testing.assert_close(o, o_train.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_train.detach(), rtol=1e-5, atol=1e-6)


def test_torch_backward_keeps_g_and_no_triton_intermediates(monkeypatch, launches, saves, kernel_env):
    kernel_env(K3_KDA_BWD="torch")
    xs = [x.requires_grad_() for x in _inputs()]
    o, s = _run(xs)
    assert launches[0] == ("_intra_sub_kernel", False)
    assert len(saves) == 1 and len(saves[0]) == 6
    assert saves[0][3].data_ptr() == xs[3].data_ptr()  # g itself, for the PyTorch recompute
    launches.clear()
    grads = torch.autograd.grad(o.sum() + s.sum(), xs)
    assert launches == [] and all(torch.isfinite(d).all() for d in grads)


def _old_full_recompute(xs, do, dht, *, BT, safe, cu):
    """The full-recompute backward: rerun the whole forward pipeline (Akk stored, fp32 states), then the gradient
    kernels on its Gamma, Aqk, Akk and M."""
    q, k, v, g, beta, h0 = (x.detach() for x in xs)
    beta = beta.float()
    K = q.shape[-1]
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    shift = (SUB_CHUNK - 1) * -LB / 2 if safe else None  # chunk_kda_triton's safe_shift for lower_bound LB
    r = fwd_mod.chunk_fwd_pipeline(q, k, v, g, beta, h0, scale=K**-0.5, safe_shift=shift, chunk_size=BT,
                                   cu_seqlens=cu_t, h_fp32=True, store_akk=True)
    states = recompute_states(q, k, v, beta, h0, r["Gam"], r["Mm"], scale=K**-0.5, chunk_size=BT, cu_seqlens=cu_t)
    return bwd_mod.chunk_bwd_triton(q, k, v, beta, h0, r["Gam"], r["Aqk"], r["Akk"], r["Mm"], do, dht,
                                    scale=K**-0.5, safe_shift=shift, chunk_size=BT, cu_seqlens=cu_t, states=states)


@pytest.mark.parametrize("recompute", ["0", "1"], ids=["keep-states", "recompute"])
@pytest.mark.parametrize("safe,cu", [(True, None), (False, None), (True, [0, 9, 9, 40])],
                         ids=["safe", "exact", "varlen"])
def test_gradients_equal_the_full_recompute_backward(monkeypatch, safe, cu, recompute, kernel_env):
    kernel_env(K3_KDA_RECOMPUTE=recompute)
    xs = [x.requires_grad_() for x in _inputs(N=1 if cu is None else len(cu) - 1)]
    o, s = _run(xs, safe=safe, cu=cu)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    new = torch.autograd.grad((o * do).sum() + (s * dht).sum(), xs)
    old = _old_full_recompute(xs, do, dht, BT=32, safe=safe, cu=cu)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), new, old, strict=True):
        assert torch.equal(a, b.to(a.dtype)), f"{name} differs from the full-recompute backward"


def test_backward_dot_precisions_for_bf16_inputs(monkeypatch):
    """The dot precision each backward kernel is launched with for bf16 inputs: the intra kernel's diagonal blocks
    HALF_INPUT_PRECISION (bf16x3, kda.md 3.3), whatever the inter kernel's LAUNCH["bwd_inter"]["PREC"] (bf16); the
    other dots their LAUNCH entries (the launch code keeps the two in separate variables: one overwriting the other
    would go unnoticed by the accuracy tests). The kernels are replaced by recorders, so the backward runs on
    fabricated bf16 tensors anywhere; under the interpreter the precisions are its stand-ins (_interpreted)."""
    seen = {}

    def record(name):
        return type("Rec", (), {"__name__": name, "__getitem__": lambda _, grid: (
            lambda *a, **kw: seen.setdefault(name, (kw.get("PREC"), kw.get("OFF"))))})()

    for name in ("_bwd_scan_kernel", "_bwd_inter_kernel", "_bwd_intra_kernel", "_bwd_dg_kernel"):
        monkeypatch.setattr(bwd_mod, name, record(name))
    B, T, H, K, BT = 1, 64, 1, 32, 64
    bf = torch.bfloat16
    q, k, v, do = (torch.randn(B, T, H, K, dtype=bf) for _ in range(4))
    beta = torch.rand(B, T, H)
    Gam, Akk = torch.zeros(T, H, K), torch.zeros(T, H, BT)
    Aqk, Mm = torch.zeros(T, H, BT, dtype=bf), torch.zeros(T, H, BT, dtype=bf)
    states = (torch.zeros(T, H, K, dtype=bf), torch.zeros(T, H, K, dtype=bf), torch.zeros(1, H, K, K, dtype=bf),
              torch.zeros(T, H, K, dtype=bf), torch.zeros(T, H, K, dtype=bf))
    bwd_mod.chunk_bwd_triton(q, k, v, beta, None, Gam, Aqk, Akk, Mm, do, None, scale=K**-0.5, safe_shift=1.0,
                             chunk_size=BT, cu_seqlens=None, states=states)
    want = launch_mod.interpreted
    assert seen["_bwd_intra_kernel"] == (want(launch_mod.HALF_INPUT_PRECISION),
                                         launch_mod.dot_prec("bwd_intra", bf))
    assert seen["_bwd_inter_kernel"][0] == seen["_bwd_scan_kernel"][0] == launch_mod.dot_prec("bwd_inter", bf)
    assert launch_mod.dot_prec("bwd_inter", bf) != want(launch_mod.HALF_INPUT_PRECISION)  # distinguishable
