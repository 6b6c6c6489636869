"""Speculative steps of the graph runner (k3.serve.graphs, k3.serve.static): a verify step of B sequences (the model's
forward over static buffers with per-token KDA states, run eagerly on the CPU: the function CUDA captures) equals an
independent eager reference (the same tokens as one eager prefill chunk: logits, hidden), and after the rollback to
each sequence's accepted length the pools and the snapshots written inside the step equal an eager prefill of the
accepted tokens alone; verify steps of mixed lengths included (rows padded to the longest). The MTP static step
equals the eager mtp_step. Padded rows, padded tokens and padded pairs touch nothing else; the functions do no host
sync; an engine speculating through them gives plain greedy output; on CUDA the captured graphs replay the eager
steps.

Legend: B sequences in a step, Bb batch bucket, T tokens (pairs) per row (T_n: sequence n's), K drafts."""

import copy
import math

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.graphs import bucket
from k3.serve.request import SamplingParams
from k3.serve.static import (
    commit_forward,
    commit_inert,
    commit_layout,
    fill_inert,
    mtp_forward,
    mtp_layout,
    step_forward,
    step_layout,
)
from k3.serve.step import StepSeq, VerifyRecord

MAX_SEQS, MAX_LEN, PAGE, K = 8, 512, 64, 3
T = K + 1  # tokens of a verify step with every draft


def _engine(model_tok, k=K, device="cpu", **kw):
    model, tok = model_tok
    cfg = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": 256, "max_model_len": MAX_LEN, "warmup": False,
           "num_speculative_tokens": k, "cuda_graphs": False, **kw}
    return Engine(model if device == "cpu" else model.to(device), tok, ServeConfig(**cfg))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


def _pools(eng):
    """KDA states (working + scratch rows), conv tails, latent pages (the MTP layer included)."""
    return ([t.clone() for t in eng.states.state] + [t.clone() for tails in eng.states.tails for t in tails]
            + [t.clone() for t in eng.pages.kv])


def _restore(eng, saved):
    for dst, src in zip(list(eng.states.state) + [t for ts in eng.states.tails for t in ts] + list(eng.pages.kv),
                        saved, strict=True):
        dst.copy_(src)


def _close(xs, ys, tol):
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y, x, atol=tol, rtol=0)


class _Seqs:
    """B sequences prefilled by hand through one engine's runner (no scheduler), plus an idle bystander owning slot 0
    and a page; `verify(drafts)` gives a verify step of every sequence, `chunk(tokens)` a plain eager step."""

    def __init__(self, eng, prompts, rounds):
        self.eng = eng
        bystander = eng.states.allocate()  # slot 0: padded rows must never write it (nor its scratch rows)
        eng.runner._eager([StepSeq(tokens=[5, 6, 7], start=0, slot=bystander, block_table=[eng.pages.allocate()])])
        self.slots = [eng.states.allocate() for _ in prompts]
        self.tables = [[eng.pages.allocate() for _ in range(math.ceil((len(p) + rounds * T) / PAGE))]
                       for p in prompts]
        self.pos = [len(p) for p in prompts]
        self.next = []
        for p, s, bt in zip(prompts, self.slots, self.tables):
            out = eng.runner._eager([StepSeq(tokens=p, start=0, slot=s, block_table=bt[:math.ceil(len(p) / PAGE)])])
            self.next.append(int(out.logits[0][-1].argmax()))

    def verify(self, drafts):
        """Verify StepSeqs (first token + drafts[n], any count); block tables cover [0, start + T_n)."""
        return [StepSeq(tokens=[t] + d, start=p, slot=s, block_table=bt[:math.ceil((p + 1 + len(d)) / PAGE)],
                        logits="all", spec=True)
                for t, d, p, s, bt in zip(self.next, drafts, self.pos, self.slots, self.tables)]

    def chunk(self, tokens, snapshots=None):
        """Plain StepSeqs of tokens[n] from each sequence's position, all logits, optional snapshots."""
        return [StepSeq(tokens=t, start=p, slot=s, block_table=bt[:math.ceil((p + len(t)) / PAGE)], logits="all",
                        snapshots=list(snapshots[n]) if snapshots else [])
                for n, (t, p, s, bt) in enumerate(zip(tokens, self.pos, self.slots, self.tables))]

    def advance(self, logits, kept):
        self.next = [int(lg[a - 1].argmax()) for lg, a in zip(logits, kept)]
        self.pos = [p + a for p, a in zip(self.pos, kept)]


