"""Dynamic expert-parallel placement: which experts each EP rank hosts and how each expert's tokens split over its
copies, planned from the previous step's router counts so that every rank receives nearly the same number of tokens
(`parallel.redundant_experts`; docs/parallel.md).

Legend: E experts, P EP ranks (E % P == 0), G = E / P experts owned per rank, R redundant slots per rank (P * R
replicas in all), S = G + R slots per rank, c_E the token counts per expert (top-K rows, globally reduced), N = sum(c),
A_r = the tokens of rank r's owned experts (the static load), L = max tokens per rank, N / P = the mean.

Static placement: rank r owns experts r*G .. r*G + G - 1 (parameters, gradients, optimizer state never move).
Dynamic placement: each rank also fills R slots with read-only copies of other ranks' experts (weights copied before
the step, gradients summed back to the owner), chosen afresh each step; R = 0 is the static placement.

Algorithm (pure, numpy; each split is one linear program through scipy's HiGHS):
1. Replicas, one at a time, P * R in all: an expert that some rank with a free slot does not yet host gets a copy on
   the least-loaded such rank. Which expert: the largest share c_e / k_e (k_e its copies so far; EPLB's rule,
   deepseek-ai/EPLB), or the largest load on the most-loaded rank, with loads modelled either as every expert's
   tokens split evenly over its copies or as a copied expert's tokens all on its foreign copies (what the exact
   split does to an overloaded owner). The three rules are each planned and split, and the plan keeps the lowest
   max load. A rank with a free slot hosts fewer than E experts (S <= E, ParallelConfig.validate), so every slot is
   filled.
2. Split: the fractions x_er (expert e's tokens sent to rank r, 0 where r holds no copy, sum_r x_er = 1) minimise L
   exactly: min T s.t. sum_{e on r} c_e x_er <= T for every r (the optimum equals the max over rank sets Q of
   c(experts hosted only inside Q) / |Q|, max-flow min-cut; the tests check this for small P).

Bound. Let s_e = c_e / k_e with the plan's final copy counts, p_r = sum_{e owned by r} s_e, top_R(r) the sum of the
R largest s_e over experts not owned by r; for copied experts (k_e >= 2) let a_e = c_e / (k_e - 1), U_r the tokens of
r's owned experts without a copy, and top'_R(r) the sum of the R largest a_e over copied experts not owned by r.
Three splits live on the plan's placement: the static one (every token to its owner, replicas idle; max load
max_r A_r), the even one (s_e to each copy; rank r holds its G owned experts and R distinct foreign ones, so its load
is at most p_r + top_R(r)) and the owner-free one (a copied expert's tokens split evenly over its foreign copies,
none to its owner; rank r's load is at most U_r + top'_R(r)). The exact split is no worse than any of them:

    L_plan <= B = min( max_r A_r , max_r [ p_r + top_R(r) ] , max_r [ U_r + top'_R(r) ] ),
    L_plan / (N / P) <= B / (N / P).

R = 0 gives B = max_r A_r (the static plan, the only split). All N tokens on one expert with R >= 1: the share rule
gives it P copies, s = N / P there and 0 elsewhere, so B = N / P for that placement and L_plan = N / P: perfect
balance. Any plan with R slots per rank has
L >= LB = max( N / P, max_r [ A_r - (the min(G, (P - 1) R) largest counts owned by r) ] ), because at most
(P - 1) R of rank r's experts can have a copy elsewhere and the others' tokens stay on r; `lower_bound` computes it so
the gap to the best possible plan is visible. Integer dispatch (`assign_tokens`, largest remainder per expert) adds
less than one token per hosted copy, so at most S tokens per rank over the fractional loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertPlan:
    """A placement and a routing split for one MoE layer's EP group.

    slots_PS: [P, G + R] int, the expert in each slot of each rank: the G owned experts in order, then the R replicas.
    split_EP: [E, P] float64, the fraction of expert e's tokens routed to rank p; 0 where p holds no copy, rows sum to 1.
    """

    slots_PS: np.ndarray
    split_EP: np.ndarray

    @property
    def ep(self) -> int:
        return self.slots_PS.shape[0]

    @property
    def num_experts(self) -> int:
        return self.split_EP.shape[0]

    @property
    def redundant(self) -> int:
        return self.slots_PS.shape[1] - self.num_experts // self.ep

    def copies_E(self) -> np.ndarray:
        """[E] int: how many ranks host each expert (1 = the owner only)."""
        return np.bincount(self.slots_PS.ravel(), minlength=self.num_experts)


RULES = ("share", "rank", "shed")  # the replica rules tried; the plan keeps the best after the exact split


def static_slots(num_experts: int, ep: int) -> np.ndarray:
    """[P, G] the owned experts of each rank: rank r owns r*G .. r*G + G - 1. static_slots(4, 2) -> [[0, 1], [2, 3]]."""
    return np.arange(num_experts).reshape(ep, num_experts // ep)


def _check(counts, ep: int, redundant: int) -> np.ndarray:
    c_E = np.asarray(counts, dtype=np.float64)
    if c_E.ndim != 1 or c_E.size == 0:
        raise ValueError(f"router counts must be a non-empty 1-D vector [E], got shape {c_E.shape}")
    if not np.isfinite(c_E).all() or (c_E < 0).any():
        raise ValueError("router counts must be finite and non-negative")
    E = c_E.size
    if ep < 1 or E % ep:
        raise ValueError(f"EP size {ep} must divide the {E} experts")
    if redundant < 0 or E // ep + redundant > E:
        raise ValueError(f"redundant slots per rank must be in 0 .. {E - E // ep} for {E} experts over {ep} ranks "
                         f"(a rank holds each expert at most once), got {redundant}")
    return c_E


def static_loads(counts, ep: int) -> np.ndarray:
    """[P] tokens per rank with every token sent to its expert's owner. static_loads([3, 1, 0, 0], 2) -> [4., 0.]."""
    c_E = _check(counts, ep, 0)
    return c_E.reshape(ep, -1).sum(1)


