"""Prefill-tail fast path (k3.serve.tail_graphs): the static-buffer step of B sequences that each bring the same Tn
prompt tokens, run eagerly on the CPU (the function CUDA captures), equals ModelRunner's eager step (logits, greedy
tokens, hidden rows, every cache afterwards); padded rows touch nothing else; the function does no host sync; an
engine serving a prefix-cache hit through it gives the cache-off tokens (and, speculating, the miss's drafts);
accepts() takes only equal 2..64-token "last" tails; on CUDA a captured graph's replay equals the eager step.
With graph prefill, prompt rests of at most 512 tokens come in 64-token chunks and power-of-two remainders (never
across a block, snapshots where they were), the warm-up captures exactly those lengths, a step of chunks of
different lengths runs one tail call per length, and the tokens equal a cache-off eager engine's.

Legend: B sequences in a step, Bb batch bucket, Tn tokens per sequence, Gb page bucket."""

import copy
import math

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.graphs import bucket
from k3.serve.request import SamplingParams
from k3.serve.runner import StepSeq
from k3.serve.tail_graphs import CHUNK_LENGTHS, MAX_TAIL_GRAPHS, TailBuffers, prefill_chunk

MAX_SEQS, MAX_LEN, PAGE = 8, 512, 64


def _engine(model_tok, device="cpu", **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False,
           "enable_prefix_caching": False, "cuda_graphs": False, **kw}
    return Engine(model if device == "cpu" else model.to(device), tok, ServeConfig(**cfg))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


class _Seqs:
    """B sequences prefilled by hand through one engine's runner (no scheduler), plus one idle bystander that owns
    slot 0 and a page but is never scheduled; `batch(tails)` gives a step of tails[n] new tokens per sequence."""

    def __init__(self, eng, prompts, extra):
        bystander = eng.states.allocate()  # slot 0: padded rows must never write it
        eng.runner.step([StepSeq(tokens=[5, 6, 7], start=0, slot=bystander, block_table=[eng.pages.allocate()])])
        self.slots = [eng.states.allocate() for _ in prompts]
        self.tables = [[eng.pages.allocate() for _ in range(math.ceil((len(p) + extra) / PAGE))] for p in prompts]
        self.pos = [len(p) for p in prompts]
        for p, s, bt in zip(prompts, self.slots, self.tables):
            eng.runner.step([StepSeq(tokens=p, start=0, slot=s, block_table=bt[:math.ceil(len(p) / PAGE)])])

    def batch(self, tails):
        """This step's StepSeqs; block tables cover exactly positions [0, pos + Tn) as the engine's _grow does."""
        return [StepSeq(tokens=t, start=p, slot=s, block_table=bt[:math.ceil((p + len(t)) / PAGE)])
                for t, p, s, bt in zip(tails, self.pos, self.slots, self.tables)]

    def advance(self, tails):
        self.pos = [p + len(t) for p, t in zip(self.pos, tails)]


def _twin_tail(model_tok, caches, lengths, Tn, steps=2, capture=False, device="cpu"):
    """Run the same tail steps (Tn random tokens per sequence, `steps` in a row, so the second starts from the
    first's KDA states, conv tails and latents) through the eager ModelRunner.step (engine A) and through engine B's
    runner with the fast paths on; compare logits (1e-4 relative to their scale), greedy tokens, hidden rows and
    offsets every step, the caches at the end (1e-5; 1e-4 on CUDA), and check that nothing outside the batch's own slots and new
    latent rows changed in B. Returns engine B."""
    model, tok = model_tok
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    eng_a, eng_b = _engine((model, tok)), _engine((model, tok))
    prompts = _prompts(lengths)
    a, b = _Seqs(eng_a, prompts, steps * Tn), _Seqs(eng_b, prompts, steps * Tn)  # prefilled eagerly on both
    eng_b.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=capture)
    tg = eng_b.runner.tail_graphs
    assert a.slots == b.slots and 0 not in b.slots
    for step in range(steps):
        tails = _prompts([Tn] * len(lengths), seed=1 + step)
        batch = b.batch(tails)
        assert tg.accepts(batch)
        before, calls = caches.pools(eng_b), tg.calls
        out_a, out_b = eng_a.runner.step(a.batch(tails)), eng_b.runner.step(batch)
        assert tg.calls == calls + 1  # the runner dispatched the step to the tail path
        for la, lb in zip(out_a.logits, out_b.logits, strict=True):
            assert lb.shape == la.shape == (1, model.config.vocab_size) and lb.dtype == torch.float32
            torch.testing.assert_close(lb, la, atol=1e-4 * max(1.0, la.abs().max().item()), rtol=0)
            assert int(lb.argmax()) == int(la.argmax())  # greedy tokens identical
        assert out_b.cu == out_a.cu == list(range(0, len(lengths) * Tn + 1, Tn))
        torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=1e-4, rtol=0)
        caches.untouched(eng_b, before, batch, PAGE)
        a.advance(tails)
        b.advance(tails)
    for x, y in zip(caches.pools(eng_a), caches.pools(eng_b), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5 if device == "cpu" else 1e-4, rtol=0)
    return eng_b


