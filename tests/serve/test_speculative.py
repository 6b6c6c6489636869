"""MTP speculative decoding (serving.md 2.4, architecture.md 10): greedy output with speculation equals plain greedy
decoding token for token (several k, batched prompts of different lengths crossing 64-token page/snapshot
boundaries, prefix caching on, second pass served from the cache); the MTP catch-up reproduces the model's own MTP
logits; a drafter that proposes the target's continuation is fully accepted (k + 1 tokens per step); drafts that are
always or partly wrong roll the KDA state and latents back exactly; acceptance metrics reach /metrics. Sampled
requests (speculative sampling) are tested in test_spec_sampling.py."""

import dataclasses

import httpx
import pytest
import torch

from k3.model.transformer import build_model
from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.proposer import num_drafts
from k3.serve.request import SamplingParams
from k3.serve.verify import accepted_prefix

LENGTHS = [1, 5, 63, 64, 65, 130, 200]
MAX_TOKENS = [12, 20, 7, 20, 15, 20, 9]


def _engine(model_tok, k, **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 512, "warmup": False,
           "num_speculative_tokens": k, **kw}
    return Engine(model, tok, ServeConfig(**cfg))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (L,), generator=g).tolist() for L in lengths]


def _run(eng, prompts, params, stagger=True):
    """Submit prompts (one per step when staggered, so they join a running batch); token ids per prompt, the
    number of tokens each engine step produced for it, and the cached-token count of each request."""
    out = {i: [] for i in range(len(prompts))}
    per_step = {i: {} for i in range(len(prompts))}
    cached = {}
    step = [0]

    def sink_for(i):
        def sink(ev):
            out[i].extend(ev.token_ids)
            per_step[i][step[0]] = per_step[i].get(step[0], 0) + len(ev.token_ids)
            cached[i] = ev.num_cached_tokens
        return sink

    for i, p in enumerate(prompts):
        eng.submit(p, params[i] if isinstance(params, list) else params, sink_for(i))
        if stagger:
            eng.step()
            step[0] += 1
    while eng.has_work():
        eng.step()
        step[0] += 1
    return out, {i: list(d.values()) for i, d in per_step.items()}, cached


def _assert_all_free(eng):
    assert len(eng.states.free) == eng.states.num_slots and not eng.running
    assert eng.pages.num_free == eng.pages.num_pages and eng.scheduler.reserved == 0


@pytest.fixture(scope="module")
def plain_outputs(model_tok):
    prompts = _prompts(LENGTHS)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    out, _, _ = _run(_engine(model_tok, 0), prompts, params)
    return prompts, params, out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_greedy_equals_plain_with_prefix_caching(model_tok, plain_outputs, k):
    prompts, params, ref = plain_outputs
    eng = _engine(model_tok, k)
    out, _, _ = _run(eng, prompts, params)
    assert out == ref
    m = eng.metrics
    drafts, proposed = m.get("k3:spec_decode_num_drafts"), m.get("k3:spec_decode_num_draft_tokens")
    accepted = m.get("k3:spec_decode_num_accepted_tokens")
    assert drafts > 0 and proposed <= k * drafts and 0 <= accepted <= proposed
    per_pos = sum(m.get("k3:spec_decode_num_accepted_tokens_per_pos", position=i) for i in range(k))
    assert per_pos == accepted
    _assert_all_free(eng)
    # second pass: prompts now hit the prefix cache (latent + MTP pages, KDA snapshots with the MTP's hidden)
    out2, _, cached = _run(eng, prompts, params, stagger=False)
    assert out2 == ref
    assert cached[5] == 128 and cached[6] == 192  # 130- and 200-token prompts resume from their deepest boundary
    _assert_all_free(eng)