def _snapshot_requests(eng, seqs, kept, rnd):
    """A snapshot entry for every block boundary among each sequence's kept tokens (as Scheduler.verify_publish)."""
    out = []
    for n, (p0, a) in enumerate(zip(seqs.pos, kept)):
        out.append([(p, eng.snaps.reserve(f"round {rnd} seq {n} at {p}".encode()))
                    for p in range((p0 // PAGE + 1) * PAGE, p0 + a + 1, PAGE)])
    return out


def _twin_verify(model_tok, lengths, rounds, capture=False, device="cpu", tol=1e-5, num_drafts=None):
    """The same verify steps (random drafts, kept cycling over 1, 2, T_n) through the static verify step (engine B)
    and an eager reference (engine A): the step's logits per position and hidden rows equal A's eager prefill of
    the same tokens (A's pools then restored); after commit_spec, B's pools and the snapshots written inside the
    step equal A's eager prefill of the kept tokens alone with those snapshots. In B the step itself touches only
    the batch's per-token state rows and new latent rows of its real tokens (the conv tails are left to the
    rollback). num_drafts[r][n]: drafts of sequence n in round r (None: K each). Returns engine B."""
    eng_a = _engine(model_tok, device=device)
    eng_b = _engine(model_tok, device=device)
    eng_b.runner.enable_static_steps(capture=capture)
    g = eng_b.runner.graphs
    prompts = _prompts(lengths)
    a, b = _Seqs(eng_a, prompts, rounds), _Seqs(eng_b, prompts, rounds)
    assert a.slots == b.slots and 0 not in b.slots
    gen = torch.Generator().manual_seed(3)
    crossed = 0
    for rnd in range(rounds):
        counts = [K] * len(lengths) if num_drafts is None else num_drafts[rnd]
        drafts = [d[:c] for d, c in zip(torch.randint(4, 512, (len(lengths), K), generator=gen).tolist(), counts)]
        batch = b.verify(drafts)
        lens = [1 + c for c in counts]  # T_n
        assert g.accepts_verify(batch) and not g.accepts_step(batch)
        before = _pools(eng_b)
        calls = g.calls["verify"]
        out_b = eng_b.runner.step(batch)
        assert g.calls["verify"] == calls + 1  # the static path served it
        saved = _pools(eng_a)
        out_a = eng_a.runner.step(a.chunk([s.tokens for s in batch]))  # the reference: one eager prefill chunk
        _restore(eng_a, saved)
        assert out_b.cu == out_a.cu == [sum(lens[:n]) for n in range(len(lengths) + 1)]  # the real rows, packed
        for la, lb, L in zip(out_a.logits, out_b.logits, lens, strict=True):
            assert lb.shape == la.shape == (L, eng_a.model.config.vocab_size) and lb.dtype == torch.float32
            torch.testing.assert_close(lb, la, atol=tol * max(1.0, la.abs().max().item()), rtol=0)
        torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=tol, rtol=0)
        torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=tol, rtol=0)
        _check_verify_untouched(eng_b, before, batch)
        kept = [(1, min(2, L), L)[(rnd + n) % 3] for n, L in enumerate(lens)]
        snaps_a, snaps_b = _snapshot_requests(eng_a, a, kept, rnd), _snapshot_requests(eng_b, b, kept, rnd)
        crossed += sum(map(len, snaps_b))
        for st, n_kept, reqs in zip(batch, kept, snaps_b):
            eng_b.runner.commit_spec(st, n_kept, reqs)
        for n, (st, n_kept, reqs) in enumerate(zip(batch, kept, snaps_a)):  # A: the kept tokens alone, eagerly,
            _prefill_pieces(eng_a, a, n, st.tokens[:n_kept], reqs)  # cut at each snapshot boundary
        a.advance(out_a.logits, kept)
        b.advance(out_b.logits, kept)
        assert a.next == b.next  # greedy tokens identical
        _check_commit_untouched(eng_b, before, batch)
        n_state = len(eng_a.states.state)
        pa, pb = _pools(eng_a), _pools(eng_b)  # working rows only: A's scratch rows hold nothing
        ns = eng_a.states.num_slots
        _close([x[:ns] for x in pa[:n_state]] + pa[n_state:4 * n_state],
               [x[:ns] for x in pb[:n_state]] + pb[n_state:4 * n_state], tol)
        rows = torch.ones(eng_b.pages.num_pages * PAGE, dtype=torch.bool, device=eng_b.device)
        rows[[s.block_table[q // PAGE] * PAGE + q % PAGE for s, n_kept in zip(batch, kept)
              for q in range(s.start + n_kept, s.start + len(s.tokens))]] = False  # rejected drafts' latents stay
        _close([x.flatten(0, 1)[rows] for x in pa[4 * n_state:]], [x.flatten(0, 1)[rows] for x in pb[4 * n_state:]],
               tol)
        for reqs_a, reqs_b in zip(snaps_a, snaps_b):
            for (_, ea), (_, eb) in zip(reqs_a, reqs_b, strict=True):
                sa, sb = eng_a.snaps, eng_b.snaps
                _close([t[ea] for t in sa.state] + [t[ea] for ts in sa.tails for t in ts],
                       [t[eb] for t in sb.state] + [t[eb] for ts in sb.tails for t in ts], tol)
                torch.testing.assert_close(sb.hidden[eb], sa.hidden[ea], atol=tol, rtol=0)
                assert torch.isfinite(sb.state[0][eb]).all()  # really written (entries start as NaN)
    assert crossed >= (1 if lengths[0] == 62 else 0)
    return eng_b


def _prefill_pieces(eng, seqs, n, tokens, reqs):
    """Sequence n of `seqs` takes `tokens` as eager plain steps that end at each snapshot boundary of reqs ((p,
    entry) list), the snapshot written there from the pools (as the scheduler places snapshots at chunk ends)."""
    start, cut = seqs.pos[n], 0
    for p, entry in [*reqs, (start + len(tokens), None)]:
        j = p - start
        if j > cut:
            eng.runner.step([StepSeq(tokens=tokens[cut:j], start=start + cut, slot=seqs.slots[n],
                                     block_table=seqs.tables[n][:math.ceil((start + j) / PAGE)],
                                     snapshots=[] if entry is None else [(p, entry)])])
            cut = j


def _check_verify_untouched(eng, before, batch):
    """Bit-identity of every state row outside the batch's per-token slots (those of padded tokens included), of
    every conv tail, and of every latent row outside the batch's new positions (the MTP layer entirely)."""
    n_kda = len(eng.states.state)
    after = _pools(eng)
    own = torch.zeros(eng.states.state[0].shape[0], dtype=torch.bool, device=eng.device)
    own[[eng.states.token_slot(s.slot, t) for s in batch for t in range(len(s.tokens))]] = True
    for x, y in zip(before[:n_kda], after[:n_kda]):
        assert torch.equal(x[~own], y[~own])
    for x, y in zip(before[n_kda:4 * n_kda], after[n_kda:4 * n_kda]):
        assert torch.equal(x, y)  # the rollback writes the tails
    rows = torch.ones(eng.pages.num_pages * PAGE, dtype=torch.bool, device=eng.device)
    rows[[s.block_table[p // PAGE] * PAGE + p % PAGE for s in batch
          for p in range(s.start, s.start + len(s.tokens))]] = False
    n_mla = eng.runner.mtp_layer
    for x, y in zip(before[4 * n_kda:4 * n_kda + n_mla], after[4 * n_kda:4 * n_kda + n_mla]):
        assert torch.equal(x.flatten(0, 1)[rows], y.flatten(0, 1)[rows])
    assert torch.equal(before[-1], after[-1])  # the MTP's page layer


def _check_commit_untouched(eng, before, batch):
    """After the step and its batched rollback: the working states and conv tails of every slot outside the batch
    are bit-identical to before the step (padded rollback rows write row 0's values to row 0's slot)."""
    n_kda = len(eng.states.state)
    after = _pools(eng)
    other = torch.ones(eng.states.num_slots, dtype=torch.bool, device=eng.device)
    other[[s.slot for s in batch]] = False
    for x, y in zip(before[:4 * n_kda], after[:4 * n_kda]):
        assert torch.equal(x[:eng.states.num_slots][other], y[:eng.states.num_slots][other])


def _twin_mtp(model_tok, capture=False, device="cpu", tol=1e-5):
    """MTP calls through runner.mtp_step eagerly (engine A) and through the static MTP step (engine B):
    variable-length catch-up calls (padding by repeated pairs, batch padding), recursive one-pair calls and a batch
    of one; outputs and MTP pages agree within tol, and B's call leaves every MTP row other than its real pairs'
    bit-identical."""
    eng_a = _engine(model_tok, device=device)
    eng_b = _engine(model_tok, device=device)
    D = eng_a.model.config.d_model
    gen = torch.Generator().manual_seed(4)
    prompts = _prompts([70, 10, 3], seed=1)
    tables = [[[e.pages.allocate() for _ in range(3)] for _ in prompts] for e in (eng_a, eng_b)]
    assert tables[0] == tables[1]
    tables = tables[0]
    hid0 = [torch.randn(len(p), D, generator=gen).to(device) for p in prompts]
    for e in (eng_a, eng_b):  # the pairs of the prompts, eagerly on both (static path not enabled yet)
        e.runner.mtp_step([StepSeq(tokens=p, start=1, slot=-1, block_table=bt) for p, bt in zip(prompts, tables)],
                          torch.cat(hid0))
    eng_b.runner.enable_static_steps(capture=capture)
    g = eng_b.runner.graphs
    pos = [1 + len(p) for p in prompts]
    mtp = eng_a.runner.mtp_layer
    for lens in ([3, 1, 5], [1, 1, 1], [2], [5, 4, 2]):
        seqs = [StepSeq(tokens=torch.randint(4, 512, (L,), generator=gen).tolist(), start=p, slot=-1,
                        block_table=bt) for L, p, bt in zip(lens, pos, tables)]
        hidden = torch.randn(sum(lens), D, generator=gen).to(device)
        assert g.accepts_mtp(seqs)
        before = eng_b.pages.kv[mtp].clone()
        calls = g.calls["mtp"]
        (xa, la), (xb, lb) = eng_a.runner.mtp_step(seqs, hidden), eng_b.runner.mtp_step(seqs, hidden)
        assert g.calls["mtp"] == calls + 1
        assert ("mtp", bucket(len(lens), MAX_SEQS), max(lens)) in {k[:3] for k in g.shapes}
        assert xb.shape == xa.shape == (len(lens), D) and lb.dtype == torch.float32
        torch.testing.assert_close(xb, xa, atol=tol, rtol=0)
        torch.testing.assert_close(lb, la, atol=tol, rtol=0)
        torch.testing.assert_close(eng_b.pages.kv[mtp], eng_a.pages.kv[mtp], atol=tol, rtol=0)
        rows = torch.ones(eng_b.pages.num_pages * PAGE, dtype=torch.bool, device=eng_b.device)
        rows[[s.block_table[p // PAGE] * PAGE + p % PAGE for s in seqs
              for p in range(s.start, s.start + len(s.tokens))]] = False
        assert torch.equal(before.flatten(0, 1)[rows], eng_b.pages.kv[mtp].flatten(0, 1)[rows])
        pos = [p + L for p, L in zip(pos, lens)] + pos[len(lens):]
    return eng_b


# ------------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("lengths", [[62], [62, 130, 5]], ids=["B1", "B3-pad4"])
def test_verify_step_equals_eager_reference(model_tok, lengths):
    """Batch 1 and 3 (bucket 4), 3 rounds of K = 3 random drafts, kept = 1, 2, T in turn per sequence; the 62-token
    prompt crosses the 64 boundary inside a verify step (a snapshot from a scratch state, a page-bucket change)."""
    eng = _twin_verify(model_tok, lengths, rounds=3)
    assert {key[:3] for key in eng.runner.graphs.shapes} == {("verify", bucket(len(lengths), MAX_SEQS), T)}


@pytest.mark.parametrize(("lengths", "num_drafts"), [([62, 5], [[2, 1], [3, 1], [1, 3]]),
                                                     ([62, 130, 5], [[2, 1, 2], [3, 1, 2], [1, 3, 1]])],
                         ids=["B2", "B3-pad4"])
def test_mixed_length_verify_step_equals_eager_reference(model_tok, lengths, num_drafts):
    """Verify steps whose sequences bring different token counts (T_n = [3, 2, 3], [4, 2, 3], [2, 4, 2], ...) run on
    rows padded to the longest (repeated last token, no KDA slot) and equal the eager reference: per-sequence logits
    [T_n, V], the real hidden rows, and after the rollback with kept = 1, between and T_n (short padded rows
    included) the states, conv tails, latent pages and snapshots; padded tokens touch no scratch state row and no
    latent row past their row's real tokens."""
    eng = _twin_verify(model_tok, lengths, rounds=3, num_drafts=num_drafts)
    g = eng.runner.graphs
    Bb = bucket(len(lengths), MAX_SEQS)
    assert g.calls["verify"] == 3 and {key[:3] for key in g.shapes} == {("verify", Bb, 3), ("verify", Bb, 4)}


def test_mtp_step_equals_eager_mtp_step(model_tok):
    _twin_mtp(model_tok)


def test_host_layout_of_padded_rows_and_pairs(model_tok):
    """Verify: padded rows repeat row 0's tokens, positions, tail slot, latent rows (src = row 0's tokens) and block
    table, and name no recurrent slot. MTP: a short row repeats its last real pair (token, slot, latent row, hidden
    row, src = that pair) and its output row is its last real pair; padded rows copy row 0."""
    eng = _engine(model_tok)
    eng.runner.enable_static_steps()
    g, st = eng.runner.graphs, eng.states
    seqs = [StepSeq(tokens=[11, 12], start=63, slot=3, block_table=[4, 9], logits="all", spec=True),
            StepSeq(tokens=[13, 14], start=5, slot=1, block_table=[2], logits="all", spec=True)]
    assert g.accepts_verify(seqs)

    def layout(s, buf):
        return step_layout(s, buf, g.geom, g.max_seqs, st.token_slot)

    buf = g.buffers("verify", 4, 2, 2)
    buf.ints.copy_(layout(seqs, buf))
    assert buf.tokens.tolist() == [11, 12, 13, 14, 11, 12, 11, 12]
    assert buf.positions.tolist() == [63, 64, 5, 6, 63, 64, 63, 64]
    assert buf.kda_slots.tolist() == [3, st.token_slot(3, 1), 1, st.token_slot(1, 1)] + [-1] * 4
    assert buf.slot_mapping.tolist() == [4 * PAGE + 63, 9 * PAGE, 2 * PAGE + 5, 2 * PAGE + 6] + [4 * PAGE + 63,
                                                                                               9 * PAGE] * 2
    assert buf.src_tok.tolist() == [0, 1, 2, 3, 0, 1, 0, 1] and buf.live.tolist() == [1] * 8
    assert buf.tail_slots.tolist() == [3, 1, 3, 3] and buf.block_table.tolist() == [[4, 9], [2, 0], [4, 9], [4, 9]]
    buf.commit.ints.copy_(commit_layout(VerifyRecord(seqs, [0, 2, 4], None, buf, [2, 1]), st.token_slot))
    c = buf.commit  # padded rollback rows repeat row 0: its slot, source state, conv-input row and kept count
    assert c.slots.tolist() == [3, 1, 3, 3] and c.src.tolist() == [st.token_slot(3, 1), 1] + [st.token_slot(3, 1)] * 2
    assert c.rows.tolist() == [0, 1, 0, 0] and c.kept.tolist() == [2, 1, 2, 2] and c.live.tolist() == [1] * 4
    # mixed lengths: row 0 (2 tokens) padded to T = 3 by repeating its last token, which names no KDA slot; the
    # StepOutput gathers the real rows (real_rows) and each row's last real one (last_rows)
    mixed = [seqs[0], StepSeq(tokens=[13, 14, 15], start=5, slot=1, block_table=[2], logits="all", spec=True)]
    assert g.accepts_verify(mixed)
    buf = g.buffers("verify", 4, 3, 2)
    buf.ints.copy_(layout(mixed, buf))
    assert buf.tokens.tolist() == [11, 12, 12, 13, 14, 15] + [11, 12, 12] * 2
    assert buf.positions.tolist() == [63, 64, 64, 5, 6, 7] + [63, 64, 64] * 2
    assert buf.kda_slots.tolist() == [3, st.token_slot(3, 1), -1, 1, st.token_slot(1, 1), st.token_slot(1, 2)] + [
        -1] * 6
    assert buf.slot_mapping.tolist() == [4 * PAGE + 63, 9 * PAGE, 9 * PAGE, 2 * PAGE + 5, 2 * PAGE + 6,
                                         2 * PAGE + 7] + [4 * PAGE + 63, 9 * PAGE, 9 * PAGE] * 2
    assert buf.src_tok.tolist() == [0, 1, 1, 3, 4, 5] + [0, 1, 1] * 2 and buf.live.tolist() == [1] * 12
    assert buf.real_rows.tolist() == [0, 1, 3, 4, 5] + [0] * 7 and buf.last_rows.tolist() == [1, 5, 1, 1]
    assert buf.tail_slots.tolist() == [3, 1, 3, 3]
    buf.commit.ints.copy_(commit_layout(VerifyRecord(mixed, [0, 3, 6], None, buf, [2, 3]), st.token_slot))
    assert buf.commit.kept.tolist() == [2, 3, 2, 2]  # each sequence's own accepted length
    assert buf.commit.src.tolist() == [st.token_slot(3, 1), st.token_slot(1, 2)] + [st.token_slot(3, 1)] * 2
    with pytest.raises(ValueError, match="accepted lengths"):
        commit_layout(VerifyRecord(mixed, [0, 3, 6], None, buf, [3, None]), st.token_slot)
    # a plain decode or a prefill in the batch, or too many drafts: not a verify step
    assert not g.accepts_verify([seqs[0], StepSeq(tokens=[1], start=5, slot=1, block_table=[2])])
    assert not g.accepts_verify([seqs[0], StepSeq(tokens=[1, 2, 3], start=5, slot=1, block_table=[2])])
    assert not g.accepts_verify([StepSeq(tokens=[1] * (K + 2), start=5, slot=1, block_table=[2], logits="all",
                                         spec=True)])
    with pytest.raises(ValueError, match="distinct"):
        layout([seqs[0], seqs[0]], buf)
    with pytest.raises(ValueError, match="outside"):
        layout([StepSeq(tokens=[1, 2], start=63, slot=0, block_table=[0], spec=True)], buf)
    with pytest.raises(ValueError, match="vocabulary"):
        layout([StepSeq(tokens=[1, 10 ** 6], start=3, slot=0, block_table=[0], spec=True)], buf)

    pairs = [StepSeq(tokens=[21, 22, 23], start=62, slot=-1, block_table=[4, 9]),
             StepSeq(tokens=[24], start=7, slot=-1, block_table=[2])]
    assert g.accepts_mtp(pairs) and not g.accepts_mtp([StepSeq(tokens=[1] * (K + 3), start=1, slot=-1,
                                                               block_table=[2])])
    mbuf = g.buffers("mtp", 4, 3, 2)
    mbuf.ints.copy_(mtp_layout(pairs, mbuf, g.geom))
    assert mbuf.tokens.tolist() == [21, 22, 23, 24, 24, 24] + [21, 22, 23] * 2
    assert mbuf.positions.tolist() == [62, 63, 64, 7, 7, 7] + [62, 63, 64] * 2
    assert mbuf.slot_mapping.tolist() == [4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE] + [2 * PAGE + 7] * 3 + [
        4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE] * 2
    assert mbuf.src_tok.tolist() == [0, 1, 2, 3, 3, 3] + [0, 1, 2] * 2
    assert mbuf.hid_rows.tolist() == [0, 1, 2, 3, 3, 3] + [0, 1, 2] * 2
    assert mbuf.out_rows.tolist() == [2, 3, 2, 2]
    with pytest.raises(ValueError, match="hidden"):
        g.mtp(pairs, torch.zeros(3, eng.model.config.d_model))


def test_inert_runs_change_nothing(model_tok):
    """The warm-up inputs used before a capture (verify, its rollback, MTP) leave every state, tail and page (MTP
    layer included) bit-identical."""
    eng = _engine(model_tok)
    eng.runner.enable_static_steps()
    _Seqs(eng, _prompts([70, 3]), rounds=1)
    before = _pools(eng)
    g = eng.runner.graphs
    vbuf, mbuf = g.buffers("verify", 8, T, 2), g.buffers("mtp", 8, 2, 2)
    fill_inert(vbuf)
    fill_inert(mbuf)
    outs = step_forward(eng.runner, vbuf)
    vbuf.pre = outs[2:]
    commit_inert(vbuf.commit)
    commit_forward(eng.runner, vbuf)
    _, mtp_logits = mtp_forward(eng.runner, mbuf)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(mtp_logits).all()
    assert all(torch.equal(x, y) for x, y in zip(before, _pools(eng), strict=True))


def test_spec_functions_do_no_host_sync(model_tok, monkeypatch, forbid_host_sync):
    """The verify forward, its rollback and the MTP forward must be capturable: any Tensor -> Python conversion
    raises inside them."""
    eng = _engine(model_tok)
    eng.runner.enable_static_steps()
    seqs = _Seqs(eng, _prompts([70, 3, 9]), rounds=1)
    g = eng.runner.graphs
    batch = seqs.verify([[7] * K] * 3)
    vbuf, mbuf = g.buffers("verify", 4, T, 2), g.buffers("mtp", 4, 2, 2)
    vbuf.ints.copy_(step_layout(batch, vbuf, g.geom, g.max_seqs, eng.states.token_slot))
    step_forward(eng.runner, vbuf)  # first runs outside the patch: one-time probes (MoE) may sync
    pairs = [StepSeq(tokens=[9, 10], start=1 + 2 * n, slot=-1, block_table=[n]) for n in range(3)]
    mbuf.ints.copy_(mtp_layout(pairs, mbuf, g.geom))
    mtp_forward(eng.runner, mbuf)
    vbuf.commit.ints.copy_(commit_layout(VerifyRecord(batch, [0, T, 2 * T, 3 * T], None, vbuf, [1, 2, T]),
                                         eng.states.token_slot))

    forbid_host_sync("a static step function")
    outs = step_forward(eng.runner, vbuf)
    vbuf.pre = outs[2:]
    commit_forward(eng.runner, vbuf)
    x, logits = mtp_forward(eng.runner, mbuf)
    monkeypatch.undo()
    n_kda = len(eng.states.state)
    assert len(outs) == 2 + 6 * n_kda and outs[0].shape == (4 * T, eng.model.config.vocab_size)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(logits).all() and x.shape[0] == 4


def test_every_verify_sequence_must_be_committed(model_tok):
    """After a verify step the next step refuses to run until every sequence is committed (the batched rollback
    runs with the last one); committing a sequence twice, or one not in the step, is an error."""
    eng = _engine(model_tok)
    seqs = _Seqs(eng, _prompts([9, 4]), rounds=2)
    batch = seqs.verify([[7] * K] * 2)
    out = eng.runner.step(batch)
    eng.runner.commit_spec(batch[0], 2, [])
    with pytest.raises(ValueError, match="already committed"):
        eng.runner.commit_spec(batch[0], 2, [])
    with pytest.raises(ValueError, match="not in the last verify step"):
        eng.runner.commit_spec(StepSeq(tokens=[1, 2], start=0, slot=5, block_table=[0]), 1, [])
    with pytest.raises(RuntimeError, match="not committed"):
        eng.runner.step(seqs.verify([[7] * K] * 2))
    with pytest.raises(ValueError, match="out of range"):
        eng.runner.commit_spec(batch[1], T + 1, [])
    eng.runner.commit_spec(batch[1], 4, [])
    assert out.logits[0].shape == (T, eng.model.config.vocab_size)
    eng.runner.step([StepSeq(tokens=[3], start=seqs.pos[0] + 2, slot=seqs.slots[0], block_table=seqs.tables[0])])


def test_mixed_verify_and_plain_step_equals_separate_steps(model_tok):
    """A step with verify sequences beside a decode and a prefill chunk runs as a verify call and a plain call; its
    outputs, back in the step's order, equal the two parts run as separate steps on a twin engine."""
    engs = [_engine(model_tok) for _ in range(2)]
    seq_sets = [_Seqs(e, _prompts([62, 20, 30, 9]), rounds=1) for e in engs]
    for e, s in zip(engs, seq_sets):
        v = s.verify([[7, 8], [9, 10, 11]])[:2]
        plain = s.chunk([[], [], [s.next[2]], [4, 5, 6, 7, 8]])[2:]
        plain[0].logits = plain[1].logits = "last"
        if e is engs[0]:
            out = e.runner.step([plain[0], v[0], plain[1], v[1]])
            for st, k in zip(v, (1, 3)):
                e.runner.commit_spec(st, k, [])
        else:
            ov = e.runner.step(v)
            for st, k in zip(v, (1, 3)):
                e.runner.commit_spec(st, k, [])
            op = e.runner.step(plain)
    assert out.cu == [0, 1, 4, 9, 13]
    for got, ref in zip(out.logits, [op.logits[0], ov.logits[0], op.logits[1], ov.logits[1]]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.hidden, torch.cat([op.hidden[:1], ov.hidden[:3], op.hidden[1:], ov.hidden[3:]]),
                               atol=1e-5, rtol=0)
    _close(_pools(engs[1]), _pools(engs[0]), 1e-5)


def test_engine_speculating_through_the_static_path_equals_plain_greedy(model_tok):
    """k = 2, prefix caching on, requests joining a running batch, a second pass served from the cache: greedy output
    equals the non-speculative engine's, drafts are accepted, and verify and MTP steps went through the static
    path."""
    prompts = _prompts([5, 62, 64, 100, 30], seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _serve(_engine(model_tok, k=0), prompts, params)
    eng = _engine(model_tok, k=2)
    eng.runner.enable_static_steps()
    assert _serve(eng, prompts, params) == plain
    assert _serve(eng, prompts, params, stagger=False) == plain  # prefix hits (snapshots from the rollback)
    g, m = eng.runner.graphs, eng.metrics
    assert g.calls["verify"] >= 10 and g.calls["mtp"] >= 20
    assert any(key[0] == "verify" and key[1] >= 4 for key in g.shapes)  # batched verify steps
    assert 0 < m.get("k3:spec_decode_num_accepted_tokens") <= m.get("k3:spec_decode_num_draft_tokens")
    assert m.get("k3:prefix_cache_hits") > 0


def test_engine_mixed_draft_counts(model_tok):
    """k = 3 at batch > 1 with max_tokens that cut the drafts near each request's end, once all admitted together and
    once joining a running batch: greedy output equals the non-speculative engine's, and every all-verify step,
    mixed draft counts included, is one verify call."""
    for lens, max_tokens, seed, stagger in (([21, 42, 15, 12, 45], (7, 9, 7, 6, 14), 1, False),
                                            ([29, 64, 59, 69], (13, 6, 10, 11), 2, True)):
        prompts = _prompts(lens, seed=seed)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        plain = _serve(_engine(model_tok, k=0), prompts, params, stagger)
        eng = _engine(model_tok, k=3)
        g, runner_step = eng.runner.graphs, eng.runner.step
        steps = []  # per all-verify step: (distinct token counts, batch size, verify calls)

        def counting_step(seqs, g=g, runner_step=runner_step, steps=steps):
            calls = g.calls["verify"]
            out = runner_step(seqs)
            if all(s.spec for s in seqs):
                steps.append((len({len(s.tokens) for s in seqs}), len(seqs), g.calls["verify"] - calls))
            return out

        eng.runner.step = counting_step
        assert _serve(eng, prompts, params, stagger) == plain
        mixed = [st for st in steps if st[0] > 1]
        assert len(mixed) >= 1 and all(b > 1 for _, b, _ in mixed)  # the case the padded rows exist for
        assert [served for *_, served in steps] == [1] * len(steps)


def _serve(eng, prompts, params, stagger=True):
    """Submit one prompt per engine step when staggered; params: one SamplingParams or one per prompt;
    {prompt index: token ids}."""
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        eng.submit(p, params[i] if isinstance(params, list) else params, lambda ev, i=i: out[i].extend(ev.token_ids))
        if stagger:
            eng.step()
    while eng.has_work():
        eng.step()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize(("lengths", "num_drafts"), [([62], None), ([62, 130, 5], None),
                                                     ([62, 130, 5], [[2, 1, 2], [3, 1, 2], [1, 3, 1]])],
                         ids=["B1", "B3-pad4", "B3-pad4-mixed"])
def test_cuda_verify_graph_replay_equals_eager(model_tok, lengths, num_drafts):
    model, tok = model_tok
    eng = _twin_verify((copy.deepcopy(model), tok), lengths, rounds=3, capture=True, device="cuda", tol=1e-4,
                       num_drafts=num_drafts)
    shapes = [b for k, b in eng.runner.graphs.shapes.items() if k[0] == "verify"]
    assert shapes and all(b.graph is not None and not b.failed for b in shapes)
    assert all(b.commit.graph is not None for b in shapes)  # the batched rollback replays too


@pytest.mark.cuda
def test_cuda_mtp_graph_replay_equals_eager(model_tok):
    model, tok = model_tok
    eng = _twin_mtp((copy.deepcopy(model), tok), capture=True, device="cuda", tol=1e-4)
    shapes = [b for k, b in eng.runner.graphs.shapes.items() if k[0] == "mtp"]
    assert len(shapes) >= 3 and all(b.graph is not None and not b.failed for b in shapes)