def rank_loads(counts, plan: ExpertPlan) -> np.ndarray:
    """[P] expected tokens per rank under the plan's split: counts [E] @ split_EP [E, P]."""
    return np.asarray(counts, dtype=np.float64) @ plan.split_EP


def _place_replicas(c_E: np.ndarray, ep: int, redundant: int, rule: str) -> np.ndarray:
    """Step 1 of the module docstring: [P, G + R] slots, owned experts first. Loads are modelled with each expert's
    tokens split evenly over its copies; rule "share" takes the largest share anywhere, "rank" the largest load on
    the most-loaded rank, "shed" the same with a copied expert's tokens all on its foreign copies (what the exact
    split does to an overloaded owner)."""
    E, G = c_E.size, c_E.size // ep
    home_E = np.arange(E) // G
    hosted_EP = np.zeros((E, ep), dtype=bool)
    hosted_EP[np.arange(E), home_E] = True
    slots = [list(row) for row in static_slots(E, ep)]
    copies_E = np.ones(E)
    free_P = np.full(ep, redundant)
    shed = rule == "shed"
    load_P = c_E.reshape(ep, G).sum(1)  # the modelled tokens per rank, kept up to date below

    def held(e_I, k_I, on_home):  # modelled tokens of experts e_I with k_I copies on one of their copies
        if not shed:
            return c_E[e_I] / k_I
        return np.where(k_I == 1, c_E[e_I], np.where(on_home, 0.0, c_E[e_I] / np.maximum(k_I - 1, 1)))

    for _ in range(ep * redundant):
        share_E = c_E / copies_E
        if rule == "share":
            key_E = share_E
        else:
            d = int(np.argmax(load_P))
            key_E = np.where(hosted_EP[:, d], held(np.arange(E), copies_E, home_E == d), -1.0)
        # largest key first, then largest share, ties to the lower index (np.lexsort sorts by the last key first)
        for e in np.lexsort((np.arange(E), -share_E, -key_E)):
            open_P = ~hosted_EP[e] & (free_P > 0)  # where a new copy of e may go
            if open_P.any():
                break
        r = int(np.flatnonzero(open_P)[np.argmin(load_P[open_P])])
        hosts = np.flatnonzero(hosted_EP[e])
        k = copies_E[e]
        load_P[hosts] += held(np.full(hosts.size, e), np.full(hosts.size, k + 1), hosts == home_E[e]) - held(
            np.full(hosts.size, e), np.full(hosts.size, k), hosts == home_E[e])
        load_P[r] += held(np.array([e]), np.array([k + 1]), np.array([False]))[0]
        hosted_EP[e, r] = True
        slots[r].append(int(e))
        copies_E[e] += 1
        free_P[r] -= 1
    return np.array(slots, dtype=np.int64)


