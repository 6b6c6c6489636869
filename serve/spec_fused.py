"""The one-sync speculative step's post-verify work as one fixed-shape function of static buffers, replayed from ONE
CUDA graph per shape (steps 2-6 of k3.serve.spec_fast's docstring; serving.md 2.4 and 2.5, issue 5).

Why: on an H200 (trained k3-tiny, batch 1, k = 2) a one-sync step took 4.12 ms, of which the verify forward was
2.73 ms; the rest was ~35 small eager ops (~10-20 us of host work each) and three more graph launches (commit, MTP
catch-up, MTP draft), issued while the GPU idled. Here all of it is `post_forward`, captured with the StaticGraphs
machinery (graphs.py: same memory pool and graph cap as the runner's other graphs), so a step is: host inputs copied
in, the verify replay, the post replay, one host read (k3.serve.spec_fast.fast_spec_step).

Inputs (static; a shape is the verify shape (Bv, T, Gv) and the MTP shapes (Bm, P, Gm) and (Bm, 1, Gm)):
- the verify graph's static outputs `logits` [Bv * T, V_] fp32, padded `hidden` [Bv * T, D] and pre-conv inputs
  (vbuf.pre, read by VerifyGraphs.commit_forward), and its input tokens and positions (host layout);
- the commit buffers vbuf.commit, host-filled by VerifyGraphs._commit_inputs with placeholder kept = 1: slots, rows
  (the row-source index: [0 .. B-1, 0, 0, ...]), live; `kept` and `src` are written here;
- the MTP buffers of the catch-up `cbuf` (P = k + 2 pairs per row) and of the one-pair drafts `dbuf` (k >= 2),
  host-filled by MTPGraphs._host_inputs from placeholder tokens; tokens, out_rows, hidden_in (and for the drafts
  positions and slot_mapping) are written here;
- h0 [Bm, D]: the sequences' SpecState.hidden (h_{start-1}), one host-side copy before the run (padded rows repeat
  row 0).
Outputs: ints [Bm * T + Bm + Bm * k] = (a [Bm, T], kept [Bm], drafts [Bm, k]) flattened, and h_next [Bm, D]; static
when captured (read or cloned before the next replay of any graph: they share one pool).

Padded rows b >= B. A padded verify row starts from a zero KDA state (slot -1), so its logits and hidden differ
from row 0's: every per-row value (a, kept, hence src; the hidden rows; the drafts) is gathered through the commit's
`rows`, so a padded row writes row 0's values at row 0's targets (graphs.py: duplicate indices get one value). The
host layouts already repeat row 0's tokens, positions, slots and block table. A compiled verify bucket may be
larger than the MTP's own (StaticGraphs.buffers_for routes to compiled buckets; MTP graphs are never compiled):
Bm <= Bv, and rows[:Bm] are the MTP rows' sources.

Inert runs (the warm-up before a capture, `fill_inert`): every buffer as the three graph kinds' own fill_inert
(live = 0 everywhere, no KDA slot named), and every device-written index stays valid: src = the slot itself where
live = 0 (the commit copies slot 0 onto itself and writes its tails back), kept in 1..T (the commit's gather and
out_rows n * P + kept in range), the drafts' positions 1 where live = 0 (latent row 1 of the table's first page, as
MTPGraphs.fill_inert); every latent write puts back what it read.

Legend: B sequences, Bv verify batch bucket, Bm MTP batch bucket (<= Bv), k drafts, T = k + 1 verify tokens,
P = k + 2 MTP pairs per row, D width, V_ vocab, G pages per block table.
"""

from __future__ import annotations

import torch

from .graphs import COMMON_BATCHES, StaticBuffers, StaticGraphs, bucket
from .spec_fast import accept_lengths, commit_src, latent_rows
from .spec_graphs import MTPBuffers, VerifyBuffers, VerifyGraphs


class PostBuffers(StaticBuffers):
    """The post-verify function's static inputs of one shape: `vbuf` (VerifyBuffers, with its commit buffers and
    pre-conv outputs), `cbuf` / `dbuf` (MTPBuffers of the catch-up and of the one-pair drafts; dbuf None for k = 1),
    h0 [Bm, D] (the carried hidden), pair0 [Bm] = n * P (each row's first catch-up pair), ar [Bm] = n; `logits` /
    `hidden`: the verify outputs read (the verify graph's static outputs when captured)."""

    def __init__(self, vbuf: VerifyBuffers, cbuf: MTPBuffers, dbuf: MTPBuffers | None, device: torch.device):
        super().__init__([], device)
        self.vbuf, self.cbuf, self.dbuf = vbuf, cbuf, dbuf
        Bm, P = cbuf.Bb, cbuf.T
        self.h0 = torch.zeros(Bm, cbuf.hidden_in.shape[1], dtype=cbuf.hidden_in.dtype, device=device)
        self.ar = torch.arange(Bm, device=device)
        self.pair0 = self.ar * P
        self.logits: torch.Tensor | None = None  # [Bv * T, V_]
        self.hidden: torch.Tensor | None = None  # [Bv * T, D]


