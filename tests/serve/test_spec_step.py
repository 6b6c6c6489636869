"""One-sync greedy speculative step (k3.serve.spec_step), run eagerly on the CPU through the static verify and MTP
functions (capture=False): greedy output with it equals the host path's (Engine.spec.one_sync = None) and plain greedy
decoding, token for token, at batch 1 and 3, across 64-token block boundaries and up to max_tokens (steps that take
the host path), prefix caching on and off; the path ran and read the host exactly once per step; after each step
the working KDA states, conv tails, main and MTP latents of the committed positions, the drafts and the carried
hidden equal the host path's; acceptance metrics are equal; the device helpers equal their host references.

Legend: B sequences, k drafts, T = k + 1 verify tokens."""

import copy

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.pools import StatePool
from k3.serve.request import SamplingParams
from k3.serve.spec_step import OneSyncStep
from k3.serve.verify import accept_lengths, accepted_prefix, commit_src, latent_rows

MAX_SEQS, MAX_LEN, PAGE = 8, 512, 64
METRICS = ("k3:spec_decode_num_drafts", "k3:spec_decode_num_draft_tokens", "k3:spec_decode_num_accepted_tokens")


def _engine(model_tok, k, fast=True, **kw):
    """An engine with the static steps on (eager, as CUDA would capture them); fast: the one-sync path on."""
    model, tok = model_tok
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False,
           "num_speculative_tokens": k, "cuda_graphs": False, **kw}
    eng = Engine(model, tok, ServeConfig(**cfg))
    if k:
        eng.runner.enable_static_steps()
    if not fast:
        eng.spec.one_sync = None
    return eng


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


def _submit(eng, prompts, params, out):
    for i, p in enumerate(prompts):
        eng.submit(p, params[i], lambda ev, i=i: out[i].extend(ev.token_ids))


def _serve(eng, prompts, params, stagger=True):
    """{prompt index: token ids}; staggered: one prompt joins per engine step."""
    out = {i: [] for i in range(len(prompts))}
    for i in range(len(prompts)):
        _submit(eng, prompts[i:i + 1], params[i:i + 1], {0: out[i]})
        if stagger:
            eng.step()
    while eng.has_work():
        eng.step()
    return out


@pytest.fixture
def fast_log(monkeypatch):
    """Wraps the engine's hook: per step (engine, took the one-sync path, all items verify sequences, batch size)."""
    log = []
    orig = Engine._one_sync_step

    def spy(eng, batch, n_tok):
        took = orig(eng, batch, n_tok)
        log.append((eng, took, all(it.step.spec for it in batch), len(batch)))
        return took

    monkeypatch.setattr(Engine, "_one_sync_step", spy)
    return log


# ------------------------------------------------------------------------------------------------ device helpers


