"""Fused intra + solve forward kernel (triton_intra_solve.py, triton_chunk.FWD_INTRA = "fused") on small shapes.

1. Its Gamma, Aqk, Akk and M equal the split pipeline's (`_intra_kernel` + `_solve_kernel`), and so do the later
   intermediates, in fp32 at a tight tolerance: BT = 16 / 32 / 64, T not a multiple of the chunk, varlen with a short
   sequence, safe gate with lower_bound set / unset and the exact (unbounded) gate, K = 32 and 64.
2. M is the inverse of (I + L) with L from an independent float64 transcription of kda.md 3.1 (not from a kernel).
The end-to-end check (chunk_kda outputs, final states and all gradients vs the float64 recurrence with FWD_INTRA =
"fused") is the `fwd_intra` parametrization of test_kda_triton.py. Outputs come from torch.empty, which
tests/conftest.py NaN-poisons, so an element the kernel fails to write shows up as NaN.
"""

import importlib
import importlib.util
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("the Triton kernels need the `triton` package", allow_module_level=True)

CUDA = torch.cuda.is_available()
if not CUDA:  # the fused module is not in conftest's list: import it under the interpreter too (see conftest.py)
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("k3.kernels.kda.triton_intra_solve")
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old

from k3.kernels.kda import l2norm, triton_chunk  # after the interpreter import above
from k3.kernels.kda.chunk import SUB_CHUNK

DEV = "cuda" if CUDA else "cpu"
RCP_LN2 = 1.4426950408889634


@pytest.fixture(autouse=True)
def _interpreter(triton_cpu):
    """Triton's interpreter on a CPU (conftest's triton_cpu); nothing on a CUDA machine."""
    yield


def make_inputs(B, T, H, HV, K, lb, N=None, slow=False):
    """fla recipe (kda.md 6.2) in fp32; g = logsigmoid(N(0, 1)) clamped to [lb, 0] when lb is set; h0 [N or B].
    slow: g in (-0.02, 0) instead, so the decay over a chunk stays near 1 and the far blocks of L and M (the
    higher-order merge terms, e.g. L_32 M_20) are not negligible; with the fla gates they are below 1e-9."""
    q = l2norm(torch.rand(B, T, H, K))
    k = l2norm(torch.rand(B, T, H, K))
    v = torch.rand(B, T, HV, K)
    g = F.logsigmoid(torch.randn(B, T, HV, K))
    if slow:
        g = -0.02 * torch.rand(B, T, HV, K)
    if lb is not None:
        g = g.clamp(min=lb)
    beta = torch.randn(B, T, HV).sigmoid()
    h0 = torch.randn(N or B, HV, K, K)
    return [x.to(DEV) for x in (q, k, v, g, beta, h0)]


def run_pipeline(monkeypatch, variant, xs, BT, gate, cu):
    """chunk_fwd_pipeline with FWD_INTRA = variant, for the backward (so Akk is stored too); gate: "exact",
    "safe-lb" (lower_bound -5) or "safe" (lower_bound unset: s = 2), as chunk_kda_triton derives the shift."""
    monkeypatch.setattr(triton_chunk, "FWD_INTRA", variant)
    q, k, v, g, beta, h0 = xs
    s = {"exact": None, "safe-lb": 5.0, "safe": 2.0}[gate]
    shift = None if s is None else (SUB_CHUNK - 1) * s / 2
    cu_t = None if cu is None else torch.tensor(cu, device=DEV)
    return triton_chunk.chunk_fwd_pipeline(q, k, v, g, beta, h0, scale=q.shape[-1] ** -0.5,
                                           safe_shift=shift, chunk_size=BT, cu_seqlens=cu_t, h_fp32=True,
                                           for_backward=True)


def chunk_spans(T_all, BT, cu):
    """[(first token, length)] of every chunk over the packed tokens (sequences from cu, else one of T_all)."""
    bounds = cu if cu is not None else [0, T_all]
    return [(c, min(BT, b - c)) for a, b in itertools.pairwise(bounds) for c in range(a, b, BT)]