def test_mtp_catch_up_reproduces_model_mtp_logits(model_tok):
    """k = 1: every MTP call is a catch-up whose last pair (h_{n-1}, t_n) at slot n must give the model's own
    mtp_logits at position n - 1 (K3Model.forward with mtp_tokens), across prefill chunks and a prefix hit."""
    model, _ = model_tok
    eng = _engine(model_tok, 1, max_num_batched_tokens=64)
    seen = []  # (request, slot n, logits [V])
    orig = eng.runner.mtp_step
    current = [0]

    def spy(seqs, hidden):
        x, logits = orig(seqs, hidden)
        for s, row in zip(seqs, logits):
            seen.append((current[0], s.start, s.start + len(s.tokens) - 1, row.clone()))
        return x, logits

    eng.runner.mtp_step = spy
    base = _prompts([150], seed=5)[0]
    prompts = [base, base[:140] + _prompts([10], seed=6)[0]]  # the second one hits the cache at 128
    full = []
    for r, p in enumerate(prompts):
        current[0] = r
        evs = eng.generate(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        full.append(p + [t for e in evs for t in e.token_ids])
    assert evs[-1].num_cached_tokens == 128
    with torch.no_grad():
        ref = [model(torch.tensor([f[:-1]]), mtp_tokens_BT=torch.tensor([f[1:]])).mtp_logits[0].float() for f in full]
    checked = 0
    for r, _, n, row in seen:
        if n >= 1:
            torch.testing.assert_close(row, ref[r][n - 1], atol=1e-4, rtol=0)
            checked += 1
    # the second request's MTP resumed at slot 128 from the hidden stored with the snapshot (no pair recomputed)
    assert checked >= 10 and min(start for r, start, _, _ in seen if r == 1) == 128


def _drafter_from(eng, continuation, corrupt):
    """Replace the drafts of the real drafter (which still writes the MTP cache) by the target's own greedy
    continuation `continuation[prompt_len]`, with positions chosen by `corrupt(step, j)` made wrong."""
    orig = eng.spec.proposer.run
    step = [0]

    def run(jobs):
        drafts = orig(jobs)
        step[0] += 1
        for job, d in zip(jobs, drafts):
            if not d:
                continue
            ref = continuation[job.start + len(job.tokens)]  # tokens after the last pair's slot
            new = list(ref[:len(d)])
            for j in range(len(new)):
                if corrupt(step[0], j):
                    new[j] = (new[j] + 1) % eng.model.config.vocab_size
            d[:] = new
        return drafts

    eng.spec.proposer.run = run


def _continuations(prompts, outs):
    """position -> the greedy tokens from that position on, for every prompt (positions of distinct prompts are
    made unique by the lengths chosen below)."""
    table = {}
    for p, o in zip(prompts, outs):
        full = p + o
        for n in range(len(p), len(full)):
            table[n] = full[n:]
    return table


@pytest.mark.parametrize("k", [1, 3])
def test_draft_equal_to_target_is_fully_accepted(model_tok, plain_outputs, k):
    prompts, _, _ = plain_outputs
    p = prompts[5]  # 130 tokens: drafting crosses the 192-token page/snapshot boundary
    params = SamplingParams(temperature=0, max_tokens=4 * (k + 1) + 1, ignore_eos=True)
    ref, _, _ = _run(_engine(model_tok, 0), [p], params)
    eng = _engine(model_tok, k)
    _drafter_from(eng, _continuations([p], [ref[0]]), lambda step, j: False)
    out, sizes, _ = _run(eng, [p], params)
    assert out == ref
    # first token from the prefill, then k + 1 tokens per step (the last step may be cut by max_tokens)
    assert sizes[0][0] == 1 and sizes[0][1:-1] == [k + 1] * (len(sizes[0]) - 2)
    m = eng.metrics
    assert m.get("k3:spec_decode_num_accepted_tokens") == m.get("k3:spec_decode_num_draft_tokens") > 0
    assert m.get("k3:spec_decode_num_accepted_tokens_per_pos", position=k - 1) == m.get("k3:spec_decode_num_drafts")


def test_snapshot_written_inside_a_verify_step_serves_a_second_turn(model_tok):
    """A 62-token prompt: the first verify step (positions 62..65, all drafts accepted) crosses the 64 boundary after
    its second token, so the snapshot there comes from a per-token scratch state. A second turn extending the first
    conversation resumes from it and must equal the cache-off output."""
    prompt = _prompts([62], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    ref, _, _ = _run(_engine(model_tok, 0), [prompt], params)
    eng = _engine(model_tok, 3)
    _drafter_from(eng, _continuations([prompt], [ref[0]]), lambda step, j: False)
    out, steps, _ = _run(eng, [prompt], params)
    assert out == ref and steps[0][:2] == [1, 4]
    turn2 = prompt + ref[0] + _prompts([9], seed=9)[0]
    eng.spec.proposer.run = type(eng.spec.proposer).run.__get__(eng.spec.proposer)  # the real drafter again
    off = _engine(model_tok, 0, enable_prefix_caching=False).generate(turn2, params)[0]
    on = eng.generate(turn2, params)[0]
    assert on[-1].num_cached_tokens == 64
    assert [t for e in on for t in e.token_ids] == [t for e in off for t in e.token_ids]
    lp = lambda es: [x.logprob for e in es for x in e.logprobs]
    assert max(abs(a - b) for a, b in zip(lp(on), lp(off))) <= 1e-4


@pytest.mark.parametrize("all_wrong", [True, False], ids=["all-rejected", "partly-rejected"])
def test_rejected_drafts_roll_back_exactly(model_tok, plain_outputs, all_wrong):
    """Wrong drafts at every position (or at one position that moves every step) must leave no trace in the KDA
    state, conv tails, latents or MTP cache: output equals plain greedy, every acceptance length occurs."""
    prompts, params, ref = plain_outputs
    sel = [1, 3, 5]  # 5, 64 and 130 tokens: positions never collide between prompts over 20 new tokens
    eng = _engine(model_tok, 3)
    corrupt = (lambda step, j: True) if all_wrong else (lambda step, j: j == step % 4)  # 0, 1, 2 or 3 accepted
    _drafter_from(eng, _continuations([prompts[i] for i in sel], [ref[i] for i in sel]), corrupt)
    out, _, _ = _run(eng, [prompts[i] for i in sel], [params[i] for i in sel])
    assert [out[j] for j in range(3)] == [ref[i] for i in sel]
    m = eng.metrics
    accepted = m.get("k3:spec_decode_num_accepted_tokens")
    if all_wrong:
        assert accepted == 0 and m.get("k3:spec_decode_num_draft_tokens") > 0
    else:
        assert 0 < accepted < m.get("k3:spec_decode_num_draft_tokens")
    _assert_all_free(eng)


def test_greedy_with_penalties_and_logprobs(model_tok):
    """Penalties see the accepted drafts before each position, as one-token steps would; logprobs are the target's."""
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.3,
                       logprobs=2)
    prompt = _prompts([40], seed=4)[0]
    evs = [e for e in _engine(model_tok, 0).generate(prompt, p)[0]]
    spec_eng = _engine(model_tok, 2)
    sevs = spec_eng.generate(prompt, p)[0]
    toks = lambda es: [t for e in es for t in e.token_ids]
    lps = lambda es: [x.logprob for e in es for x in (e.logprobs or [])]
    assert toks(sevs) == toks(evs)
    assert max(abs(x - y) for x, y in zip(lps(sevs), lps(evs))) <= 1e-4
    assert spec_eng.metrics.get("k3:spec_decode_num_drafts") > 0


def test_helpers_and_bad_config(model_tok):
    assert num_drafts(3, out_len=10, max_tokens=12, seq_len=20, max_model_len=100) == 1
    assert num_drafts(3, out_len=0, max_tokens=50, seq_len=98, max_model_len=100) == 1
    assert num_drafts(3, out_len=0, max_tokens=50, seq_len=10, max_model_len=100) == 3
    assert accepted_prefix([5, 7, 9], [5, 7, 2, 4]) == 2 and accepted_prefix([1], [2, 3]) == 0
    model, tok = model_tok
    no_mtp = build_model(dataclasses.replace(model.config, mtp_depth=0))
    with pytest.raises(ValueError, match="MTP head"):
        Engine(no_mtp, tok, ServeConfig(num_speculative_tokens=1, warmup=False))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, tok, ServeConfig(num_speculative_tokens=-1, warmup=False))


def test_acceptance_metrics_on_metrics_endpoint(server_factory):
    live = server_factory(num_speculative_tokens=2, warmup=False)
    try:
        r = httpx.post(live.url + "/v1/completions", json={"model": "k3-test", "prompt": "def f(x):", "max_tokens": 24,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        text = httpx.get(live.url + "/metrics").text
        values = {}
        for line in text.splitlines():
            if line.startswith("k3:spec_decode_num_"):
                name, v = line.rsplit(" ", 1)
                values[name] = float(v)
        drafts = values['k3:spec_decode_num_drafts_total{model_name="k3-test"}']
        tokens = values['k3:spec_decode_num_draft_tokens_total{model_name="k3-test"}']
        accepted = values['k3:spec_decode_num_accepted_tokens_total{model_name="k3-test"}']
        assert drafts > 0 and tokens <= 2 * drafts and accepted <= tokens
        assert 'k3:spec_decode_num_accepted_tokens_per_pos_total{model_name="k3-test",position="0"}' in text or \
            accepted == 0
    finally:
        live.stop()