# ------------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("Tn", [2, 7, 64])
@pytest.mark.parametrize("lengths", [[62], [63, 120, 10]], ids=["B1", "B3-pad4"])
def test_tail_path_equals_runner_step(model_tok, lengths, Tn, caches):
    """Batch 1 and 3 (bucket 4), tails crossing page boundaries (62 + 7 > 64; 120 + 64 > 128), two tail steps in a
    row: the fast path gives the eager step's logits, greedy tokens, hidden rows and caches; padded rows inert."""
    eng = _twin_tail(model_tok, caches, lengths, Tn)
    shapes = eng.runner.tail_graphs.shapes
    assert {key[:2] for key in shapes} == {(bucket(len(lengths), MAX_SEQS), Tn)}
    assert eng.runner.graphs.calls == 0  # no step of these went to the decode path


def test_padded_rows_copy_row_zero(model_tok):
    """Host-side layout of a padded step: padded rows repeat row 0's tokens, positions, latent rows, latent sources,
    tail slot and block table, write row 0's tails (src_rows 0) and name no recurrent slot (-1); no T padding.
    Bad inputs are refused on the host (the trusted kernels do not check them)."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    tg = eng.runner.tail_graphs
    seqs = [StepSeq(tokens=[11, 12, 13], start=62, slot=3, block_table=[4, 9]),
            StepSeq(tokens=[21, 22, 23], start=5, slot=1, block_table=[2])]
    buf = TailBuffers(4, 3, 2, eng.device)
    buf.ints.copy_(tg._host_inputs(seqs, buf))
    row0 = [11, 12, 13]
    assert buf.tokens.tolist() == row0 + [21, 22, 23] + row0 * 2
    assert buf.positions.tolist() == [62, 63, 64, 5, 6, 7] + [62, 63, 64] * 2
    smap0 = [4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE + 0]
    assert buf.slot_mapping.tolist() == smap0 + [2 * PAGE + 5, 2 * PAGE + 6, 2 * PAGE + 7] + smap0 * 2
    assert buf.src_tok.tolist() == [0, 1, 2, 3, 4, 5] + [0, 1, 2] * 2 and buf.live.tolist() == [1] * 12
    assert buf.kda_slots.tolist() == [3, 1, -1, -1] and buf.tail_slots.tolist() == [3, 1, 3, 3]
    assert buf.src_rows.tolist() == [0, 1, 0, 0]
    assert buf.block_table.tolist() == [[4, 9], [2, 0], [4, 9], [4, 9]]
    with pytest.raises(ValueError, match="distinct"):
        tg._host_inputs([seqs[0], seqs[0]], buf)
    with pytest.raises(ValueError, match="outside"):  # position 64 is past a one-page table
        tg._host_inputs([StepSeq(tokens=[1, 2, 3], start=62, slot=0, block_table=[0])], buf)
    with pytest.raises(ValueError, match="vocabulary"):
        tg._host_inputs([StepSeq(tokens=[1, 10 ** 6, 2], start=0, slot=0, block_table=[0])], buf)
    with pytest.raises(ValueError, match="3 tokens"):
        tg._host_inputs([seqs[0], StepSeq(tokens=[1, 2], start=0, slot=0, block_table=[0])], buf)


def test_accepts_only_equal_short_last_tails(model_tok):
    """accepts(): equal lengths 2..64, "last" or "none" logits, no verify, snapshots only at the end of the tail, at most
    max_num_seqs sequences."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    tg = eng.runner.tail_graphs

    def seq(n, slot=0, **kw):
        return StepSeq(tokens=[7] * n, start=0, slot=slot, block_table=[0, 1], **kw)

    assert tg.accepts([seq(2)]) and tg.accepts([seq(64), seq(64, 1)]) and tg.accepts([seq(7, i) for i in range(8)])
    assert not tg.accepts([seq(1)])  # a decode: DecodeGraphs'
    assert not tg.accepts([seq(65)])  # past the recurrent kernel's range: the eager chunk path
    assert not tg.accepts([seq(3), seq(4, 1)])  # unequal lengths
    assert tg.accepts([seq(64, snapshots=[(64, 0)])])  # at the tail's end: copied from the pools after the replay
    assert not tg.accepts([seq(40, snapshots=[(32, 0)])])  # inside the tail: needs the chunk kernel's states
    assert not tg.accepts([seq(3, spec=True)])  # a verify step
    assert not tg.accepts([seq(3, logits="all")])  # prompt logprobs: the eager path
    assert tg.accepts([seq(64, logits="none"), seq(64, 1)])  # a prefill chunk that is not the prompt's last
    assert not tg.accepts([seq(3, i) for i in range(MAX_SEQS + 1)]) and not tg.accepts([])


