"""Speculative fast path (k3.serve.spec_graphs): the static-buffer verify step and MTP draft step, run eagerly on the
CPU (the functions CUDA captures), equal ModelRunner's eager verify step and mtp_step (logits, hidden, pools after
commit_spec, snapshots, MTP pages), verify steps of mixed lengths included (rows padded to the longest); padded
rows, padded tokens and padded pairs touch nothing else; the functions do no host sync; an engine speculating
through them gives plain greedy output and serves every all-verify step on the fast path; on CUDA the captured
graphs replay the eager steps.

Legend: B sequences in a step, Bb batch bucket, T tokens (pairs) per row (T_n: sequence n's), K drafts."""

import copy
import math

import pytest
import torch

from k3.serve.config import ServeConfig
from k3.serve.engine import Engine
from k3.serve.graphs import bucket
from k3.serve.request import SamplingParams
from k3.serve.runner import StepSeq
from k3.serve.spec_graphs import MTPBuffers, VerifyBatch, VerifyBuffers

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


def _state_tensors(eng):
    """KDA states (working + scratch rows) and conv tails, per layer."""
    return [t.clone() for t in eng.states.state] + [t.clone() for tails in eng.states.tails for t in tails]


def _close(xs, ys, tol):
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y, x, atol=tol, rtol=0)


class _Verifier:
    """B sequences prefilled by hand through one engine's runner (no scheduler), plus an idle bystander owning slot 0
    and a page; `batch(drafts)` gives a verify step of every sequence, `commit(out, kept)` keeps kept[n] tokens."""

    def __init__(self, eng, prompts, rounds):
        self.eng = eng
        bystander = eng.states.allocate()  # slot 0: padded rows must never write it (nor its scratch rows)
        eng.runner.step([StepSeq(tokens=[5, 6, 7], start=0, slot=bystander, block_table=[eng.pages.allocate()])])
        self.slots = [eng.states.allocate() for _ in prompts]
        self.tables = [[eng.pages.allocate() for _ in range(math.ceil((len(p) + rounds * T) / PAGE))]
                       for p in prompts]
        self.pos = [len(p) for p in prompts]
        self.next = []
        for p, s, bt in zip(prompts, self.slots, self.tables):
            out = eng.runner.step([StepSeq(tokens=p, start=0, slot=s, block_table=bt[:math.ceil(len(p) / PAGE)])])
            self.next.append(int(out.logits[0][-1].argmax()))

    def batch(self, drafts):
        """Verify StepSeqs (first token + drafts[n], any count); block tables cover [0, start + T_n) as the engine's
        _grow."""
        return [StepSeq(tokens=[t] + d, start=p, slot=s, block_table=bt[:math.ceil((p + 1 + len(d)) / PAGE)],
                        logits="all", spec=True)
                for t, d, p, s, bt in zip(self.next, drafts, self.pos, self.slots, self.tables)]

    def commit(self, out, kept, snaps):
        """commit_spec of every sequence (snaps[n]: its (boundary, entry) list); the next token is the target's at
        the last kept position."""
        for n, a in enumerate(kept):
            self.eng.runner.commit_spec(n, a, snaps[n])
        self.next = [int(lg[a - 1].argmax()) for lg, a in zip(out.logits, kept)]
        self.pos = [p + a for p, a in zip(self.pos, kept)]