class PostVerifyGraphs(StaticGraphs):
    """The post-verify graphs of a runner's speculative fast path (VerifyGraphs.post): `buffers(vbuf, cbuf, dbuf)`
    -> PostBuffers (captured on first use when graphs are on) or None (eager old path), then `run(pb, hosts, h0)`."""

    kind = "post-verify"

    def __init__(self, vg: VerifyGraphs):
        """Shares the verify graphs' runner, capture flag, memory pool and graph cap (GraphBudget); never compiled."""
        super().__init__(vg.runner, self.post_forward, 0, vg.capture, vg.max_graphs, False, vg.budget)
        self.vg, self.mg = vg, vg.runner.mtp_graphs

    def buffers(self, vbuf: VerifyBuffers, cbuf: MTPBuffers, dbuf: MTPBuffers | None) -> PostBuffers | None:
        """The PostBuffers of this (verify, catch-up, draft) shape, captured first when graphs are on; None when
        the shapes do not fit one post function (MTP rows beyond the verify's, pairs != T + 1), the verify graph
        has no static outputs, the graph cap is reached or the capture failed: the caller runs the eager path.
        Call it before the step's verify replay: a capture's inert runs overwrite the shapes' input buffers."""
        Bm, T = cbuf.Bb, vbuf.T
        if Bm > vbuf.Bb or cbuf.T != T + 1 or (T > 2) != (dbuf is not None) or (dbuf is not None and dbuf.Bb != Bm):
            return None
        key = (vbuf.Bb, T, vbuf.Gb, Bm, cbuf.Gb, 0 if dbuf is None else dbuf.Gb)
        pb = self.shapes.get(key)
        if pb is None:
            if self.capture and (vbuf.outputs is None or self.budget.used >= self.budget.max_graphs):
                return None
            pb = self.shapes[key] = PostBuffers(vbuf, cbuf, dbuf, self.runner.device)
            if self.capture:  # the verify graph's static outputs are what every replay reads
                pb.logits, pb.hidden = vbuf.outputs[:2]
                vbuf.pre = vbuf.outputs[2:]
                self._capture(pb, key)
        return None if pb.failed else pb

    @torch.no_grad()
    def run(self, pb: PostBuffers, hosts: list[tuple[StaticBuffers, torch.Tensor]],
            h0: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy each (buffers, CPU int64 host layout) of `hosts` in and h0 (B rows [D]; padded rows repeat row 0)
        into pb.h0, then replay the post graph or, without capture, run post_forward eagerly. Returns (ints,
        h_next) as post_forward (static when captured)."""
        self.calls += 1
        for buf, host in hosts:
            if self.capture:
                buf.ints.copy_(host.pin_memory(), non_blocking=True)  # stream-ordered before the replay
            else:
                buf.ints.copy_(host)
        rows = [h.to(pb.h0.dtype) for h in h0]
        torch.stack(rows + rows[:1] * (pb.h0.shape[0] - len(rows)), out=pb.h0)
        if pb.graph is not None:
            pb.graph.replay()
            return pb.outputs
        return self.post_forward(pb)

    def fill_inert(self, pb: PostBuffers) -> None:
        """Inputs whose run changes no cache (module docstring): each graph kind's own inert inputs, h0 zero."""
        self.vg.fill_inert(pb.vbuf)
        VerifyGraphs._commit_inert(pb.vbuf.commit)
        for buf in (pb.cbuf, pb.dbuf):
            if buf is not None:
                self.mg.fill_inert(buf)
        pb.h0.zero_()

    def post_forward(self, pb: PostBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-6 of k3.serve.spec_fast on the static buffers (tensor ops only, capturable): acceptance, the
        batched commit, the MTP catch-up and drafts 2..k, the next carried hidden. Returns (ints [Bm * T + Bm +
        Bm * k]: a, kept, drafts; h_next [Bm, D]); writes the KDA working states and tails and the MTP latents."""
        vb, cb, db = pb.vbuf, pb.cbuf, pb.dbuf
        c, Bv, T, Bm = vb.commit, vb.Bb, vb.T, cb.Bb
        k, P = T - 1, T + 1
        states, page = self.runner.states, self.page_size
        rows = c.rows  # [Bv] row sources: n for real rows, 0 for padded ones (their verify started from zeros)
        # 2. acceptance per row, from its source row's logits
        a_BT = pb.logits.view(Bv, T, -1).argmax(-1).index_select(0, rows)  # [Bv, T]
        tok_BT = vb.tokens.view(Bv, T)  # the step's tokens; the host layout repeats row 0 in padded rows
        kept = accept_lengths(a_BT, tok_BT[:, 1:])  # [Bv] in 1..T
        # 3. rollback: kept and src by device ops; where live = 0 (an inert run) src is the slot itself
        c.kept.copy_(kept)
        c.src.copy_(torch.where(c.live != 0, commit_src(kept, c.slots, states.num_slots, states.spec_tokens),
                                c.slots))
        self.vg.commit_forward(vb)
        # 4. MTP catch-up: P pairs per row (x_0 = the first token, x_r = a[r - 1]; hidden h0, verify rows 0..k)
        rm, km = rows[:Bm], kept[:Bm]  # [Bm]
        a_m = a_BT[:Bm]  # [Bm, T]
        cb.tokens.view(Bm, P).copy_(torch.cat([tok_BT[:Bm, :1], a_m], 1))
        cb.out_rows.copy_(pb.pair0 + km)  # the first draft: the MTP output at pair kept
        h_BTD = pb.hidden.view(Bv, T, -1).index_select(0, rm)  # [Bm, T, D]
        torch.cat([pb.h0[:, None], h_BTD.to(pb.h0.dtype)], 1, out=cb.hidden_in.view(Bm, P, -1))
        x, logits = self.mg.mtp_forward(cb)  # [Bm, D], [Bm, V_]
        drafts = [logits.argmax(-1).index_select(0, rm)]  # [Bm] padded rows take row 0's
        # 5. drafts 2..k: one pair per row at MTP slot start + kept + i (slot 1 where live = 0: an inert run)
        if db is not None:
            live = db.live != 0  # [Bm]
            start = vb.positions.view(Bv, T)[:Bm, 0]  # [Bm]
            for i in range(1, k):
                pos = torch.where(live, start + km + i, 1)
                db.tokens.copy_(drafts[-1])
                db.positions.copy_(pos)
                db.slot_mapping.copy_(latent_rows(pos, db.block_table, page))
                db.hidden_in.copy_(x.index_select(0, rm))
                x, logits = self.mg.mtp_forward(db)
                drafts.append(logits.argmax(-1).index_select(0, rm))
        # 6. the next carried hidden: the verify hidden at the last kept token
        h_next = h_BTD[pb.ar, km - 1]  # [Bm, D]
        return torch.cat([a_m.flatten(), km, torch.stack(drafts, 1).flatten()]), h_next


def post_graphs(runner) -> PostVerifyGraphs | None:
    """The runner's post-verify graphs (created on first use, kept on its VerifyGraphs), or None without the
    speculative fast path."""
    vg = runner.verify_graphs
    if vg is None or runner.mtp_graphs is None:
        return None
    if vg.post is None:
        vg.post = PostVerifyGraphs(vg)
    return vg.post


def capture_post_graphs(runner, batches=None) -> None:
    """Warm-up (ModelRunner.capture_decode_graphs, after the verify and MTP graphs): capture the post-verify graph
    of each bucket of `batches` (None: graphs.COMMON_BATCHES) at T = 1 + spec_tokens and the smallest page bucket,
    whose verify and MTP graphs capture_common captured. No-op without capture."""
    pg = post_graphs(runner)
    if pg is None or not pg.capture:
        return
    vg, mg, T = pg.vg, pg.mg, 1 + pg.vg.spec_tokens
    for b in COMMON_BATCHES if batches is None else batches:
        if b > vg.max_seqs:
            continue
        Bb = bucket(b, vg.max_seqs)
        vbuf = vg.shapes.get((Bb, T, vg.page_bucket(1)))
        cbuf = mg.shapes.get((Bb, T + 1, mg.page_bucket(1)))
        dbuf = mg.shapes.get((Bb, 1, mg.page_bucket(1))) if T > 2 else None
        if vbuf is not None and cbuf is not None and (T == 2 or dbuf is not None) \
                and not (vbuf.failed or cbuf.failed or (dbuf is not None and dbuf.failed)):
            pg.buffers(vbuf, cbuf, dbuf)


def fused_device_step(engine, batch, pb: PostBuffers, pairs, singles) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-6 of k3.serve.spec_fast for the engine step `batch` through the post-verify function of `pb`
    (from PostVerifyGraphs.buffers, obtained before this call): the verify forward, then every host input of
    the commit and MTP calls and h0 copied in and the post function run. pairs / singles: the MTP calls' host
    layouts (StepSeq with placeholder tokens). Returns post_forward's (ints [Bm * T + Bm + Bm * k], h_next [Bm, D]),
    static when captured; the runner's `_last` holds the step with placeholder lengths, which the caller sets."""
    r = engine.runner
    vg, mg = r.verify_graphs, r.mtp_graphs
    seqs = [st for _, st, _ in batch]
    vb = pb.vbuf
    outs = vg.launch(seqs, vb)  # 1. verify forward
    r._last = vg.last_context(seqs, vb, outs)
    r._last[0].kept = [1] * len(seqs)  # placeholders for the commit's host fields (slots, rows, live)
    pb.logits, pb.hidden = outs[0], outs[1]
    hosts = [(vb.commit, vg._commit_inputs(r._last[0])), (pb.cbuf, mg._host_inputs(pairs, pb.cbuf))]
    if pb.dbuf is not None:
        hosts.append((pb.dbuf, mg._host_inputs(singles, pb.dbuf)))
    return vg.post.run(pb, hosts, [engine._spec[id(seq)].hidden for seq, _, _ in batch])