def test_inert_run_changes_nothing(model_tok, caches):
    """The warm-up inputs used before a capture (live = 0, no recurrent slot) leave every cache bit-identical."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    _Seqs(eng, _prompts([70, 3]), extra=8)
    buf = eng.runner.tail_graphs.new_buffers(4, 5, 2)
    before = caches.pools(eng)
    eng.runner.tail_graphs.fill_inert(buf)
    eng.runner.tail_graphs.tail_forward(buf)
    assert all(torch.equal(x, y) for x, y in zip(before, caches.pools(eng)))


def test_tail_forward_does_no_host_sync(model_tok, monkeypatch, forbid_host_sync):
    """tail_forward must be capturable: any Tensor -> Python conversion raises inside it."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    seqs = _Seqs(eng, _prompts([70, 3, 9]), extra=10)
    tg = eng.runner.tail_graphs
    buf = tg._buffers(4, 5, 2)
    buf.ints.copy_(tg._host_inputs(seqs.batch(_prompts([5] * 3, seed=1)), buf))
    ref_logits, _ = tg.tail_forward(buf)  # first run outside the patch: one-time probes (MoE) may sync
    seqs.advance([[0] * 5] * 3)
    buf.ints.copy_(tg._host_inputs(seqs.batch(_prompts([5] * 3, seed=2)), buf))

    forbid_host_sync("tail_forward")
    logits, _ = tg.tail_forward(buf)
    monkeypatch.undo()
    assert logits.shape == (4, eng.model.config.vocab_size) and torch.isfinite(logits).all()
    assert not torch.equal(logits[:3], ref_logits[:3])