def test_device_helpers_equal_host_references():
    """accept_lengths == accepted_prefix + 1 (random drafts that match a random prefix), commit_src ==
    StatePool.token_slot(slot, kept - 1), latent_rows == the host's table[pos // page] * page + pos % page."""
    g = torch.Generator().manual_seed(0)
    B, K = 64, 3
    a = torch.randint(0, 5, (B, K + 1), generator=g)
    d = a[:, :K].clone()
    cut = torch.randint(0, K + 1, (B,), generator=g)  # first wrong draft (K: none)
    for n in range(B):
        if cut[n] < K:
            d[n, cut[n]] = (d[n, cut[n]] + 1 + torch.randint(0, 3, (), generator=g)) % 5
        d[n, cut[n] + 1:] = torch.randint(0, 5, (K - min(K, int(cut[n]) + 1),), generator=g)
    kept = accept_lengths(a, d)
    assert kept.tolist() == [accepted_prefix(d[n].tolist(), a[n].tolist()) + 1 for n in range(B)]
    assert set(kept.tolist()) == {1, 2, 3, 4}
    pool = StatePool(1, 5, 1, 4, 2, torch.float32, "cpu", spec_tokens=K)
    slots = torch.randint(0, 5, (B,), generator=g)
    assert commit_src(kept, slots, pool.num_slots, pool.spec_tokens).tolist() == [
        pool.token_slot(int(s), int(c) - 1) for s, c in zip(slots, kept)]
    table = torch.randint(0, 50, (B, 4), generator=g)
    pos = torch.randint(0, 4 * PAGE, (B,), generator=g)
    assert latent_rows(pos, table, PAGE).tolist() == [
        int(table[n, int(p) // PAGE]) * PAGE + int(p) % PAGE for n, p in enumerate(pos)]


# ------------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache-on", "cache-off"])
def test_fast_path_greedy_equals_host_path_and_plain(model_tok, fast_log, prefix_caching):
    """k = 2, batch 1 then batch 3 (prompts 58, 5, 120 joining one per step; 58 and 120 cross the 64 and 128
    boundaries while decoding), max_tokens cutting the drafts near each end; then second turns (prompt + output +
    5 new tokens, all at once), which with the cache on resume from the blocks that verify steps published. Output
    == host path == plain greedy, acceptance metrics and cached-token counts equal, the one-sync path served steps
    (batched ones included) and the host path served the others (block boundaries, request ends)."""
    prompts = _prompts([58, 5, 120], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 24, 20)]
    kw = {"enable_prefix_caching": prefix_caching}
    plain = _engine(model_tok, 0, **kw)
    fast, host = _engine(model_tok, 2, **kw), _engine(model_tok, 2, fast=False, **kw)
    ref = _serve(plain, prompts[:1], params[:1])
    assert _serve(fast, prompts[:1], params[:1]) == _serve(host, prompts[:1], params[:1]) == ref
    ref = _serve(plain, prompts, params)
    assert _serve(fast, prompts, params) == _serve(host, prompts, params) == ref
    turn2 = [p + ref[i] + x for i, (p, x) in enumerate(zip(prompts, _prompts([5] * 3, seed=2)))]
    cached = {e: [] for e in (plain, fast, host)}
    for e in cached:
        out = _serve(e, turn2, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3, stagger=False)
        cached[e] = (out, e.metrics.get("k3:prefix_cache_hits"))
    assert cached[fast] == cached[host] and cached[fast][0] == cached[plain][0]
    if prefix_caching:  # blocks 0 and 1 of the first and third conversations: published by verify steps
        assert cached[fast][1] == cached[plain][1] >= 64 + 128
    for name in METRICS:
        assert fast.metrics.get(name) == host.metrics.get(name) > 0, name
    for pos in range(2):
        name = "k3:spec_decode_num_accepted_tokens_per_pos"
        assert fast.metrics.get(name, position=pos) == host.metrics.get(name, position=pos)
    took = [t for e, t, spec, _ in fast_log if e is fast and spec]
    assert sum(took) >= 10 and len(took) - sum(took) >= 4  # both paths served all-verify steps
    assert any(t and b == 3 for e, t, _, b in fast_log if e is fast)  # batched one-sync steps
    assert not any(t for e, t, *_ in fast_log if e is not fast)  # switched off / no speculation: never


@pytest.mark.parametrize("lens", [(40,), (40, 9, 70)], ids=["batch1", "batch3-bucket4"])
def test_fast_step_matches_host_step_state(model_tok, fast_log, caches, lens):
    """Three engines in lockstep, k = 3: the post-verify function (k3.serve.spec_step, run eagerly on its static
    buffers), the one-by-one device path (one_sync.fused = False) and the host path (one_sync None); batch 1, and
    batch 3 in bucket 4 (a padded row; one prompt crossing 64). After every step: the fused and one-by-one paths
    agree exactly (tokens, committed lengths, drafts, carried hidden, and every pool bit for bit: KDA states and
    scratch states, conv tails, main and MTP latent pages); against the host path the sequences' outputs,
    committed lengths, drafts and carried hidden agree, and so do their working KDA states and conv tails, the main
    latents of positions < num_computed and the MTP latents of slots 1..num_computed (all true pairs) and of the
    draft chain after them."""
    prompts = _prompts(list(lens), seed=3)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (48, 40, 40)[:len(lens)]]
    engs = [_engine(model_tok, 3, enable_prefix_caching=False) for _ in range(2)]
    engs.append(_engine(model_tok, 3, fast=False, enable_prefix_caching=False))
    engs[1].spec.one_sync.fused = False
    outs = [{i: [] for i in range(len(lens))} for _ in engs]
    for e, o in zip(engs, outs):
        _submit(e, prompts, params, o)
    checked = 0
    while engs[0].has_work():
        n = len(fast_log)
        for e in engs:
            e.step()
        assert outs[0] == outs[1] == outs[2]
        ran = [any(t for e, t, *_ in fast_log[n:] if e is eng) for eng in engs[:2]]
        assert ran[0] == ran[1]
        checked += ran[0]
        _compare_running(engs[0], engs[1], tol=0)
        for x, y in zip(caches.pools(engs[0]), caches.pools(engs[1])):
            assert torch.equal(x, y)
        _compare_running(engs[0], engs[2], tol=1e-5)
    assert not engs[2].has_work() and checked >= 6
    post, other = engs[0].spec.one_sync, engs[1].spec.one_sync
    assert post.calls == checked and other.calls == 0 and not other.post  # each engine took its own path
    assert (1 if len(lens) == 1 else 4) in {key[4] for key in post.post}  # bucket 4: a padded row
    for name in METRICS:
        assert engs[0].metrics.get(name) == engs[1].metrics.get(name) == engs[2].metrics.get(name)


def _restore(eng, pools) -> None:
    """Write a caches.pools snapshot back into the engine's pools (in place)."""
    live = list(eng.states.state) + [t for tails in eng.states.tails for t in tails] + list(eng.pages.kv)
    for dst, src in zip(live, pools):
        dst.copy_(src)


def test_post_verify_inert_run_changes_no_pool(model_tok, caches):
    """Mid-serving (batch 3 in bucket 4, k = 3; slot 0 live, scratch states and latents in the pools), an inert run
    of the post-verify function (fill_inert, then post_forward: the warm-up runs before a capture) leaves every pool
    bit-identical, for the last verify step's outputs and for logits whose argmax accepts 1, 2 or 3 of the inert
    tokens' drafts (kept = 2..T: the commit's source would be each scratch state, and the draft positions reach
    their largest); the engine then goes on and still matches plain greedy decoding."""
    prompts = _prompts([40, 9, 70], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    eng = _engine(model_tok, 3, enable_prefix_caching=False)
    out = {i: [] for i in range(3)}
    _submit(eng, prompts, params, out)
    pg = eng.spec.one_sync
    while pg.calls < 3:
        eng.step()
    (pb,) = pg.post.values()
    assert pb.cbuf.Bb == 4 and pb.vbuf.commit.rows.tolist() == [0, 1, 2, 0] and 0 in {s.slot for s in eng.running}
    logits, hidden = pb.logits, pb.hidden
    Bv, T = pb.vbuf.Bb, pb.vbuf.T
    variants = [(logits, None)]
    for kept in (2, 3, 4):  # inert tokens are 0: argmax 0 at positions < kept - 1 accepts, then 1 rejects
        x = torch.zeros_like(logits).view(Bv, T, -1)
        x[:, :kept - 1, 0] = 1
        x[:, kept - 1:, 1] = 1
        variants.append((x.view_as(logits), kept))
    for x, kept in variants:
        before = caches.pools(eng)
        pg._post_inert(pb)
        pb.logits, pb.hidden = x, hidden
        ints, _ = pg.post_forward(pb)
        if kept is not None:
            assert ints[4 * T:4 * T + 4].tolist() == [kept] * 4
        for y, z in zip(before, caches.pools(eng)):
            assert torch.equal(y, z)
    while eng.has_work():
        eng.step()
    assert out == _serve(_engine(model_tok, 0), prompts, params, stagger=False)


def test_padded_rows_verify_outputs_reach_nothing(model_tok, caches, monkeypatch):
    """Batch 3 in bucket 4, k = 3. A padded verify row starts from a zero KDA state, so its logits and hidden may
    differ from row 0's; the post-verify function gathers every per-row value through the commit's `rows`. Each
    fused step runs twice from the same pools: once with the padded row's verify logits and hidden replaced by
    noise, once as is: the real rows' tokens, accepted lengths, drafts and next hidden, and every pool, are equal;
    the padded row's outputs repeat row 0's."""
    orig, seen = OneSyncStep.post_forward, []
    g = torch.Generator().manual_seed(0)

    def twice(self, pb):
        B = int(pb.vbuf.commit.rows.max()) + 1  # rows = [0 .. B-1, 0, ...]
        if B == pb.vbuf.Bb:
            return orig(self, pb)
        T = pb.vbuf.T
        before, clean = caches.pools(self.runner), (pb.logits, pb.hidden)
        pb.logits, pb.hidden = (t.clone() for t in clean)
        pb.logits[B * T:] = torch.randn(pb.logits[B * T:].shape, generator=g) * 10
        pb.hidden[B * T:] = torch.randn(pb.hidden[B * T:].shape, generator=g)
        noisy = [t.clone() for t in orig(self, pb)] + caches.pools(self.runner)
        _restore(self.runner, before)
        pb.logits, pb.hidden = clean
        ints, h_next = out = orig(self, pb)
        Bm, k = pb.cbuf.Bb, T - 1

        def parts(v):  # the read's layout: a [Bm, T], kept [Bm], drafts [Bm, k]
            return v[:Bm * T].view(Bm, T), v[Bm * T:Bm * (T + 1)], v[Bm * (T + 1):].view(Bm, k)

        for got, ref in zip(parts(noisy[0]) + (noisy[1],), parts(ints) + (h_next,)):
            assert torch.equal(got[:B], ref[:B]) and torch.equal(ref[B:], ref[:1].expand_as(ref[B:]))
        for y, z in zip(noisy[2:], caches.pools(self.runner)):
            assert torch.equal(y, z)
        seen.append(B)
        return out

    monkeypatch.setattr(OneSyncStep, "post_forward", twice)
    eng = _engine(model_tok, 3, enable_prefix_caching=False)
    out = {i: [] for i in range(3)}
    prompts, params = _prompts([40, 9, 70], seed=6), [SamplingParams(temperature=0, max_tokens=24,
                                                                    ignore_eos=True)] * 3
    _submit(eng, prompts, params, out)
    while eng.has_work():
        eng.step()
    assert seen.count(3) >= 3
    assert out == _serve(_engine(model_tok, 0), prompts, params, stagger=False)


def _compare_running(fast, host, tol):
    """Per running sequence (same order in both engines): everything the next step reads."""
    assert len(fast.running) == len(host.running)
    n_kda = len(fast.states.state)
    for sf, sh in zip(fast.running, host.running):
        assert sf.output == sh.output and sf.num_computed == sh.num_computed and sf.slot == sh.slot
        pf, ph = sf.spec, sh.spec
        assert pf.drafts == ph.drafts
        torch.testing.assert_close(pf.hidden.to(ph.hidden.dtype), ph.hidden, atol=tol, rtol=0)
        for li in range(n_kda):
            torch.testing.assert_close(fast.states.state[li][sf.slot], host.states.state[li][sh.slot], atol=tol,
                                       rtol=0)
            for tf, th in zip(fast.states.tails[li], host.states.tails[li]):
                torch.testing.assert_close(tf[sf.slot], th[sh.slot], atol=tol, rtol=0)
        n = sf.num_computed
        for layer in range(len(fast.pages.kv)):
            mtp = layer == fast.runner.mtp_layer
            # MTP: the true pairs 1..n and the drafting chain's pairs n + 1 .. n + drafts - 1
            pos = range(1, n + max(1, len(pf.drafts))) if mtp else range(n)
            rows = [(sf.block_table[p // PAGE], p % PAGE) for p in pos]
            rows_h = [(sh.block_table[p // PAGE], p % PAGE) for p in pos]
            got = torch.stack([fast.pages.kv[layer][b, o] for b, o in rows])
            ref = torch.stack([host.pages.kv[layer][b, o] for b, o in rows_h])
            torch.testing.assert_close(got, ref, atol=tol, rtol=0)


def test_fast_step_reads_the_host_once(model_tok, fast_log, monkeypatch, spy_reads):
    """Batch 2, k = 2: every step on the one-sync path makes exactly one tensor -> host read (spec_step's tolist);
    a host-path verify step of the same engine (at the 64 boundary, near max_tokens) reads once per sequence (acceptance) and per MTP call: up to 2 + 2."""
    eng = _engine(model_tok, 2, enable_prefix_caching=False)
    prompts = _prompts([50, 20], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    _submit(eng, prompts, params, {0: [], 1: []})
    eng.step()  # prefill
    per_step = []
    while eng.has_work():
        with monkeypatch.context() as m:
            where = spy_reads(m)
            n = len(fast_log)
            eng.step()
        if all(spec for _, _, spec, _ in fast_log[n:]):
            per_step.append((fast_log[n][1], dict(where)))
    fast = [w for took, w in per_step if took]
    host = [w for took, w in per_step if not took]
    assert len(fast) >= 3 and host, per_step
    assert all(w == {("serve/spec_step.py", "tolist"): 1} for w in fast), fast
    assert eng.spec.one_sync.calls == len(fast)  # those were post-verify function steps
    assert max(sum(w.values()) for w in host) == 4, host


def test_steps_that_do_not_qualify_take_the_host_path(model_tok, fast_log):
    """A sampled request (or greedy with a penalty) in the batch, or drafts cut by max_tokens: the all-verify step
    runs on the host path (`Speculation.eligible` is False); the greedy request alone afterwards qualifies again."""
    eng = _engine(model_tok, 2, enable_prefix_caching=False)
    prompts = _prompts([7, 11, 6], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=8, seed=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5, ignore_eos=True)]
    seen = []
    orig = eng.scheduler.schedule

    def schedule():
        out = orig()
        seen.append((len(out.items), eng.spec.eligible(out.items)))
        return out

    eng.scheduler.schedule = schedule
    _serve(eng, prompts, params, stagger=False)
    took = [t for e, t, spec, _ in fast_log if spec]
    assert [ok for _, ok in seen if ok] == [t for t in took if t]
    assert not any(ok for b, ok in seen if b > 1)  # the sampled / penalised requests never ride along
    assert sum(took) >= 2


@pytest.mark.cuda
def test_cuda_fast_path_with_captured_graphs_equals_plain(model_tok, fast_log):
    """On CUDA with captured graphs: the one-sync path with its post-verify graphs (k3.serve.spec_step: the verify
    replay, then one post replay; the batch-1 and batch-4 post graphs captured at warm-up, others on first use),
    the one-sync path without them (commit, MTP catch-up and draft graphs replayed one by one) and the host path:
    greedy output == plain greedy, batch 1 then 3."""
    model, tok = model_tok
    cuda_model = copy.deepcopy(model).to("cuda")
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False}
    plain = Engine(cuda_model, tok, ServeConfig(num_speculative_tokens=0, **cfg))
    fused, fast, host = (Engine(cuda_model, tok, ServeConfig(num_speculative_tokens=2, **cfg)) for _ in range(3))
    fast.spec.one_sync.fused, host.spec.one_sync = False, None
    fused.runner.capture_graphs([1, 4])
    fused.spec.one_sync.capture_common([1, 4])
    pg = fused.spec.one_sync
    assert {key[1] for key in pg.post} == {1, 4} and all(b.graph is not None for b in pg.post.values())
    prompts = _prompts([58, 5, 120], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 24, 20)]
    for n in (1, 3):
        ref = _serve(plain, prompts[:n], params[:n])
        assert _serve(fused, prompts[:n], params[:n]) == _serve(fast, prompts[:n], params[:n]) == ref
        assert _serve(host, prompts[:n], params[:n]) == ref
    assert sum(t for e, t, *_ in fast_log if e is fused) == pg.calls >= 5
    assert all(b.graph is not None for b in pg.post.values())
    shapes = fast.runner.graphs.shapes
    assert sum(t for e, t, *_ in fast_log if e is fast) >= 5 and not fast.spec.one_sync.post
    verify = [b for k, b in shapes.items() if k[0] == "verify"]
    assert verify and all(b.graph is not None and b.commit.graph is not None for b in verify)
    assert all(b.graph is not None for k, b in shapes.items() if k[0] == "mtp")