def block_lower_mask(T_all, BT, cu):
    """[T_all, BT] bool: the entries of M that the solve writes (16 x 16 blocks on or below the diagonal)."""
    mask = torch.zeros(T_all, BT, dtype=torch.bool)
    blk = torch.arange(BT) // SUB_CHUNK
    for c0, n in chunk_spans(T_all, BT, cu):
        mask[c0 : c0 + n] = blk[None, :] <= (torch.arange(n) // SUB_CHUNK)[:, None]
    return mask


def reference_L(k, g, beta, BT, cu):
    """float64 L of kda.md 3.1 per chunk: L[i, j] = beta_i sum_d k_i[d] k_j[d] exp(Gamma_i[d] - Gamma_j[d]) for
    j < i, Gamma = chunk-local inclusive cumsum of g. k: [1, T_all, H, K] (H = 1), g: [1, T_all, HV, K],
    beta: [1, T_all, HV]. Returns [(first token, L [HV, n, n])] per chunk."""
    k, g, beta = k[0].double().cpu(), g[0].double().cpu(), beta[0].double().cpu()
    out = []
    for c0, n in chunk_spans(k.shape[0], BT, cu):
        kc = k[c0 : c0 + n, 0]  # [n, K] (one q/k head)
        G = g[c0 : c0 + n].cumsum(0).transpose(0, 1)  # [HV, n, K]
        decay = torch.exp(G[:, :, None, :] - G[:, None, :, :])  # [HV, i, j, K]; used only for j < i (<= 1)
        L = beta[c0 : c0 + n].transpose(0, 1)[:, :, None] * torch.einsum("id,jd,hijd->hij", kc, kc, decay)
        out.append((c0, torch.tril(L, diagonal=-1)))
    return out


CASES = [  # (B, T, HV, K, BT, gate, cu_seqlens, slow decay)
    (1, 45, 2, 32, 64, "safe-lb", None, False),
    (1, 64, 1, 32, 64, "exact", None, True),
    (1, 45, 1, 64, 64, "exact", None, False),
    (2, 21, 2, 32, 16, "exact", None, False),
    (1, 37, 1, 64, 16, "safe", None, False),
    (1, 70, 1, 32, 32, "safe", None, True),
    (1, 80, 2, 32, 64, "exact", [0, 5, 75, 80], False),  # a 5-token sequence, then one of 70 (partial 2nd chunk)
    # tokens 40..71 belong to no sequence: must stay unwritten (every chunk's 64 rows stay inside the tensor, so a
    # kernel that ignores n_valid writes there instead of reading out of bounds)
    (1, 72, 1, 64, 64, "safe-lb", [0, 3, 40], True),
]


def case_id(c):
    return f"B{c[0]}-T{c[1]}-HV{c[2]}-K{c[3]}-BT{c[4]}-{c[5]}" + ("-varlen" if c[6] else "") + ("-slow" if c[7] else "")


@pytest.mark.parametrize("B,T,HV,K,BT,gate,cu,slow", CASES, ids=[case_id(c) for c in CASES])
def test_fused_intermediates_equal_split(B, T, HV, K, BT, gate, cu, slow, monkeypatch):
    xs = make_inputs(B, T, 1, HV, K, None if gate == "exact" else -5.0, N=None if cu is None else len(cu) - 1,
                     slow=slow)
    split = run_pipeline(monkeypatch, "split", xs, BT, gate, cu)
    fused = run_pipeline(monkeypatch, "fused", xs, BT, gate, cu)
    assert fused["Lkk"] is None and split["Lkk"] is not None
    used = B * T if cu is None else cu[-1]  # tokens past the last sequence: never written by either variant
    mask = block_lower_mask(used, BT, cu)[:, None, :].expand(-1, HV, -1).to(DEV)
    m_f, m_s = fused["Mm"][:used][mask], split["Mm"][:used][mask]
    assert not torch.isnan(m_f).any(), "fused M: an entry on or below the block diagonal was not written"
    torch.testing.assert_close(m_f, m_s, rtol=1e-5, atol=1e-6, msg="Mm")
    for name in ("Gam", "Aqk", "Akk", "Mm", "w", "u", "vnew"):
        assert torch.isnan(fused[name][used:]).all(), f"{name}: written past the last sequence (n_valid ignored?)"
    for name in ("Gam", "Aqk", "Akk", "w", "u", "vnew", "hbuf", "ht"):
        a, b = (fused[name][:used], split[name][:used]) if name not in ("hbuf", "ht") else (fused[name], split[name])
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten)"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


INV_CASES = [(64, "safe-lb", None, True), (64, "exact", None, False), (32, "exact", [0, 5, 75, 80], True),
             (16, "safe", None, False)]


@pytest.mark.parametrize("BT,gate,cu,slow", INV_CASES, ids=[f"BT{c[0]}-{c[1]}" + ("-varlen" if c[2] else "")
                                                          + ("-slow" if c[3] else "") for c in INV_CASES])
def test_fused_M_inverts_reference_L(BT, gate, cu, slow, monkeypatch):
    """(I + L) M = I per chunk, L from the float64 kda.md 3.1 transcription above, M from the fused kernel."""
    T, HV, K = 80, 2, 32
    xs = make_inputs(1, T, 1, HV, K, None if gate == "exact" else -5.0, N=None if cu is None else len(cu) - 1,
                     slow=slow)
    Mm = run_pipeline(monkeypatch, "fused", xs, BT, gate, cu)["Mm"].double().cpu()  # [T_all, HV, BT]
    mask = block_lower_mask(T, BT, cu)
    for c0, L in reference_L(xs[1], xs[3], xs[4], BT, cu):
        n = L.shape[-1]
        M = torch.where(mask[c0 : c0 + n, None, :n], Mm[c0 : c0 + n, :, :n], 0.0).transpose(0, 1)  # [HV, n, n]
        eye = torch.eye(n, dtype=torch.float64)
        err = ((eye + L) @ M - eye).abs().max().item()
        assert err < 1e-5, f"chunk at token {c0} (n = {n}): max |(I + L) M - I| = {err:.3e}"


def test_fwd_intra_rejects_unknown_variant(monkeypatch):
    monkeypatch.setattr(triton_chunk, "FWD_INTRA", "bogus")
    with pytest.raises(ValueError, match="FWD_INTRA must be 'split' or 'fused'"):
        run_pipeline(monkeypatch, "bogus", make_inputs(1, 20, 1, 1, 32, None), 32, "exact", None)