def test_captured_lazily_uncompiled_under_both_caps(model_tok, monkeypatch):
    """Tail shapes share the runner's graph budget, are never compiled (even with compile on); the warm-up captures
    the chunk lengths 64, 32, 16, 8, 4, 2 of every batch bucket up to the largest configured batch and nothing else;
    beyond MAX_TAIL_GRAPHS captured tails of other lengths (or the shared cap) a new shape runs eagerly while the
    captured ones keep replaying; the chunk lengths stay outside the tail cap. Captures are recorded instead of run
    (no GPU here)."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False, compile=True)
    tg = eng.runner.tail_graphs
    assert tg.budget is eng.runner.graphs.budget and tg._compiled_fn is None and tg.forward == tg.tail_forward
    used = []

    def fake_capture(buf, key, fn=None, inert=None):
        used.append((key, fn or tg.forward))
        tg.num_graphs += 1
        tg.budget.used += 1

    monkeypatch.setattr(tg, "capture", True)
    monkeypatch.setattr(tg, "_capture", fake_capture)
    eng.runner.capture_decode_graphs([1, 3])
    chunks = [(Bb, Tn, 1) for Bb in (1, 2, 4) for Tn in (64, 32, 16, 8, 4, 2)]  # 3 -> bucket 4; every bucket below
    assert [key for key, _ in used] == chunks
    assert CHUNK_LENGTHS == (2, 4, 8, 16, 32, 64)
    used.clear()
    odd = [n for n in range(3, 64) if n & (n - 1)][:MAX_TAIL_GRAPHS]  # lengths that are not powers of two
    for Tn in odd:
        assert tg._buffers(1, Tn, 1) is not None
    assert [key for key, _ in used] == [(1, Tn, 1) for Tn in odd]
    assert all(fn == tg.tail_forward for _, fn in used)  # the plain function, never a compiled one
    assert tg._buffers(2, 3, 1) is None and len(used) == MAX_TAIL_GRAPHS  # over the tail cap: eager
    assert tg._buffers(1, 3, 1) is not None and tg._buffers(1, 2, 1) is not None  # captured shapes still serve
    for Tn in CHUNK_LENGTHS:  # chunk lengths (a new bucket here): outside that cap
        assert tg._buffers(8, Tn, 1) is not None
    assert len(used) == MAX_TAIL_GRAPHS + len(CHUNK_LENGTHS)
    monkeypatch.setattr(tg, "max_tail_graphs", 64)
    tg.budget.used = tg.budget.max_graphs  # the shared cap reached (by any kind of graph)
    assert tg._buffers(2, 3, 1) is None and tg._buffers(8, 64, 2) is None
    assert len(used) == MAX_TAIL_GRAPHS + len(CHUNK_LENGTHS)


def test_prefill_chunk_powers_of_two():
    """prefill_chunk: a block at most, else the largest power of two <= take; a remainder's chunks are its binary
    digits, largest first, and never cross a block boundary from a block-aligned start."""
    assert [prefill_chunk(t, 64) for t in (0, 1, 2, 3, 29, 63, 64, 65, 200)] == [0, 1, 2, 2, 16, 32, 64, 64, 64]
    for rem in range(1, 200):
        start, sizes = 0, []
        while start < rem:
            sizes.append(prefill_chunk(rem - start, 64))
            assert (start % 64) + sizes[-1] <= 64  # inside one block
            start += sizes[-1]
        assert start == rem and all(n & (n - 1) == 0 and n <= 64 for n in sizes)
        assert sizes == sorted(sizes, reverse=True)
        assert len([n for n in sizes if n < 64]) == (rem % 64).bit_count()


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HIT_PROMPTS = [150, 192]  # hits at 128: tails of 22 tokens and of 64 (whose end-of-prompt snapshot already exists)


def _tokens(eng, prompt):
    evs = eng.generate(prompt, PARAMS)[0]
    return [t for e in evs for t in e.token_ids], evs[-1].num_cached_tokens


@pytest.fixture(scope="module")
def cache_off_tokens(model_tok):
    off = _engine(model_tok)
    return [_tokens(off, p)[0] for p in _prompts(HIT_PROMPTS, seed=5)]


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "spec2"])
def test_prefix_hit_tail_through_tail_graphs(model_tok, cache_off_tokens, k):
    """A prompt served twice with prefix caching and the fast paths on (CPU: the static functions run eagerly): the
    hit's tail step goes through TailGraphs and the greedy tokens equal a cache-off engine's. Speculating (k = 2),
    the MTP catch-up pairs the tail tokens with the tail step's hidden rows (StepOutput.hidden and cu): every MTP
    call of the hit returns the miss's logits (1e-4) and the same drafts."""
    eng = _engine(model_tok, enable_prefix_caching=True, num_speculative_tokens=k)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    tg = eng.runner.tail_graphs
    mtp_logits = []  # per MTP call: logits [N, V_] at each sequence's last pair (the next draft's distribution)
    if k:
        real = eng.runner.mtp_step

        def spy(seqs, hidden):
            out = real(seqs, hidden)
            mtp_logits.append(out[1].clone())
            return out

        eng.runner.mtp_step = spy
    for prompt, ref in zip(_prompts(HIT_PROMPTS, seed=5), cache_off_tokens, strict=True):
        miss, cached = _tokens(eng, prompt)
        assert cached == 0 and miss == ref
        miss_mtp, mtp_logits[:] = list(mtp_logits), []
        calls = tg.calls
        hit, cached = _tokens(eng, prompt)
        assert cached == 128 and hit == ref
        assert tg.calls == calls + 1  # the tail step (the only prefill step of the hit) took the fast path
        assert len(mtp_logits) == len(miss_mtp) >= (2 if k else 0)
        for a, b in zip(miss_mtp, mtp_logits):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
            assert torch.equal(b.argmax(-1), a.argmax(-1))  # the same drafts
        mtp_logits.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("Tn", [7, 64])
