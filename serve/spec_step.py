"""One-sync greedy speculative step ("device acceptance"; serving.md 2.4 and 2.5).

The host path of a speculative step (the engine over k3.serve.verify and k3.serve.proposer) reads the device three
times or more: the verify logits' argmax, the MTP catch-up's first draft, each further draft. On a GPU each read
idles the device for the host work that follows it. For a step whose sequences all verify every draft of a plain
greedy request, `OneSyncStep.run` does the whole step on the device and reads the host once, at its end:

1. verify forward through the verify graph (GraphRunner.launch_verify), as the host path;
2. acceptance: a = argmax of the verify logits [B, T]; kept = 1 + the leading matches of a[:, :k] with the drafts
   (the step's tokens 1..k, read from the verify buffers), [B] in 1..T (k3.serve.verify.accept_lengths);
3. the rollback (static.commit_forward), its kept and src (= StatePool.token_slot(slot, kept - 1),
   verify.commit_src) written into the commit buffers by device ops;
4. the MTP catch-up with all P = k + 2 pairs of every row, a fixed shape whatever kept is: pair r at MTP slot
   start + r is (h_{start+r-1}, x_r), x_0 = the step's first token, x_r = a[:, r-1]; hidden rows [the carried
   hidden, verify hidden rows 0..k]. Pairs r <= kept are exactly the host path's (for greedy an accepted draft equals
   a's entry there); pairs past kept sit in slots that the drafts or the next catch-up overwrite before any query
   reads them (a query at slot j reads slots <= j only). The first draft is the MTP argmax at pair kept;
5. drafts 2..k: one-pair MTP calls whose token (the previous draft), position (start + kept + r) and latent row
   (verify.latent_rows) are written into the MTP buffers on the device; the hidden is the previous call's output;
6. the next carried hidden <- verify hidden row kept - 1 (a device gather);
7. ONE host read: a, kept and the drafts in one tensor. The engine then does its host bookkeeping.

Steps 2-6 run as one function of static buffers (`post_forward`), captured in ONE CUDA graph per shape (the graph
runner's pool and cap): on an H200 (trained k3-tiny, batch 1, k = 2) a one-sync step took 4.12 ms with them as ~35
small eager ops and three more graph launches, of which the verify forward was 2.73 ms. Without a post graph for
the shape (graph cap, failed capture, or `fused` off) they are issued one by one (`_device_step`).

Post-function inputs (a shape is the verify shape (Bv, T, Gv) and the MTP shapes (Bm, P, Gm) and (Bm, 1, Gm)): the
verify outputs (logits [Bv * T, V_] fp32, padded hidden [Bv * T, D], pre-conv inputs), the commit buffers host-filled
with placeholder kept = 1 (slots, rows = [0 .. B-1, 0, ...], live), the MTP buffers host-filled from placeholder
tokens, and h0 [Bm, D] (the carried hiddens, padded rows repeat row 0). Outputs: ints [Bm * T + Bm + Bm * k] =
(a [Bm, T], kept [Bm], drafts [Bm, k]) and h_next [Bm, D], static when captured.

Padded rows b >= B start from a zero KDA state (slot -1), so every per-row value (a, kept, src, hidden rows,
drafts) is gathered through the commit's `rows`: a padded row writes row 0's values at row 0's targets. A compiled
verify bucket may be larger than the MTP's own (Bm <= Bv; rows[:Bm] are the MTP rows' sources). Inert runs (the
warm-up before a capture): live = 0 everywhere, src = the slot itself, kept in 1..T, draft positions 1, so every
write puts back what it read.

Legend: B sequences, Bv verify batch bucket, Bm MTP batch bucket (<= Bv), k drafts, T = k + 1 verify tokens,
P = k + 2 MTP pairs per row, D width, V_ vocab, G pages per block table.
"""

from __future__ import annotations

import torch