def _snapshot_requests(eng, ver, kept, rnd):
    """A snapshot entry for every block boundary among each sequence's kept tokens (as Engine._commit_verify)."""
    out = []
    for n, (p0, a) in enumerate(zip(ver.pos, kept)):
        reqs = []
        for p in range((p0 // PAGE + 1) * PAGE, p0 + a + 1, PAGE):
            entry = eng.snaps.reserve(f"round {rnd} seq {n} at {p}".encode())
            reqs.append((p, entry))
        out.append(reqs)
    return out


def _twin_verify(model_tok, lengths, rounds, capture=False, device="cpu", tol=1e-5, num_drafts=None):
    """The same verify steps (random drafts, kept cycling over 1, 2, T_n) through ModelRunner's eager verify step
    (engine A) and the verify fast path (engine B): logits per position, hidden, pools after commit_spec and the
    snapshots it writes agree; in B the step itself touches only the batch's per-token state rows and new latent
    rows of its real tokens (the conv tails are left to commit_spec). num_drafts[r][n]: drafts of sequence n in
    round r (None: K each; unequal counts give a mixed-length step, rows padded to the longest). Returns engine B."""
    eng_a = _engine(model_tok, device=device)
    eng_b = _engine(model_tok, device=device)
    eng_b.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=capture)
    vg = eng_b.runner.verify_graphs
    prompts = _prompts(lengths)
    a, b = _Verifier(eng_a, prompts, rounds), _Verifier(eng_b, prompts, rounds)
    assert a.slots == b.slots and 0 not in b.slots
    g = torch.Generator().manual_seed(3)
    crossed = 0
    for rnd in range(rounds):
        counts = [K] * len(lengths) if num_drafts is None else num_drafts[rnd]
        drafts = [d[:c] for d, c in zip(torch.randint(4, 512, (len(lengths), K), generator=g).tolist(), counts)]
        batch = b.batch(drafts)
        lens = [1 + c for c in counts]  # T_n
        assert vg.accepts(batch) and not eng_b.runner.graphs.accepts(batch)
        before = _state_tensors(eng_b) + [t.clone() for t in eng_b.pages.kv]
        calls = vg.calls
        out_a, out_b = eng_a.runner.step(a.batch(drafts)), eng_b.runner.step(batch)
        assert vg.calls == calls + 1  # the fast path served it
        assert out_b.cu == out_a.cu == [sum(lens[:n]) for n in range(len(lengths) + 1)]  # the real rows, packed
        for la, lb, L in zip(out_a.logits, out_b.logits, lens, strict=True):
            assert lb.shape == la.shape == (L, eng_a.model.config.vocab_size) and lb.dtype == torch.float32
            torch.testing.assert_close(lb, la, atol=tol, rtol=0)
        torch.testing.assert_close(out_b.hidden, out_a.hidden, atol=tol, rtol=0)
        torch.testing.assert_close(out_b.hidden_last, out_a.hidden_last, atol=tol, rtol=0)
        _check_verify_untouched(eng_b, before, batch)
        kept = [(1, min(2, L), L)[(rnd + n) % 3] for n, L in enumerate(lens)]
        snaps_a, snaps_b = _snapshot_requests(eng_a, a, kept, rnd), _snapshot_requests(eng_b, b, kept, rnd)
        crossed += sum(map(len, snaps_b))
        a.commit(out_a, kept, snaps_a)
        b.commit(out_b, kept, snaps_b)
        assert a.next == b.next  # greedy tokens identical
        _check_commit_untouched(eng_b, before, batch)
        _close(_state_tensors(eng_a) + eng_a.pages.kv, _state_tensors(eng_b) + eng_b.pages.kv, tol)
        for reqs_a, reqs_b in zip(snaps_a, snaps_b):
            for (_, ea), (_, eb) in zip(reqs_a, reqs_b, strict=True):
                sa, sb = eng_a.snaps, eng_b.snaps
                _close([t[ea] for t in sa.state] + [t[ea] for ts in sa.tails for t in ts] + [sa.hidden[ea]],
                       [t[eb] for t in sb.state] + [t[eb] for ts in sb.tails for t in ts] + [sb.hidden[eb]], tol)
                assert torch.isfinite(sb.state[0][eb]).all()  # really written (entries start as NaN)
    assert crossed >= (1 if lengths[0] == 62 else 0)
    return eng_b


def _check_verify_untouched(eng, before, batch):
    """Bit-identity of every state row outside the batch's per-token slots (those of padded tokens included), of
    every conv tail, and of every latent row outside the batch's new positions (the MTP layer entirely)."""
    n_kda = len(eng.states.state)
    after = _state_tensors(eng) + list(eng.pages.kv)
    own = torch.zeros(eng.states.state[0].shape[0], dtype=torch.bool, device=eng.device)
    own[[eng.states.token_slot(s.slot, t) for s in batch for t in range(len(s.tokens))]] = True
    for x, y in zip(before[:n_kda], after[:n_kda]):
        assert torch.equal(x[~own], y[~own])
    for x, y in zip(before[n_kda:4 * n_kda], after[n_kda:4 * n_kda]):
        assert torch.equal(x, y)  # commit_spec writes the tails
    rows = torch.ones(eng.pages.num_pages * PAGE, dtype=torch.bool, device=eng.device)
    rows[[s.block_table[p // PAGE] * PAGE + p % PAGE for s in batch
          for p in range(s.start, s.start + len(s.tokens))]] = False
    n_mla = eng.runner.mtp_layer
    for x, y in zip(before[4 * n_kda:4 * n_kda + n_mla], after[4 * n_kda:4 * n_kda + n_mla]):
        assert torch.equal(x.flatten(0, 1)[rows], y.flatten(0, 1)[rows])
    assert torch.equal(before[-1], after[-1])  # the MTP's page layer


def _check_commit_untouched(eng, before, batch):
    """After the step and its (batched) commit: the working states and conv tails of every slot outside the batch
    are bit-identical to before the step (padded commit rows write row 0's values to row 0's slot)."""
    n_kda = len(eng.states.state)
    after = _state_tensors(eng)
    other = torch.ones(eng.states.num_slots, dtype=torch.bool, device=eng.device)
    other[[s.slot for s in batch]] = False
    for x, y in zip(before[:4 * n_kda], after):
        assert torch.equal(x[:eng.states.num_slots][other], y[:eng.states.num_slots][other])


def _twin_mtp(model_tok, capture=False, device="cpu", tol=1e-5):
    """MTP calls through runner.mtp_step eagerly (engine A) and through the MTP fast path (engine B): variable-length
    catch-up calls (padding by repeated pairs, batch padding), recursive one-pair calls and a batch of one; outputs
    and MTP pages agree within tol (not bitwise: GEMMs over another row count round differently), and B's call
    leaves every MTP row other than its real pairs' bit-identical."""
    eng_a = _engine(model_tok, device=device)
    eng_b = _engine(model_tok, device=device)
    D = eng_a.model.config.d_model
    g = torch.Generator().manual_seed(4)
    prompts = _prompts([70, 10, 3], seed=1)
    tables = [[[e.pages.allocate() for _ in range(3)] for _ in prompts] for e in (eng_a, eng_b)]
    assert tables[0] == tables[1]
    tables = tables[0]
    hid0 = [torch.randn(len(p), D, generator=g).to(device) for p in prompts]
    for e in (eng_a, eng_b):  # the pairs of the prompts, eagerly on both (fast path not enabled yet)
        e.runner.mtp_step([StepSeq(tokens=p, start=1, slot=-1, block_table=bt) for p, bt in zip(prompts, tables)],
                          torch.cat(hid0))
    eng_b.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=capture)
    mg = eng_b.runner.mtp_graphs
    pos = [1 + len(p) for p in prompts]
    mtp = eng_a.runner.mtp_layer
    for lens in ([3, 1, 5], [1, 1, 1], [2], [5, 4, 2]):
        seqs = [StepSeq(tokens=torch.randint(4, 512, (L,), generator=g).tolist(), start=p, slot=-1, block_table=bt)
                for L, p, bt in zip(lens, pos, tables)]
        hidden = torch.randn(sum(lens), D, generator=g).to(device)
        assert mg.accepts(seqs)
        before = eng_b.pages.kv[mtp].clone()
        calls = mg.calls
        (xa, la), (xb, lb) = eng_a.runner.mtp_step(seqs, hidden), eng_b.runner.mtp_step(seqs, hidden)
        assert mg.calls == calls + 1 and (bucket(len(lens), MAX_SEQS), max(lens)) in {k[:2] for k in mg.shapes}
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
def test_verify_path_equals_eager_verify(model_tok, lengths):
    """Batch 1 and 3 (bucket 4), 3 rounds of K = 3 random drafts, kept = 1, 2, T in turn per sequence; the 62-token
    prompt crosses the 64 boundary inside a verify step (a snapshot from a scratch state, a page-bucket change)."""
    eng = _twin_verify(model_tok, lengths, rounds=3)
    assert {key[:2] for key in eng.runner.verify_graphs.shapes} == {(bucket(len(lengths), MAX_SEQS), T)}


@pytest.mark.parametrize(("lengths", "num_drafts"), [([62, 5], [[2, 1], [3, 1], [1, 3]]),
                                                     ([62, 130, 5], [[2, 1, 2], [3, 1, 2], [1, 3, 1]])],
                         ids=["B2", "B3-pad4"])
def test_mixed_length_verify_path_equals_eager_verify(model_tok, lengths, num_drafts):
    """Verify steps whose sequences bring different token counts (T_n = [3, 2, 3], [4, 2, 3], [2, 4, 2], ...) run
    through the fast path, rows padded to the longest (repeated last token, no KDA slot), and equal the eager
    varlen verify step: per-sequence logits [T_n, V], the real hidden rows, and after commit_spec with kept = 1,
    between and T_n (short padded rows included) the states, conv tails, latent pages and snapshots; padded tokens
    touch no scratch state row and no latent row past their row's real tokens."""
    eng = _twin_verify(model_tok, lengths, rounds=3, num_drafts=num_drafts)
    vg = eng.runner.verify_graphs
    Bb = bucket(len(lengths), MAX_SEQS)
    assert vg.calls == 3 and {key[:2] for key in vg.shapes} == {(Bb, 3), (Bb, 4)}  # T = the step's longest row


def test_mtp_path_equals_eager_mtp_step(model_tok):
    _twin_mtp(model_tok)


def test_host_layout_of_padded_rows_and_pairs(model_tok):
    """Verify: padded rows repeat row 0's tokens, positions, tail slot, latent rows (src = row 0's tokens) and
    block table, and name no recurrent slot. MTP: a short row repeats its last real pair (token, slot, latent row,
    hidden row, src = that pair) and its output row is its last real pair; padded rows copy row 0."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    vg, mg = eng.runner.verify_graphs, eng.runner.mtp_graphs
    st = eng.states
    seqs = [StepSeq(tokens=[11, 12], start=63, slot=3, block_table=[4, 9], logits="all", spec=True),
            StepSeq(tokens=[13, 14], start=5, slot=1, block_table=[2], logits="all", spec=True)]
    assert vg.accepts(seqs)
    buf = VerifyBuffers(4, 2, 2, eng.device)
    buf.ints.copy_(vg._host_inputs(seqs, buf))
    assert buf.tokens.tolist() == [11, 12, 13, 14, 11, 12, 11, 12]
    assert buf.positions.tolist() == [63, 64, 5, 6, 63, 64, 63, 64]
    assert buf.kda_slots.tolist() == [3, st.token_slot(3, 1), 1, st.token_slot(1, 1)] + [-1] * 4
    assert buf.slot_mapping.tolist() == [4 * PAGE + 63, 9 * PAGE, 2 * PAGE + 5, 2 * PAGE + 6] + [4 * PAGE + 63,
                                                                                               9 * PAGE] * 2
    assert buf.src_tok.tolist() == [0, 1, 2, 3, 0, 1, 0, 1] and buf.live.tolist() == [1] * 8
    assert buf.tail_slots.tolist() == [3, 1, 3, 3] and buf.block_table.tolist() == [[4, 9], [2, 0], [4, 9], [4, 9]]
    buf.commit.ints.copy_(vg._commit_inputs(VerifyBatch(seqs, [0, 2, 4], buf, [2, 1])))
    c = buf.commit  # padded commit rows repeat row 0: its slot, source state, conv-input row and kept count
    assert c.slots.tolist() == [3, 1, 3, 3] and c.src.tolist() == [st.token_slot(3, 1), 1] + [st.token_slot(3, 1)] * 2
    assert c.rows.tolist() == [0, 1, 0, 0] and c.kept.tolist() == [2, 1, 2, 2] and c.live.tolist() == [1] * 4
    # mixed lengths: row 0 (2 tokens) padded to T = 3 by repeating its last token, which names no KDA slot;
    # the StepOutput gathers the real rows (real_rows) and each row's last real one (last_rows)
    mixed = [seqs[0], StepSeq(tokens=[13, 14, 15], start=5, slot=1, block_table=[2], logits="all", spec=True)]
    assert vg.accepts(mixed)
    buf = VerifyBuffers(4, 3, 2, eng.device)
    buf.ints.copy_(vg._host_inputs(mixed, buf))
    assert buf.tokens.tolist() == [11, 12, 12, 13, 14, 15] + [11, 12, 12] * 2
    assert buf.positions.tolist() == [63, 64, 64, 5, 6, 7] + [63, 64, 64] * 2
    assert buf.kda_slots.tolist() == [3, st.token_slot(3, 1), -1, 1, st.token_slot(1, 1), st.token_slot(1, 2)] + [
        -1] * 6
    assert buf.slot_mapping.tolist() == [4 * PAGE + 63, 9 * PAGE, 9 * PAGE, 2 * PAGE + 5, 2 * PAGE + 6,
                                         2 * PAGE + 7] + [4 * PAGE + 63, 9 * PAGE, 9 * PAGE] * 2
    assert buf.src_tok.tolist() == [0, 1, 1, 3, 4, 5] + [0, 1, 1] * 2 and buf.live.tolist() == [1] * 12
    assert buf.real_rows.tolist() == [0, 1, 3, 4, 5] + [0] * 7 and buf.last_rows.tolist() == [1, 5, 1, 1]
    assert buf.tail_slots.tolist() == [3, 1, 3, 3]
    buf.commit.ints.copy_(vg._commit_inputs(VerifyBatch(mixed, [0, 3, 6], buf, [2, 3])))
    assert buf.commit.kept.tolist() == [2, 3, 2, 2]  # each sequence's own accepted length
    assert buf.commit.src.tolist() == [st.token_slot(3, 1), st.token_slot(1, 2)] + [st.token_slot(3, 1)] * 2
    # a plain decode or a prefill in the batch, or too many drafts: the eager path
    assert not vg.accepts([seqs[0], StepSeq(tokens=[1], start=5, slot=1, block_table=[2])])
    assert not vg.accepts([seqs[0], StepSeq(tokens=[1, 2, 3], start=5, slot=1, block_table=[2], logits="last")])
    assert not vg.accepts([StepSeq(tokens=[1] * (K + 2), start=5, slot=1, block_table=[2], logits="all", spec=True)])
    with pytest.raises(ValueError, match="distinct"):
        vg._host_inputs([seqs[0], seqs[0]], buf)
    with pytest.raises(ValueError, match="outside"):
        vg._host_inputs([StepSeq(tokens=[1, 2], start=63, slot=0, block_table=[0], spec=True)], buf)
    with pytest.raises(ValueError, match="vocabulary"):
        vg._host_inputs([StepSeq(tokens=[1, 10 ** 6], start=3, slot=0, block_table=[0], spec=True)], buf)

    pairs = [StepSeq(tokens=[21, 22, 23], start=62, slot=-1, block_table=[4, 9]),
             StepSeq(tokens=[24], start=7, slot=-1, block_table=[2])]
    assert mg.accepts(pairs) and not mg.accepts([StepSeq(tokens=[1] * (K + 3), start=1, slot=-1, block_table=[2])])
    mbuf = MTPBuffers(4, 3, 2, eng.model.config.d_model, torch.float32, eng.device)
    mbuf.ints.copy_(mg._host_inputs(pairs, mbuf))
    assert mbuf.tokens.tolist() == [21, 22, 23, 24, 24, 24] + [21, 22, 23] * 2
    assert mbuf.positions.tolist() == [62, 63, 64, 7, 7, 7] + [62, 63, 64] * 2
    assert mbuf.slot_mapping.tolist() == [4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE] + [2 * PAGE + 7] * 3 + [
        4 * PAGE + 62, 4 * PAGE + 63, 9 * PAGE] * 2
    assert mbuf.src_tok.tolist() == [0, 1, 2, 3, 3, 3] + [0, 1, 2] * 2
    assert mbuf.hid_rows.tolist() == [0, 1, 2, 3, 3, 3] + [0, 1, 2] * 2
    assert mbuf.out_rows.tolist() == [2, 3, 2, 2]
    with pytest.raises(ValueError, match="hidden"):
        mg.step(pairs, torch.zeros(3, eng.model.config.d_model))


def test_inert_runs_change_nothing(model_tok):
    """The warm-up inputs used before a capture (verify, its commit, MTP) leave every state, tail and page (MTP
    layer included) bit-identical."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    _Verifier(eng, _prompts([70, 3]), rounds=1)
    before = _state_tensors(eng) + [t.clone() for t in eng.pages.kv]
    vg, mg = eng.runner.verify_graphs, eng.runner.mtp_graphs
    vbuf, mbuf = vg.new_buffers(8, T, 2), mg.new_buffers(8, 2, 2)
    vg.fill_inert(vbuf)
    mg.fill_inert(mbuf)
    outs = vg.verify_forward(vbuf)
    vbuf.pre = outs[2:]
    vg._commit_inert(vbuf.commit)
    vg.commit_forward(vbuf)
    _, mtp_logits = mg.mtp_forward(mbuf)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(mtp_logits).all()
    assert all(torch.equal(x, y) for x, y in zip(before, _state_tensors(eng) + list(eng.pages.kv), strict=True))


def test_spec_forwards_do_no_host_sync(model_tok, monkeypatch, forbid_host_sync):
    """verify_forward and mtp_forward must be capturable: any Tensor -> Python conversion raises inside them."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    ver = _Verifier(eng, _prompts([70, 3, 9]), rounds=1)
    vg, mg = eng.runner.verify_graphs, eng.runner.mtp_graphs
    batch = ver.batch([[7] * K] * 3)
    vbuf, mbuf = vg._buffers(4, T, 2), mg._buffers(4, 2, 2)
    vbuf.ints.copy_(vg._host_inputs(batch, vbuf))
    vg.verify_forward(vbuf)  # first runs outside the patch: one-time probes (MoE) may sync
    pairs = [StepSeq(tokens=[9, 10], start=1 + 2 * n, slot=-1, block_table=[n]) for n in range(3)]
    mbuf.ints.copy_(mg._host_inputs(pairs, mbuf))
    mg.mtp_forward(mbuf)

    forbid_host_sync("a static step function")
    outs = vg.verify_forward(vbuf)
    vbuf.pre = outs[2:]
    vbuf.commit.ints.copy_(vg._commit_inputs(VerifyBatch(batch, [0, T, 2 * T, 3 * T], vbuf, [1, 2, T])))
    vg.commit_forward(vbuf)
    x, logits = mg.mtp_forward(mbuf)
    monkeypatch.undo()
    n_kda = len(eng.states.state)
    assert len(outs) == 2 + 6 * n_kda and outs[0].shape == (4 * T, eng.model.config.vocab_size)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(logits).all() and x.shape[0] == 4


def test_every_verify_sequence_must_be_committed(model_tok):
    """After a graph verify step the next step refuses to run until every sequence is committed (the batched commit
    runs with the last one); committing a sequence twice is an error."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    ver = _Verifier(eng, _prompts([9, 4]), rounds=2)
    out = eng.runner.step(ver.batch([[7] * K] * 2))
    eng.runner.commit_spec(0, 2, [])
    with pytest.raises(ValueError, match="already committed"):
        eng.runner.commit_spec(0, 2, [])
    with pytest.raises(RuntimeError, match="not committed"):
        eng.runner.step(ver.batch([[7] * K] * 2))
    eng.runner.commit_spec(1, 4, [])
    assert out.logits[0].shape == (T, eng.model.config.vocab_size)
    eng.runner.step([StepSeq(tokens=[3], start=ver.pos[0] + 2, slot=ver.slots[0], block_table=ver.tables[0])])


def test_engine_speculating_through_the_fast_path_equals_plain_greedy(model_tok):
    """k = 2, prefix caching on, requests joining a running batch, a second pass served from the cache: greedy output
    equals the non-speculative engine's, drafts are accepted, and verify and MTP steps went through the fast path."""
    prompts = _prompts([5, 62, 64, 100, 30], seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _serve(_engine(model_tok, k=0), prompts, params)
    eng = _engine(model_tok, k=2)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
    assert _serve(eng, prompts, params) == plain
    assert _serve(eng, prompts, params, stagger=False) == plain  # prefix hits (snapshots from commit_spec)
    vg, mg, m = eng.runner.verify_graphs, eng.runner.mtp_graphs, eng.metrics
    assert vg.calls >= 10 and mg.calls >= 20
    assert any(key[0] >= 4 for key in vg.shapes)  # batched verify steps
    assert 0 < m.get("k3:spec_decode_num_accepted_tokens") <= m.get("k3:spec_decode_num_draft_tokens")
    assert m.get("k3:prefix_cache_hits") > 0


def test_engine_mixed_draft_counts_take_the_fast_path(model_tok):
    """k = 3 at batch > 1 with max_tokens that cut the drafts near each request's end, once all admitted together and
    once joining a running batch: greedy output equals the non-speculative engine's, and every all-verify step,
    mixed draft counts included, is served by the verify fast path (none runs eagerly)."""
    for lens, max_tokens, seed, stagger in (([21, 42, 15, 12, 45], (7, 9, 7, 6, 14), 1, False),
                                            ([29, 64, 59, 69], (13, 6, 10, 11), 2, True)):
        prompts = _prompts(lens, seed=seed)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        plain = _serve(_engine(model_tok, k=0), prompts, params, stagger)
        eng = _engine(model_tok, k=3)
        eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False)
        vg, runner_step = eng.runner.verify_graphs, eng.runner.step
        steps = []  # per all-verify step: (distinct token counts, batch size, steps the fast path served)

        def counting_step(seqs, vg=vg, runner_step=runner_step, steps=steps):
            calls = vg.calls
            out = runner_step(seqs)
            if all(s.spec for s in seqs):
                steps.append((len({len(s.tokens) for s in seqs}), len(seqs), vg.calls - calls))
            return out

        eng.runner.step = counting_step
        assert _serve(eng, prompts, params, stagger) == plain
        mixed = [st for st in steps if st[0] > 1]
        assert len(mixed) >= 1 and all(b > 1 for _, b, _ in mixed)  # the case this fast path exists for
        assert [served for *_, served in steps] == [1] * len(steps)  # eager all-verify steps: 0


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
    vg = eng.runner.verify_graphs
    assert vg.num_graphs >= 1 and all(b.graph is not None and not b.failed for b in vg.shapes.values())
    assert all(b.commit.graph is not None for b in vg.shapes.values())  # the batched rollback replays too


@pytest.mark.cuda
def test_cuda_mtp_graph_replay_equals_eager(model_tok):
    model, tok = model_tok
    eng = _twin_mtp((copy.deepcopy(model), tok), capture=True, device="cuda", tol=1e-4)
    mg = eng.runner.mtp_graphs
    assert mg.num_graphs >= 3 and all(b.graph is not None and not b.failed for b in mg.shapes.values())


def test_compile_covers_verify_not_mtp_graphs(model_tok):
    """compile_decode compiles the verify step (a whole-model forward) but not the MTP draft calls (one layer, k + 2
    lengths per batch size: minutes of startup for little)."""
    eng = _engine(model_tok)
    eng.runner.enable_decode_graphs(MAX_LEN // PAGE, capture=False, compile=True)
    assert eng.runner.graphs._compiled_fn is not None and eng.runner.verify_graphs._compiled_fn is not None
    assert eng.runner.mtp_graphs._compiled_fn is None