@pytest.mark.parametrize("lengths", [[62], [63, 120, 10]], ids=["B1", "B3-pad4"])
def test_cuda_graph_replay_equals_eager(model_tok, lengths, Tn, caches):
    """Captured tail graphs replay the eager runner's step: logits close, greedy tokens identical, caches equal,
    padded rows inert, no capture failure."""
    eng = _twin_tail(model_tok, caches, lengths, Tn, capture=True, device="cuda")
    tg = eng.runner.tail_graphs
    assert tg.num_graphs == len(tg.shapes) >= 1 and not any(b.failed for b in tg.shapes.values())
    assert all(b.graph is not None for b in tg.shapes.values())


# ---------------------------------------------------------------------- power-of-two chunks, steps grouped by length


def _graph_prefill_engine(model_tok, **kw):
    """An engine whose scheduler chunks as with CUDA graphs on (64-token chunks, power-of-two remainders, split
    steps), the static functions run eagerly (CPU)."""
    eng = _engine(model_tok, **kw)
    eng.runner.enable_decode_graphs(eng.max_model_len // PAGE, capture=False)
    eng.runner.split_mixed_steps = True
    assert eng.runner.graph_prefill
    return eng


def test_step_grouped_by_length_equals_eager(model_tok, caches):
    """A step of prefill chunks of lengths 16, 4, 16, 64 ("none" logits for one) and a one-token prompt end runs one
    tail call per length (each group in step order) and one decode call; logits, hidden rows, offsets and every
    cache equal the eager step's. A step with a chunk the tail graphs do not take (100 tokens) is not grouped."""
    eng_a, eng_b = _engine(model_tok), _graph_prefill_engine(model_tok)
    prompts = _prompts([62, 10, 64, 120, 5])
    a, b = _Seqs(eng_a, prompts, 100), _Seqs(eng_b, prompts, 100)
    tg, dg = eng_b.runner.tail_graphs, eng_b.runner.graphs
    groups, real = [], tg.step
    tg.step = lambda seqs: groups.append([(len(s.tokens), s.slot) for s in seqs]) or real(seqs)
    tails = _prompts([16, 4, 16, 64, 1], seed=7)
    sa, sb = a.batch(tails), b.batch(tails)
    sa[2].logits = sb[2].logits = "none"
    before, d_calls = caches.pools(eng_b), dg.calls
    out_a, out_b = eng_a.runner.step(sa), eng_b.runner.step(sb)
    slots = b.slots
    assert groups == [[(16, slots[0]), (16, slots[2])], [(4, slots[1])], [(64, slots[3])]], groups
    assert dg.calls == d_calls + 1
    assert out_b.cu == out_a.cu == [0, 16, 20, 36, 100, 101]
    assert out_b.logits[2] is None and out_a.logits[2] is None
    for i in (0, 1, 3, 4):
        la, lb = out_a.logits[i], out_b.logits[i]
        assert lb.shape == la.shape == (1, eng_a.model.config.vocab_size)
        torch.testing.assert_close(lb, la, atol=1e-4 * max(1.0, la.abs().max().item()), rtol=0)
        assert int(lb.argmax()) == int(la.argmax())
    torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=1e-4, rtol=0)
    caches.untouched(eng_b, before, sb, PAGE)
    for x, y in zip(caches.pools(eng_a), caches.pools(eng_b), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0)
    a.advance(tails)
    b.advance(tails)
    groups.clear()
    tails = _prompts([16, 4, 100], seed=8)  # 100 > 64: the eager path for all the chunks, in one forward
    out_a, out_b = eng_a.runner.step(a.batch(tails)[:3]), eng_b.runner.step(b.batch(tails)[:3])
    assert groups == [] and out_b.cu == out_a.cu == [0, 16, 20, 120]
    torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=1e-4, rtol=0)


