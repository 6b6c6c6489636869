"""The dynamic expert-parallel planner (k3.train.parallel.planner): valid plans, the stated bound, the exact split
against the max-flow min-cut value, R = 0 = static, and the gain over no plan, on random, Zipf and adversarial counts."""

import itertools

import numpy as np
import pytest
import torch

from k3.train.parallel.planner import (
    assign_tokens,
    load_bound,
    load_report,
    lower_bound,
    plan_experts,
    rank_loads,
    static_loads,
    static_slots,
)

N = 1_000_000  # routed rows per step
SHAPES = [(8, 2), (16, 4), (32, 8), (64, 8)]  # (E, P)


def zipf(E, s, rng, shuffle=True):
    w = 1.0 / np.arange(1, E + 1) ** s
    w = w[rng.permutation(E)] if shuffle else w  # unshuffled: the hottest experts all on rank 0
    return np.floor(N * w / w.sum()).astype(np.int64)


def vectors(E, P):
    rng = np.random.default_rng(E * 100 + P)
    G = E // P
    one_hot = np.zeros(E, np.int64)
    one_hot[E - 1] = N
    one_rank = np.zeros(E, np.int64)
    one_rank[G:2 * G] = N // G
    return {"random": rng.integers(0, 2 * N // E, E), "zipf1.0": zipf(E, 1.0, rng), "zipf1.5": zipf(E, 1.5, rng),
            "zipf2.0": zipf(E, 2.0, rng), "zipf1.5-rank0": zipf(E, 1.5, rng, shuffle=False),
            "one-expert": one_hot, "one-rank": one_rank, "uniform": np.full(E, N // E)}


_PLANS: dict = {}


def planned(E, P, R, name):
    """(counts, plan) of one case, planned once for the tests that share it."""
    if (E, P, R, name) not in _PLANS:
        c = vectors(E, P)[name]
        _PLANS[E, P, R, name] = c, plan_experts(c, P, R)
    return _PLANS[E, P, R, name]


CASES = [(E, P, R, name) for E, P in SHAPES for R in (0, 1, 2) for name in vectors(E, P)]


def hall_value(c, slots, P):
    """Max over rank sets Q of c(experts hosted only inside Q) / |Q|: the optimal max load (max-flow min-cut)."""
    hosts = [set(np.flatnonzero((slots == e).any(1))) for e in range(len(c))]
    best = 0.0
    for k in range(1, P + 1):
        for Q in itertools.combinations(range(P), k):
            q = set(Q)
            best = max(best, sum(c[e] for e in range(len(c)) if hosts[e] <= q) / k)
    return best


@pytest.mark.parametrize(("E", "P", "R", "name"), CASES, ids=[f"E{e}-P{p}-R{r}-{n}" for e, p, r, n in CASES])
def test_plan_is_valid_and_meets_the_bound(E, P, R, name):
    c, plan = planned(E, P, R, name)
    G = E // P
    assert plan.slots_PS.shape == (P, G + R)
    assert (plan.slots_PS[:, :G] == static_slots(E, P)).all()  # owners never move
    assert all(len(set(row)) == G + R for row in plan.slots_PS)  # a rank holds an expert at most once
    assert (plan.copies_E() >= 1).all()
    hosted = np.zeros((E, P), bool)
    hosted[plan.slots_PS, np.arange(P)[:, None]] = True
    assert (plan.split_EP >= 0).all() and (plan.split_EP[~hosted] == 0).all()
    np.testing.assert_allclose(plan.split_EP.sum(1), 1.0, rtol=0, atol=1e-12)
    loads = rank_loads(c, plan)
    np.testing.assert_allclose(loads.sum(), c.sum(), rtol=1e-12)  # counts conserved
    tokens = assign_tokens(c, plan)
    assert (tokens.sum(1) == c).all() and (tokens[~hosted] == 0).all() and (tokens >= 0).all()
    assert (tokens.sum(0) <= loads + G + R).all()  # rounding: under one token per hosted copy
    static, bound, lb = static_loads(c, P).max(), load_bound(c, plan), lower_bound(c, P, R)
    assert lb * (1 - 1e-9) <= loads.max() <= bound * (1 + 1e-9) + 1e-6
    assert bound <= static
    # the bound's witnesses built directly from the placement: even over all copies, and none to a copied owner
    k = hosted.sum(1)
    even = (c / k) @ hosted
    owner_free = hosted & ~((k > 1)[:, None] & (np.arange(P) == (np.arange(E) // G)[:, None]))
    shed = (c / owner_free.sum(1)) @ owner_free
    tol = 1e-9 * c.sum() + 1e-6
    assert loads.max() <= min(even.max(), shed.max()) + tol
    assert min(static, even.max(), shed.max()) <= bound + tol
    if P <= 8:  # the split is the optimum of its placement: the min-cut value, enumerated independently
        np.testing.assert_allclose(loads.max(), hall_value(c.astype(float), plan.slots_PS, P), rtol=1e-7)


@pytest.mark.parametrize(("E", "P"), SHAPES)
def test_no_redundancy_is_the_static_placement(E, P):
    for name in vectors(E, P):
        c, plan = planned(E, P, 0, name)
        assert (plan.slots_PS == static_slots(E, P)).all()
        assert (plan.split_EP == np.eye(P)[np.arange(E) // (E // P)]).all()
        assert (rank_loads(c, plan) == static_loads(c, P)).all()
        assert load_bound(c, plan) == static_loads(c, P).max()


@pytest.mark.parametrize(("E", "P"), SHAPES)
@pytest.mark.parametrize("R", [1, 2])
def test_plan_improves_on_no_plan(E, P, R):
    for name in vectors(E, P):
        c, plan = planned(E, P, R, name)
        report = load_report(c, plan)
        assert report["ep_load_planned"] <= report["ep_load_static"] + 1e-9, name
        if name != "uniform" and name != "random":  # skewed: strictly better, and within the stated bound
            assert report["ep_load_planned"] < report["ep_load_static"] - 1e-3, name
        assert report["ep_load_planned"] <= report["ep_load_bound"] + 1e-9, name


@pytest.mark.parametrize(("E", "P"), SHAPES)
def test_one_hot_expert_is_spread_perfectly(E, P):
    c, plan = planned(E, P, 1, "one-expert")
    assert plan.copies_E()[E - 1] == P  # the hot expert on every rank
    np.testing.assert_allclose(rank_loads(c, plan), N / P, rtol=1e-9)
    np.testing.assert_allclose(load_bound(c, plan), N / P, rtol=1e-12)


def test_one_rank_hot_is_as_good_as_any_plan_when_slots_suffice():
    # all tokens on rank 1's 4 experts, 3 other ranks x 2 slots >= 4: a perfect plan exists and the LB says so
    c = vectors(16, 4)["one-rank"]
    plan = plan_experts(c, 4, 2)
    assert lower_bound(c, 4, 2) == N / 4
    np.testing.assert_allclose(rank_loads(c, plan).max(), N / 4, rtol=1e-9)
    # one slot per rank: 3 of the 4 experts can leave, the 4th stays whole (N/4): optimum N/4 again
    np.testing.assert_allclose(rank_loads(c, plan_experts(c, 4, 1)).max(), N / 4, rtol=1e-9)


def test_example_and_report_keys():
    plan = plan_experts([8, 0, 0, 0], ep=2, redundant=1)
    np.testing.assert_allclose(rank_loads([8, 0, 0, 0], plan), [4.0, 4.0])
    assert load_report([8, 0, 0, 0], plan) == pytest.approx(
        {"ep_load_static": 2.0, "ep_load_planned": 1.0, "ep_load_bound": 1.0})
    assert load_report(torch.tensor([8, 0, 0, 0]), plan)["ep_load_planned"] == pytest.approx(1.0)  # router counts
    assert (assign_tokens(torch.tensor([8, 0, 0, 0]), plan) == [[4, 4], [0, 0], [0, 0], [0, 0]]).all()
    # a stale plan (last step's) on new counts: the report shows what the step met
    assert load_report([0, 0, 8, 0], plan)["ep_load_planned"] == pytest.approx(2.0)
    assert load_report([0, 0, 0, 0], plan) == {"ep_load_static": 1.0, "ep_load_planned": 1.0, "ep_load_bound": 1.0}


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="EP size 3 must divide the 8 experts"):
        plan_experts(np.ones(8), 3, 0)
    with pytest.raises(ValueError, match="redundant slots per rank must be in 0 .. 4"):
        plan_experts(np.ones(8), 2, 5)
    with pytest.raises(ValueError, match="non-negative"):
        plan_experts(np.array([1.0, -1.0]), 1, 0)
    with pytest.raises(ValueError, match="1-D"):
        plan_experts(np.ones((2, 4)), 2, 0)
    with pytest.raises(ValueError, match="integer counts"):
        assign_tokens(np.ones(4), plan_experts(np.ones(4), 2, 1))
