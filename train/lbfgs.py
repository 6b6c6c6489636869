"""Batched L-BFGS: many independent minimisations in lockstep, each following scipy L-BFGS-B's own path.

Used by `k3 scaling-fit` for the 4500-start grid (train/scaling.py). Every start keeps its own history and runs its
own Moré-Thuente line search (the search scipy uses, J. J. Moré and D. J. Thuente, ACM TOMS 20(3), 1994), so the
starts never couple through a shared step; `fun(x_SK, rows)` evaluates the objective and gradient of the rows
still running.

Legend: S starts, K parameters, M history pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

STATUS = {0: "running", 1: "gtol", 2: "ftol", 3: "max_iter", 4: "line search failed"}

# batched L-BFGS (numpy: the per-start bookkeeping is many small-array operations, cheaper in numpy than in torch)


@dataclass
class LBFGSResult:
    """Per-start outcome of `lbfgs_batched` (numpy arrays, [S] or [S, K])."""

    x_SK: np.ndarray
    f_S: np.ndarray
    status_S: np.ndarray  # codes in STATUS; 1 and 2 are converged (scipy's CONVERGENCE messages)
    n_iter_S: np.ndarray

    @property
    def converged_S(self) -> np.ndarray:
        return (self.status_S == 1) | (self.status_S == 2)


def _two_loop(g_SK, s_SMK, y_SMK, rho_SM, gamma_S):
    """L-BFGS two-loop recursion (Nocedal & Wright 2006, alg. 7.4) per start: returns H g, [S, K].

    The newest pair is at index M-1; an entry with rho = 0 is an empty slot and changes nothing."""
    q = g_SK.copy()
    M = rho_SM.shape[1]
    alphas = [None] * M
    with np.errstate(all="ignore"):  # a breakdown gives NaN or an ascent direction; the caller restarts from -g
        for j in range(M - 1, -1, -1):
            alphas[j] = rho_SM[:, j] * np.einsum("sk,sk->s", s_SMK[:, j], q)
            q -= alphas[j][:, None] * y_SMK[:, j]
        r = gamma_S[:, None] * q
        for j in range(M):
            beta = rho_SM[:, j] * np.einsum("sk,sk->s", y_SMK[:, j], r)
            r += s_SMK[:, j] * (alphas[j] - beta)[:, None]
    return r


def _cubic_min(s1, f1, d1, s2, f2, d2):
    """Minimiser of the cubic through (s1, f1, f'=d1), (s2, f2, f'=d2) (Moré & Thuente 1994, section 4), elementwise.

    Also returns gamma and the ratio r (the secant/cubic choice of `_mt_step` needs them)."""
    theta = 3.0 * (f1 - f2) / (s2 - s1) + d1 + d2
    s = np.maximum(np.maximum(np.abs(theta), np.abs(d1)), np.abs(d2))
    gamma = s * np.sqrt(np.maximum((theta / s) ** 2 - (d1 / s) * (d2 / s), 0.0))
    gamma = np.where(s2 < s1, -gamma, gamma)
    r = ((gamma - d1) + theta) / (((gamma - d1) + gamma) + d2)
    return s1 + r * (s2 - s1), gamma, r


def _mt_step(stx, fx, dx, sty, fy, dy, stp, fp, dp, brackt, lo, hi):
    """One safeguarded Moré–Thuente step (ACM TOMS 20(3) 1994; MINPACK-2 `dcstep`), elementwise over starts.

    [stx, sty] brackets a minimiser once `brackt`; stx is the best step, stp the newest. Returns the updated
    (stx, fx, dx, sty, fy, dy), the next trial step and brackt."""
    opposite = np.sign(dp) * np.sign(dx) < 0
    case1 = fp > fx  # higher value: the minimiser lies between stx and stp
    case2 = ~case1 & opposite  # derivative changed sign: bracketed
    case3 = ~case1 & ~opposite & (np.abs(dp) < np.abs(dx))  # derivative shrinks: extrapolate carefully
    # case 1: the cubic step, or the mean of cubic and quadratic steps when the cubic one is farther from stx
    c1, _, _ = _cubic_min(stx, fx, dx, stp, fp, dp)
    q1 = stx + (dx / ((fx - fp) / (stp - stx) + dx)) / 2.0 * (stp - stx)
    f1 = np.where(np.abs(c1 - stx) < np.abs(q1 - stx), c1, c1 + (q1 - c1) / 2.0)
    # cases 2 and 3: cubic from stp's side, or the secant step on the derivative
    c2, gam, r = _cubic_min(stp, fp, dp, stx, fx, dx)
    sec = stp + (dp / (dp - dx)) * (stx - stp)
    f2 = np.where(np.abs(c2 - stp) > np.abs(sec - stp), c2, sec)
    c3 = np.where((r < 0) & (gam != 0), c2, np.where(stp > stx, hi, lo))
    f3_b = np.where(np.abs(c3 - stp) < np.abs(sec - stp), c3, sec)
    f3_b = np.where(stp > stx, np.minimum(stp + 0.66 * (sty - stp), f3_b), np.maximum(stp + 0.66 * (sty - stp), f3_b))
    f3_u = np.clip(np.where(np.abs(c3 - stp) > np.abs(sec - stp), c3, sec), lo, hi)
    f3 = np.where(brackt, f3_b, f3_u)
    # case 4: cubic with the far end sty if bracketed, else the step bound
    c4, _, _ = _cubic_min(stp, fp, dp, sty, fy, dy)
    f4 = np.where(brackt, c4, np.where(stp > stx, hi, lo))
    new = np.where(case1, f1, np.where(case2, f2, np.where(case3, f3, f4)))
    brackt = brackt | case1 | case2
    move_y = case1 | opposite  # case 1: stp becomes sty; otherwise stx moves to stp (old stx to sty if opposite)
    sty, fy, dy = (np.where(move_y, np.where(case1, a, b), c) for a, b, c in ((stp, stx, sty), (fp, fx, fy),
                                                                              (dp, dx, dy)))
    stx, fx, dx = (np.where(case1, a, b) for a, b in ((stx, stp), (fx, fp), (dx, dp)))
    return stx, fx, dx, sty, fy, dy, new, brackt


def _line_search(fun, rows, x_SK, f_S, d_SK, dg_S, stp, max_ls, c1=1e-3, c2=0.9, xtol=0.1, stpmax=1e10):
    """Moré–Thuente line search (MINPACK-2 `dcsrch`, as L-BFGS-B calls it) run independently for every start.

    Returns ok_S and x_SK, f_S, g_SK at the last evaluated step: L-BFGS-B accepts that point when the search
    converged or stopped on a rounding/xtol warning; not ok after max_ls evaluations without either."""
    S = len(f_S)
    gtest = c1 * dg_S
    z = np.zeros(S)
    # per start: stx/fx/gx best step so far, sty/fy/gy other end, interval [stmin, stmax], widths, flags
    st = {"stx": z, "fx": f_S, "gx": dg_S, "sty": z, "fy": f_S, "gy": dg_S, "stmin": z, "stmax": 5.0 * stp,
          "width": z + stpmax, "width1": z + 2 * stpmax, "stp": stp, "brackt": z > 0, "stage2": z > 0}
    st = {k: v.copy() for k, v in st.items()}
    ok, x_out, f_out, g_out = np.zeros(S, dtype=bool), x_SK.copy(), f_S.copy(), np.zeros_like(x_SK)
    p = np.arange(S)  # searches still running
    with np.errstate(all="ignore"):  # the unused branches of _mt_step may divide by zero
        for _ in range(max_ls):
            if p.size == 0:
                break
            sp = st["stp"][p]
            xt = x_SK[p] + sp[:, None] * d_SK[p]
            ft, gt = fun(xt, rows[p])
            dgt = np.einsum("sk,sk->s", gt, d_SK[p])
            x_out[p], f_out[p], g_out[p] = xt, ft, gt
            ftest = f_S[p] + sp * gtest[p]
            stage2 = st["stage2"][p] | ((ft <= ftest) & (dgt >= 0))
            br, mn, mx = st["brackt"][p], st["stmin"][p], st["stmax"][p]
            end = br & ((sp <= mn) | (sp >= mx) | (mx - mn <= xtol * mx))  # rounding errors / interval below xtol
            end |= (sp == stpmax) & (ft <= ftest) & (dgt <= gtest[p])
            end |= (sp == 0) & ((ft > ftest) | (dgt >= gtest[p]))
            end |= (ft <= ftest) & (np.abs(dgt) <= -c2 * dg_S[p])  # strong Wolfe conditions: converged
            end |= ~np.isfinite(ft)  # non-finite value: end as a failure, L-BFGS refreshes or stops
            ok[p] = end & np.isfinite(ft)
            # stage 1 with a lower but not sufficiently lower value: step on psi(t) = f(t) - f0 - c1 t f'(0)
            shift = np.where(~stage2 & (ft <= st["fx"][p]) & (ft > ftest), gtest[p], 0.0)
            stx, sty = st["stx"][p], st["sty"][p]
            nx, nfx, ngx, ny, nfy, ngy, nstp, nbr = _mt_step(
                stx, st["fx"][p] - stx * shift, st["gx"][p] - shift, sty, st["fy"][p] - sty * shift,
                st["gy"][p] - shift, sp, ft - sp * shift, dgt - shift, br, mn, mx)
            nfx, ngx, nfy, ngy = nfx + nx * shift, ngx + shift, nfy + ny * shift, ngy + shift
            wd, wd1 = st["width"][p], st["width1"][p]
            nstp = np.where(nbr & (np.abs(ny - nx) >= 0.66 * wd1), nx + 0.5 * (ny - nx), nstp)  # force bisection
            wd1, wd = np.where(nbr, wd, wd1), np.where(nbr, np.abs(ny - nx), wd)
            mn = np.where(nbr, np.minimum(nx, ny), nstp + 1.1 * (nstp - nx))
            mx = np.where(nbr, np.maximum(nx, ny), nstp + 4.0 * (nstp - nx))
            nstp = np.clip(nstp, 0.0, stpmax)
            nstp = np.where(nbr & ((nstp <= mn) | (nstp >= mx) | (mx - mn <= xtol * mx)), nx, nstp)
            new = {"stx": nx, "fx": nfx, "gx": ngx, "sty": ny, "fy": nfy, "gy": ngy, "stmin": mn, "stmax": mx,
                   "width": wd, "width1": wd1, "stp": nstp, "brackt": nbr, "stage2": stage2}
            for k, v in new.items():
                st[k][p] = v
            p = p[~end]
    return ok, x_out, f_out, g_out


def lbfgs_batched(fun: Callable, x0_SK: np.ndarray, *, memory: int = 10, max_iter: int = 1000,
                  ftol: float = 2.220446049250313e-09, gtol: float = 1e-5, max_ls: int = 20) -> LBFGSResult:
    """Minimise S independent problems at once; each start follows its own L-BFGS path.

    fun(x_SK, rows_S) -> (f_S, g_SK), numpy float64, where rows_S are the original indices of the rows of x (starts
    leave the batch as they finish). Mirrors scipy's L-BFGS-B without bounds (Byrd et al. 1995; Zhu et al. 1997):
    direction -H g from the last `memory` pairs with H0 = (s'y / y'y) I, first step 1/||g||, Moré–Thuente line
    search with c1 = 1e-3, c2 = 0.9, xtol = 0.1; converged when max|g| <= gtol or (f_old - f) <= ftol max(|f_old|,
    |f|, 1); a failed line search clears the history and retries from steepest descent, then ends the start.
    Example: res = lbfgs_batched(lambda x, rows: ((x ** 2).sum(1), 2 * x), np.random.randn(8, 3))
    """
    x = np.array(x0_SK, dtype=np.float64)
    S, K = x.shape
    out = LBFGSResult(x.copy(), np.full(S, np.nan), np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64))
    rows = np.arange(S)
    f, g = fun(x, rows)
    s_h, y_h, rho = np.zeros((S, memory, K)), np.zeros((S, memory, K)), np.zeros((S, memory))
    gamma, n_iter = np.ones(S), np.zeros(S, dtype=np.int64)
    status = np.where(np.abs(g).max(1) <= gtol, 1, 0)
    while True:
        fin = status != 0
        if fin.any():  # record finished starts and drop them from the batch
            fr = rows[fin]
            out.x_SK[fr], out.f_S[fr], out.status_S[fr], out.n_iter_S[fr] = x[fin], f[fin], status[fin], n_iter[fin]
            keep = ~fin
            rows, x, f, g, s_h, y_h, rho, gamma, n_iter, status = (
                v[keep] for v in (rows, x, f, g, s_h, y_h, rho, gamma, n_iter, status))
        if rows.size == 0:
            return out
        d = -_two_loop(g, s_h, y_h, rho, gamma)
        dg = np.einsum("sk,sk->s", d, g)
        bad = ~(dg < 0)  # not a descent direction: L-BFGS-B refreshes the memory and uses -g
        if bad.any():
            rho[bad], gamma[bad], d[bad] = 0.0, 1.0, -g[bad]
            dg = np.einsum("sk,sk->s", d, g)
        with np.errstate(divide="ignore"):
            step = np.where(n_iter == 0, np.minimum(1.0 / np.linalg.norm(d, axis=1), 1e10), 1.0)
        ok, xn, fn, gn = _line_search(fun, rows, x, f, d, dg, step, max_ls)
        status = np.where(~ok & ~(rho != 0).any(1), 4, status)  # scipy: ABNORMAL_TERMINATION_IN_LNSRCH
        rho[~ok], gamma[~ok] = 0.0, 1.0  # scipy: a failed search with history refreshes the memory and retries
        sv, yv = np.where(ok[:, None], xn - x, 0.0), np.where(ok[:, None], gn - g, 0.0)
        sy, yy = np.einsum("sk,sk->s", sv, yv), np.einsum("sk,sk->s", yv, yv)
        valid = ok & (sy > np.finfo(np.float64).eps * np.einsum("sk,sk->s", -sv, g))  # L-BFGS-B's curvature test
        s_h = np.concatenate([s_h[:, 1:], np.where(valid[:, None], sv, 0.0)[:, None]], 1)
        y_h = np.concatenate([y_h[:, 1:], np.where(valid[:, None], yv, 0.0)[:, None]], 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.concatenate([rho[:, 1:], np.where(valid, 1.0 / sy, 0.0)[:, None]], 1)
            gamma = np.where(valid, sy / yy, gamma)
        f_old = f
        x, f, g = np.where(ok[:, None], xn, x), np.where(ok, fn, f), np.where(ok[:, None], gn, g)
        n_iter += ok
        conv_g = ok & (np.abs(g).max(1) <= gtol)
        conv_f = ok & ((f_old - f) <= ftol * np.maximum(np.maximum(np.abs(f_old), np.abs(f)), 1.0))
        status = np.where(status != 0, status, np.where(conv_g, 1, np.where(conv_f, 2, 0)))
        status = np.where((status == 0) & (n_iter >= max_iter), 3, status)