from .graphs import COMMON_BATCHES, bucket
from .runner import ModelRunner
from .static import (
    MTPBuffers,
    StaticBuffers,
    StepBuffers,
    commit_forward,
    commit_inert,
    commit_layout,
    fill_inert,
    mtp_forward,
    mtp_layout,
)
from .step import StepSeq, VerifyRecord
from .verify import accept_lengths, commit_src, latent_rows


class PostBuffers(StaticBuffers):
    """The post function's static inputs of one shape: `vbuf` (verify, with its commit buffers and pre-conv
    outputs), `cbuf` / `dbuf` (the catch-up's and the one-pair drafts' MTP buffers; dbuf None for k = 1), h0 [Bm, D],
    pair0 [Bm] = n * P, ar [Bm] = n; `logits` / `hidden`: the verify outputs read (static when captured)."""

    def __init__(self, vbuf: StepBuffers, cbuf: MTPBuffers, dbuf: MTPBuffers | None, device: torch.device):
        super().__init__([], device)
        self.kind = "post"
        self.vbuf, self.cbuf, self.dbuf = vbuf, cbuf, dbuf
        Bm, P = cbuf.Bb, cbuf.T
        self.h0 = torch.zeros(Bm, cbuf.hidden_in.shape[1], dtype=cbuf.hidden_in.dtype, device=device)
        self.ar = torch.arange(Bm, device=device)
        self.pair0 = self.ar * P
        self.logits: torch.Tensor | None = None  # [Bv * T, V_]
        self.hidden: torch.Tensor | None = None  # [Bv * T, D]


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst [Bb, ...] <- src [B, ...] in rows < B, then src's row 0 in the padded rows (they repeat real row 0)."""
    B = src.shape[0]
    dst[:B].copy_(src)
    if dst.shape[0] > B:
        dst[B:].copy_(src[:1].expand(dst.shape[0] - B, *src.shape[1:]))