LENGTHS = [1, 2, 3, 29, 63, 64, 65, 127, 200, 512, 513]
GEN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _serve(eng, prompts, log=None):
    """All prompts submitted at once, greedy, stepped to the end -> generated ids per prompt. `log` collects every
    prefill chunk scheduled: (prompt length, start, tokens, snapshot positions)."""
    out = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        eng.submit(p, GEN, lambda ev, i=i: out[i].extend(ev.token_ids))
    while eng.has_work():
        batch = eng._schedule
        if log is not None:
            def spy(real=batch):
                items = real()
                log.extend((len(seq.prompt), st.start, len(st.tokens), [p for p, _ in st.snapshots])
                           for seq, st, _ in items if st.start < len(seq.prompt))
                return items
            eng._schedule = spy
        eng.step()
        eng._schedule = batch
    return out


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
def test_power_of_two_chunks_equal_cache_off_eager(model_tok, cache):
    """Prompts of 1 .. 513 tokens through the graph-prefill scheduling give the cache-off eager engine's greedy tokens,
    then (cache on) the same prompts again (prefix hits: their tails take the same chunks) and multi-turn prompts
    extending them. Every chunk of a prompt rest <= 512 tokens is a power of two <= 64 inside one 64-token block;
    snapshots sit at chunk ends on block boundaries, and the snapshot store holds exactly the eager engine's."""
    kw = {"max_model_len": 1024, "max_num_seqs": 6}
    ref = _engine(model_tok, **kw)
    eng = _graph_prefill_engine(model_tok, enable_prefix_caching=cache, **kw)
    prompts = _prompts(LENGTHS, seed=11)
    log = []
    first = _serve(eng, prompts, log)
    n_first = len(log)
    assert first == _serve(ref, prompts)
    rounds = [prompts]
    if cache:
        turns = [p + a + q for p, a, q in zip(prompts, first, _prompts([5] * len(prompts), seed=12))]
        again = prompts[5:] + turns
        hits = eng.metrics.get("k3:prefix_cache_hits")
        assert _serve(eng, again, log) == _serve(ref, again)
        assert eng.metrics.get("k3:prefix_cache_hits") - hits >= 64 * 15  # repeats and extensions hit
        rounds.append(again)
        eager = _engine(model_tok, enable_prefix_caching=True, **kw)  # same work, eager scheduling (graphs off)
        for r in rounds:
            _serve(eager, r)
        stored = [{h for h, i in e.snaps.entry_of.items() if e.snaps.valid[i]} for e in (eng, eager)]
        assert stored[0] == stored[1] and len(stored[0]) >= 15
    lens = set()
    for L, start, n, snaps in log:
        if L - start <= 512:
            assert n & (n - 1) == 0 and n <= 64, (L, start, n)
            assert start % 64 + n <= 64, (L, start, n)  # never across a block boundary
            assert all(p % 64 == 0 and p == start + n for p in snaps), (L, start, n, snaps)  # at its end, if any
            lens.add(n)
        assert all(p % 64 == 0 and start < p <= start + n for p in snaps), (L, start, n, snaps)
    assert lens == {1, 2, 4, 8, 16, 32, 64}
    for L in LENGTHS[:-1]:  # first round, from position 0: whole blocks, then the remainder's binary digits
        sizes = [n for L_, start, n, _ in log[:n_first] if L_ == L]
        assert sizes == [64] * (L // 64) + [1 << e for e in reversed(range(6)) if L % 64 >> e & 1], (L, sizes)