def _best_split(c_E: np.ndarray, slots_PS: np.ndarray) -> np.ndarray:
    """Step 2: the [E, P] split minimising the max load over the slots' placement (one LP, HiGHS); rows of experts
    without tokens are 0."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    P, S = slots_PS.shape
    E, n = c_E.size, P * S
    e_J, r_J = slots_PS.ravel(), np.repeat(np.arange(P), S)  # one variable per (expert, rank) copy, then T
    total = c_E.sum()
    a_eq = coo_matrix((np.ones(n), (e_J, np.arange(n))), shape=(E, n + 1))
    a_ub = coo_matrix((np.r_[np.ones(n), -np.ones(P)], (np.r_[r_J, np.arange(P)], np.r_[np.arange(n), np.full(P, n)])),
                      shape=(P, n + 1))
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    # counts scaled to fractions of N so that HiGHS' absolute tolerances mean the same at any batch size
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=np.zeros(P), A_eq=a_eq.tocsr(), b_eq=c_E / total, method="highs")
    if res.status != 0:
        raise RuntimeError(f"expert placement LP failed: {res.message}")
    x_J = np.clip(res.x[:n], 0.0, None)  # tokens of each copy, as a fraction of N
    split_EP = np.zeros((E, P))
    np.add.at(split_EP, (e_J, r_J), x_J)
    mass_E = split_EP.sum(1, keepdims=True)
    return np.divide(split_EP, mass_E, out=np.zeros_like(split_EP), where=mass_E > 0)


def plan_experts(counts, ep: int, redundant: int) -> ExpertPlan:
    """The placement and split of the module docstring for router counts [E] over `ep` ranks with `redundant` slots
    per rank. Example: plan_experts([8, 0, 0, 0], ep=2, redundant=1) puts a copy of expert 0 on rank 1 and sends
    half of its tokens there: rank_loads -> [4., 4.]."""
    c_E = _check(counts, ep, redundant)
    E, G = c_E.size, c_E.size // ep
    slots_PS, split_EP = static_slots(E, ep), np.zeros((E, ep))
    if redundant and c_E.sum() > 0:  # the better of the two placement rules after the exact split
        best = np.inf
        for rule in RULES:
            slots = _place_replicas(c_E, ep, redundant, rule)
            split = _best_split(c_E, slots)
            if (peak := (c_E @ split).max()) < best:
                best, slots_PS, split_EP = peak, slots, split
    elif redundant:
        slots_PS = _place_replicas(c_E, ep, redundant, "share")
    home_E = np.arange(E) // G
    # an expert without tokens (or one the LP rounded to nothing) routes to its owner; rows sum to exactly 1
    mass_E = split_EP.sum(1)
    idle = (c_E == 0) | (mass_E <= 0)
    split_EP[idle] = 0.0
    split_EP[idle, home_E[idle]] = 1.0
    split_EP /= split_EP.sum(1, keepdims=True)
    return ExpertPlan(slots_PS=slots_PS, split_EP=split_EP)


def load_bound(counts, plan: ExpertPlan) -> float:
    """B of the module docstring: the guaranteed ceiling on the plan's max tokens per rank."""
    c_E = _check(counts, plan.ep, plan.redundant)
    P, G, R = plan.ep, c_E.size // plan.ep, plan.redundant
    static = static_loads(c_E, P).max()
    if R == 0:
        return float(static)
    k_E = plan.copies_E()
    share_E = c_E / k_E  # the even split's tokens per copy
    away_E = np.where(k_E > 1, c_E / np.maximum(k_E - 1, 1), 0.0)  # the owner-free split's, per foreign copy
    stuck_P = np.where(k_E == 1, c_E, 0.0).reshape(P, G).sum(1)  # owned experts without a copy elsewhere
    even = shed = 0.0
    for r in range(P):
        own = np.s_[r * G:(r + 1) * G]
        even = max(even, share_E[own].sum() + np.sort(np.delete(share_E, own))[::-1][:R].sum())
        shed = max(shed, stuck_P[r] + np.sort(np.delete(away_E, own))[::-1][:R].sum())
    return float(min(static, even, shed))


def lower_bound(counts, ep: int, redundant: int) -> float:
    """LB of the module docstring: no plan with `redundant` slots per rank has a smaller max tokens per rank."""
    c_E = _check(counts, ep, redundant)
    movable = min(c_E.size // ep, (ep - 1) * redundant)
    own_PG = np.sort(c_E.reshape(ep, -1), axis=1)  # ascending: the last `movable` may leave the rank
    stuck = own_PG[:, :own_PG.shape[1] - movable].sum(1)
    return float(max(c_E.sum() / ep, stuck.max()))


def assign_tokens(counts, plan: ExpertPlan) -> np.ndarray:
    """[E, P] int64 tokens of each expert sent to each rank: the split rounded by largest remainder per expert, so
    every row sums to the expert's count exactly. counts must be integers."""
    c_E = np.asarray(counts)
    if not np.issubdtype(c_E.dtype, np.integer):
        raise ValueError(f"assign_tokens needs integer counts, got dtype {c_E.dtype}")
    want_EP = c_E[:, None] * plan.split_EP
    out_EP = np.floor(want_EP).astype(np.int64)
    short_E = c_E - out_EP.sum(1)
    order_EP = np.argsort(-(want_EP - out_EP), axis=1, kind="stable")
    for e in np.flatnonzero(short_E):
        out_EP[e, order_EP[e, :short_E[e]]] += 1
    return out_EP


def load_report(counts, plan: ExpertPlan) -> dict[str, float]:
    """Max / mean tokens per rank without and with the plan (1.0 = perfect balance), to log every step. With this
    step's counts and the plan made from the previous step's, `ep_load_planned` is what the step met; the bound
    `ep_load_bound` holds for a plan made from `counts` themselves. Counts: a CPU tensor, array or list [E].
    Example: load_report([8, 0, 0, 0], plan_experts([8, 0, 0, 0], 2, 1)) -> {"ep_load_static": 2.0,
    "ep_load_planned": 1.0, "ep_load_bound": 1.0}."""
    c_E = np.asarray(counts, dtype=np.float64)
    mean = c_E.sum() / plan.ep
    if mean == 0:
        return {"ep_load_static": 1.0, "ep_load_planned": 1.0, "ep_load_bound": 1.0}
    return {"ep_load_static": float(static_loads(c_E, plan.ep).max() / mean),
            "ep_load_planned": float(rank_loads(c_E, plan).max() / mean),
            "ep_load_bound": float(load_bound(c_E, plan) / mean)}