class OneSyncStep:
    """The one-sync step of a ModelRunner with k drafts per verify (module docstring)."""

    def __init__(self, runner: ModelRunner, k: int):
        self.runner, self.g, self.k = runner, runner.graphs, k
        self.fused = True  # steps 2-6 as one function (one graph per shape)
        self.post: dict[tuple, PostBuffers] = {}
        self.calls = 0  # steps served by the post function

    def shapes(self, seqs: list[StepSeq]) -> tuple | None:
        """The (verify, catch-up, draft) buffers of a step (None when a shape is unavailable), and the MTP calls'
        host layouts: everything but the device-written fields is known; placeholder tokens pass the host checks."""
        g, k = self.g, self.k
        T, P = k + 1, k + 2
        vbuf = g.buffers_for("verify", seqs, T)
        pairs = [StepSeq(tokens=[st.tokens[0]] * P, start=st.start, slot=-1, block_table=st.block_table) for st in seqs]
        singles = [StepSeq(tokens=[st.tokens[0]], start=st.start + 1, slot=-1, block_table=st.block_table)
                   for st in seqs]
        cbuf = g.buffers_for("mtp", pairs, P)
        dbuf = g.buffers_for("mtp", singles, 1) if k > 1 else None
        if vbuf is None or cbuf is None or (k > 1 and dbuf is None):
            return None
        return vbuf, cbuf, dbuf, pairs, singles

    @torch.no_grad()
    def run(self, seqs: list[StepSeq], hiddens: list[torch.Tensor]) -> tuple | None:
        """One step of verify sequences (each exactly 1 + k tokens of a plain greedy request, every draft slot up to
        start + 2k in its block table); hiddens: each sequence's carried main hidden h_{start-1} [D]. Returns
        (targets [B * T], kept [B], drafts [B * k] as host ints; h_next [B, D]), or None, having run nothing, when
        a shape is unavailable (the caller takes the host path). Leaves the step's VerifyRecord, committed, as
        runner.last_verify."""
        if not self.g.accepts_verify(seqs) or any(len(s.tokens) != self.k + 1 for s in seqs):
            return None
        shapes = self.shapes(seqs)
        if shapes is None:
            return None
        vbuf, cbuf, dbuf, pairs, singles = shapes
        B, T = len(seqs), self.k + 1
        pb = self._post_buffers(vbuf, cbuf, dbuf) if self.fused else None  # before the verify (a capture's inert
        if pb is not None:  # runs overwrite the shapes' input buffers)
            vals_t, h_pad = self._fused(seqs, pb, pairs, singles, hiddens)
            Bm, h_next = pb.cbuf.Bb, h_pad[:B].clone()  # static outputs: the next replay overwrites them
            vals = vals_t.tolist()  # 7. the one host read
        else:
            (vals, h_next), Bm = self._device_step(seqs, vbuf, cbuf, dbuf, pairs, singles, hiddens), B
        # the read's layout: a [Bm, T], kept [Bm], drafts [Bm, k]; rows >= B are padding
        k = self.k
        targets, kept, drafts = vals[:B * T], vals[Bm * T:Bm * T + B], vals[Bm * (T + 1):Bm * (T + 1) + B * k]
        self.runner.last_verify.kept = kept  # committed on the device: the record now holds the real lengths
        return targets, kept, drafts, h_next

    def _record(self, seqs, vbuf, outs) -> VerifyRecord:
        """The runner's record of a verify forward of `seqs`, with placeholder lengths (kept = 1) for the commit's
        host fields."""
        B, T = len(seqs), vbuf.T
        rec = VerifyRecord(seqs, list(range(0, B * T + 1, T)), outs[1], vbuf, [1] * B)
        self.runner.last_verify = rec
        return rec

    def _fused(self, seqs, pb: PostBuffers, pairs, singles, hiddens) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-6 through the post function of `pb`: the verify forward, then every host input of the commit and
        MTP calls and h0 copied in, and the post function run (replayed). Returns post_forward's outputs."""
        g, vb = self.g, pb.vbuf
        self.calls += 1
        outs = g.launch_verify(seqs, vb)  # 1. verify forward
        rec = self._record(seqs, vb, outs)
        pb.logits, pb.hidden = outs[0], outs[1]
        hosts = [(vb.commit, commit_layout(rec, self.runner.states.token_slot)),
                 (pb.cbuf, mtp_layout(pairs, pb.cbuf, g.geom))]
        if pb.dbuf is not None:
            hosts.append((pb.dbuf, mtp_layout(singles, pb.dbuf, g.geom)))
        for buf, host in hosts:
            if pb.graph is not None:
                buf.ints.copy_(host.pin_memory(), non_blocking=True)  # stream-ordered before the replay
            else:
                buf.ints.copy_(host)
        rows = [h.to(pb.h0.dtype) for h in hiddens]
        torch.stack(rows + rows[:1] * (pb.h0.shape[0] - len(rows)), out=pb.h0)
        if pb.graph is not None:
            pb.graph.replay()
            return pb.outputs
        return self.post_forward(pb)

    def _device_step(self, seqs, vbuf, cbuf, dbuf, pairs, singles, hiddens) -> tuple[list[int], torch.Tensor]:
        """Steps 1-7 issued one by one. Returns (the host read: targets [B * T], kept [B], drafts [B * k], as one
        list; the next carried hidden rows [B, D])."""
        g, r, k = self.g, self.runner, self.k
        T, P, B = k + 1, k + 2, len(seqs)
        outs = g.launch_verify(seqs, vbuf)  # 1. verify forward
        rec = self._record(seqs, vbuf, outs)
        tok_BT = vbuf.tokens.view(vbuf.Bb, T)[:B]  # the step's tokens (static input buffer)
        start_B = vbuf.positions.view(vbuf.Bb, T)[:B, 0]
        h_BTD = outs[1][:B * T].view(B, T, -1)
        # 2. acceptance
        a_BT = outs[0][:B * T].argmax(-1).view(B, T)  # [B, T] the target's greedy tokens
        kept_B = accept_lengths(a_BT, tok_BT[:, 1:])  # [B] in 1..T
        # 3. rollback: host fields (slots, rows, live) from placeholder lengths, then kept and src by device ops
        c, states = vbuf.commit, r.states

        def put_commit() -> None:
            _put(c.kept, kept_B)
            _put(c.src, commit_src(kept_B, c.slots[:B], states.num_slots, states.spec_tokens))

        g.commit(rec, prepare=put_commit)
        # 4. MTP catch-up: P pairs per row, the first draft at pair kept
        h0 = torch.stack(hiddens).to(h_BTD.dtype)  # [B, D] h_{start-1}
        hid = torch.cat([h0[:, None], h_BTD], 1).flatten(0, 1).to(g.dtype)  # [B * P, D] packed as the pairs
        x_BP = torch.cat([tok_BT[:, :1], a_BT], 1)  # [B, P] x_0 = first token, x_r = a[:, r-1]
        rows = torch.arange(B, device=r.device)

        def put_pairs() -> None:
            _put(cbuf.tokens.view(cbuf.Bb, P), x_BP)
            _put(cbuf.out_rows, rows * P + kept_B)
            torch.index_select(hid, 0, cbuf.hid_rows, out=cbuf.hidden_in)

        x, logits = g.launch(cbuf, mtp_layout(pairs, cbuf, g.geom), put_pairs)
        drafts = [logits[:B].argmax(-1)]
        # 5. drafts 2..k: one pair per row, (previous MTP output, previous draft) at slot start + kept + r
        host = mtp_layout(singles, dbuf, g.geom) if k > 1 else None
        for i in range(1, k):
            pos = start_B + kept_B + i

            def put_draft(prev=drafts[-1], x=x, pos=pos) -> None:
                _put(dbuf.tokens, prev)
                _put(dbuf.positions, pos)
                _put(dbuf.slot_mapping, latent_rows(pos, dbuf.block_table[:B], g.page_size))
                torch.index_select(x, 0, dbuf.hid_rows, out=dbuf.hidden_in)

            x, logits = g.launch(dbuf, host, put_draft)
            drafts.append(logits[:B].argmax(-1))
        # 6. the next carried hidden: h at the last kept token
        h_next = h_BTD[rows, kept_B - 1]  # [B, D]
        # 7. the one host read
        return torch.cat([a_BT.flatten(), kept_B, torch.stack(drafts, 1).flatten()]).tolist(), h_next

    # ------------------------------------------------------------------------------------------ the post function

    def _post_buffers(self, vbuf: StepBuffers, cbuf: MTPBuffers, dbuf: MTPBuffers | None) -> PostBuffers | None:
        """The PostBuffers of this (verify, catch-up, draft) shape, captured first when graphs are on; None when the
        shapes do not fit one post function (MTP rows beyond the verify's, pairs != T + 1), the verify graph has no
        static outputs, the graph cap is reached or the capture failed: the caller runs `_device_step`."""
        g = self.g
        Bm, T = cbuf.Bb, vbuf.T
        if Bm > vbuf.Bb or cbuf.T != T + 1 or (T > 2) != (dbuf is not None) or (dbuf is not None and dbuf.Bb != Bm):
            return None
        key = ("post", vbuf.Bb, T, vbuf.Gb, Bm, cbuf.Gb, 0 if dbuf is None else dbuf.Gb)
        pb = self.post.get(key)
        if pb is None:
            if g.capture and (vbuf.outputs is None or g.used >= g.max_graphs):
                return None
            pb = self.post[key] = PostBuffers(vbuf, cbuf, dbuf, self.runner.device)
            if g.capture:  # the verify graph's static outputs are what every replay reads
                pb.logits, pb.hidden = vbuf.outputs[:2]
                vbuf.pre = vbuf.outputs[2:]
                g.capture_fn(pb, key, self.post_forward, self._post_inert)
        return None if pb.failed else pb

    @staticmethod
    def _post_inert(pb: PostBuffers) -> None:
        """Inputs whose run changes no cache (module docstring): each kind's own inert inputs, h0 zero."""
        fill_inert(pb.vbuf)
        commit_inert(pb.vbuf.commit)
        for buf in (pb.cbuf, pb.dbuf):
            if buf is not None:
                fill_inert(buf)
        pb.h0.zero_()

    def post_forward(self, pb: PostBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-6 on the static buffers (tensor ops only, capturable): acceptance, the rollback, the MTP catch-up
        and drafts 2..k, the next carried hidden. Returns (ints [Bm * T + Bm + Bm * k]: a, kept, drafts; h_next
        [Bm, D]); writes the KDA working states and tails and the MTP latents."""
        vb, cb, db = pb.vbuf, pb.cbuf, pb.dbuf
        c, Bv, T, Bm = vb.commit, vb.Bb, vb.T, cb.Bb
        k, P = T - 1, T + 1
        states, page, r = self.runner.states, self.g.page_size, self.runner
        rows = c.rows  # [Bv] row sources: n for real rows, 0 for padded ones (their verify started from zeros)
        # 2. acceptance per row, from its source row's logits
        a_BT = pb.logits.view(Bv, T, -1).argmax(-1).index_select(0, rows)  # [Bv, T]
        tok_BT = vb.tokens.view(Bv, T)  # the step's tokens; the host layout repeats row 0 in padded rows
        kept = accept_lengths(a_BT, tok_BT[:, 1:])  # [Bv] in 1..T
        # 3. rollback: kept and src by device ops; where live = 0 (an inert run) src is the slot itself
        c.kept.copy_(kept)
        c.src.copy_(torch.where(c.live != 0, commit_src(kept, c.slots, states.num_slots, states.spec_tokens),
                                c.slots))
        commit_forward(r, vb)
        # 4. MTP catch-up: P pairs per row (x_0 = the first token, x_r = a[r - 1]; hidden h0, verify rows 0..k)
        rm, km = rows[:Bm], kept[:Bm]  # [Bm]
        a_m = a_BT[:Bm]  # [Bm, T]
        cb.tokens.view(Bm, P).copy_(torch.cat([tok_BT[:Bm, :1], a_m], 1))
        cb.out_rows.copy_(pb.pair0 + km)  # the first draft: the MTP output at pair kept
        h_BTD = pb.hidden.view(Bv, T, -1).index_select(0, rm)  # [Bm, T, D]
        torch.cat([pb.h0[:, None], h_BTD.to(pb.h0.dtype)], 1, out=cb.hidden_in.view(Bm, P, -1))
        x, logits = mtp_forward(r, cb)  # [Bm, D], [Bm, V_]
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
                x, logits = mtp_forward(r, db)
                drafts.append(logits.argmax(-1).index_select(0, rm))
        # 6. the next carried hidden: the verify hidden at the last kept token
        h_next = h_BTD[pb.ar, km - 1]  # [Bm, D]
        return torch.cat([a_m.flatten(), km, torch.stack(drafts, 1).flatten()]), h_next

    def capture_common(self, batches=COMMON_BATCHES) -> None:
        """Warm-up, after the graph runner's: the post graph of each bucket of `batches` at T = 1 + k and the
        smallest page bucket, whose verify and MTP graphs the warm-up captured. No-op without capture."""
        g = self.g
        if not g.capture:
            return
        T, g1 = 1 + self.k, g.page_bucket(1)
        for b in batches:
            if b > g.max_seqs:
                continue
            Bb = bucket(b, g.max_seqs)
            vbuf = g.shapes.get(("verify", Bb, T, g1))
            cbuf = g.shapes.get(("mtp", Bb, T + 1, g1))
            dbuf = g.shapes.get(("mtp", Bb, 1, g1)) if T > 2 else None
            if vbuf is not None and cbuf is not None and (T == 2 or dbuf is not None) \
                    and not (vbuf.failed or cbuf.failed or (dbuf is not None and dbuf.failed)):
                self._post_buffers(vbuf, cbuf, dbuf)
