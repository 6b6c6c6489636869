"""One-sync greedy speculative step ("device acceptance"; serving.md 2.4, issue 5).

The engine's speculative step (k3.serve.speculative) reads the device three times or more: the verify logits'
argmax (acceptance on the host, then the host builds the commit inputs), the MTP catch-up's first draft, and each
further draft. On a GPU each read idles the device for the host work that follows it. Here a step whose sequences
all verify every draft of a plain greedy request runs entirely on the device and reads the host once, at its end:

1. verify forward through the verify graph (ModelRunner.step -> VerifyGraphs.step), as the host path;
2. acceptance: a = argmax of the verify logits [B, T]; kept = 1 + the leading matches of a[:, :k] with the drafts
   (the step's tokens 1..k, read from the verify graph's static token buffer), [B] in 1..T (`accept_lengths`);
3. the rollback through the verify graph's batched commit (VerifyGraphs.commit), its kept and src
   (= StatePool.token_slot(slot, kept - 1), `commit_src`) written into the commit buffers by device ops;
4. the MTP catch-up with all P = k + 2 pairs of every row, a fixed shape whatever kept is: pair r at MTP slot
   start + r is (h_{start+r-1}, x_r), x_0 = the step's first token, x_r = a[:, r-1]; hidden rows [SpecState.hidden,
   verify hidden rows 0..k]. Pairs r <= kept are exactly the host path's (for greedy, a accepted draft equals a's
   entry there); pairs past kept sit in slots that the drafts or the next catch-up overwrite before any query reads
   them (k3.serve.speculative: a query at slot j only reads slots <= j, which are true pairs up to the committed
   length and the drafting chain's own pairs beyond). The first draft is the MTP argmax at pair kept (the MTP
   graph's out_rows written on the device: n * P + kept[n]);
5. drafts 2..k: one-pair MTP calls whose token (the previous draft), position (start + kept + r) and latent row
   (block_table[pos // page] * page + pos % page, `latent_rows`) are written into the MTP buffers on the device;
   the hidden is the previous call's MTP output, as MTPDrafter.run;
6. SpecState.hidden <- verify hidden row kept - 1 (a device gather);
7. ONE host read: a, kept and the drafts in one tensor; then the host path's bookkeeping (num_computed, acceptance
   metrics, drafts, the emit loop with its stop conditions).

Which steps qualify (`eligible`): every scheduled item is a verify sequence with exactly T = 1 + k tokens of a
`plain_greedy` request; no 64-token block boundary lies in (start, start + T + k] (no page or snapshot to publish,
so no snapshot in the step, and every draft slot lies in the current page); the next step gets k drafts whatever
the acceptance (num_drafts(k, ...) == k for kept = T, the worst case); the verify and MTP fast paths
(k3.serve.spec_graphs) serve the shapes. Every other step takes the host path unchanged. Engine.spec_fast = False
turns this path off (tests compare both).

Steps 2-6 run as one function of static buffers (k3.serve.spec_fused, one CUDA graph per shape, captured at warm-up
or on first use): a step is then the host inputs copied in, the verify replay, the post replay and the read. Without
a post function for the shape (graph cap, failed capture, or `engine.spec_fused = False`) `_device_step` issues
them one by one as below.

Padded batch rows b >= B repeat row 0 in every device-written field, as the host layouts of spec_graphs do.

Legend: B sequences, Bb batch bucket, k drafts, T = k + 1 verify tokens, P = k + 2 MTP pairs per row, D width,
V_ vocab, G pages per block table.
"""

from __future__ import annotations

import time

import torch

from .runner import StepSeq
from .sampling import plain_greedy
from .spec_graphs import VerifyBatch
from .speculative import num_drafts, record_acceptance


def accept_lengths(targets_BT: torch.Tensor, drafts_BK: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance on the device: kept [B] = 1 + the number of leading positions where the target's token
    targets [B, K + 1] (row j: the argmax after the step's tokens[:j+1]) equals the draft drafts [B, K]; tensor ops
    only (no host read). Same as speculative.accepted_prefix + 1 per row.

    Example: accept_lengths(tensor([[5, 7, 2, 4]]), tensor([[5, 7, 9]])) -> tensor([3])"""
    K = drafts_BK.shape[1]
    match = (targets_BT[:, :K] == drafts_BK).long().cumprod(1)  # [B, K]: 1 while every draft so far matched
    return match.sum(1) + 1


def commit_src(kept_B: torch.Tensor, slots_B: torch.Tensor, num_slots: int, spec_tokens: int) -> torch.Tensor:
    """StatePool.token_slot(slot, kept - 1) on the device, [B]: the working slot itself for kept = 1, else the
    scratch row num_slots + slot * spec_tokens + kept - 2 (the state after the last kept token)."""
    return torch.where(kept_B == 1, slots_B, num_slots + slots_B * spec_tokens + kept_B - 2)


def latent_rows(pos_B: torch.Tensor, table_BG: torch.Tensor, page: int) -> torch.Tensor:
    """Flat latent row [B] of position pos_B[n] through block table row n ([B, G]): table[pos // page] * page +
    pos % page, as _StepContext and spec_graphs compute on the host."""
    return table_BG.gather(1, (pos_B // page)[:, None])[:, 0] * page + pos_B % page


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst [Bb, ...] <- src [B, ...] in rows < B, then src's row 0 in the padded rows (they repeat real row 0)."""
    B = src.shape[0]
    dst[:B].copy_(src)
    if dst.shape[0] > B:
        dst[B:].copy_(src[:1].expand(dst.shape[0] - B, *src.shape[1:]))


def eligible(engine, batch) -> bool:
    """True when the engine step `batch` ((Sequence, StepSeq, publish) items) qualifies for the one-sync path (the
    module docstring lists the conditions; the graph buffers are checked by `fast_spec_step`)."""
    r, k = engine.runner, engine.drafter.k if engine.drafter is not None else 0
    if not k or not batch or r.verify_graphs is None or r.mtp_graphs is None:
        return False
    T, bs = k + 1, engine.block_size
    for seq, st, publish in batch:
        p = seq.params
        if (not st.spec or len(st.tokens) != T or publish or seq.status != "running" or not plain_greedy(p)
                or (st.start + T + k) // bs != st.start // bs):  # a block boundary in (start, start + T + k]
            return False
        if num_drafts(k, len(seq.output) + T, p.max_tokens, len(seq.all_tokens) + T, engine.max_model_len) != k:
            return False
    return r.verify_graphs.accepts([st for _, st, _ in batch])


@torch.no_grad()
def fast_spec_step(engine, batch, n_tok: int) -> bool:
    """Run the engine step `batch` on the one-sync path when it qualifies (`eligible` and every graph shape is
    served); returns False, having changed nothing, when it does not (the engine then takes the host path)."""
    if not eligible(engine, batch):
        return False
    r = engine.runner
    vg, mg, k = r.verify_graphs, r.mtp_graphs, engine.drafter.k
    T, P, B = k + 1, k + 2, len(batch)
    seqs = [st for _, st, _ in batch]
    vbuf = vg.buffers_for(seqs, T)
    if vbuf is None:
        return False
    for seq, st, _ in batch:  # draft slots up to start + 2k (kept = T); inside the current page (eligible)
        engine._grow(seq, st.start + 2 * k + 1)
    # host layouts for the MTP calls: everything but the device-written fields (tokens, out_rows; positions and
    # latent rows of the drafts) is known; placeholder tokens and positions pass the host checks
    pairs = [StepSeq(tokens=[st.tokens[0]] * P, start=st.start, slot=-1, block_table=st.block_table) for st in seqs]
    singles = [StepSeq(tokens=[st.tokens[0]], start=st.start + 1, slot=-1, block_table=st.block_table)
               for st in seqs]
    cbuf = mg.buffers_for(pairs, P)
    dbuf = mg.buffers_for(singles, 1) if k > 1 else None
    if cbuf is None or (k > 1 and dbuf is None):
        return False
    pb = None
    if engine.spec_fused:  # steps 2-6 as one function (one graph): k3.serve.spec_fused
        from .spec_fused import fused_device_step, post_graphs  # spec_fused imports this module's helpers

        pb = post_graphs(r).buffers(vbuf, cbuf, dbuf)  # before the verify replay (a capture fills inert inputs)
    with engine._threads(n_tok):
        if pb is not None:
            vals_t, h_pad = fused_device_step(engine, batch, pb, pairs, singles)
            Bm, h_next = pb.cbuf.Bb, h_pad[:B].clone()  # static outputs: the next replay overwrites them
            vals = vals_t.tolist()  # 7. the one host read
        else:
            (vals, h_next), Bm = _device_step(engine, batch, cbuf, dbuf, pairs, singles), B
    now = time.monotonic()
    if engine.record_metrics:
        engine.metrics.observe("k3:iteration_tokens_total", n_tok)
    # the read's layout: a [Bm, T], kept [Bm], drafts [Bm, k]; rows >= B are padding
    targets, kept, drafts = vals[:B * T], vals[Bm * T:Bm * T + B], vals[Bm * (T + 1):Bm * (T + 1) + B * k]
    r._last[0].kept = kept  # committed on the device: the runner's record of the step, now with the real lengths
    emitted = []
    for n, (seq, st, _) in enumerate(batch):
        seq.num_computed = st.start + kept[n]
        if engine.record_metrics:
            record_acceptance(engine.metrics, st.tokens[1:], kept[n] - 1)
        spec = engine._spec[id(seq)]
        spec.hidden, spec.drafts, spec.draft_q, spec.verify_q = h_next[n], drafts[n * k:(n + 1) * k], [], None
        emitted.append(targets[n * T:n * T + kept[n]])
    for (seq, _, _), toks in zip(batch, emitted):  # the host path's emit loop (stop conditions may finish seqs)
        for tok in toks:
            engine._append(seq, tok, None, now)
            if seq.status != "running":
                break
    return True


def _device_step(engine, batch, cbuf, dbuf, pairs, singles) -> tuple[list[int], torch.Tensor]:
    """Steps 1-7 of the module docstring. Returns (the host read: targets [B * T], kept [B], drafts [B * k], as
    one list; the next SpecState.hidden rows [B, D])."""
    r = engine.runner
    vg, mg, k = r.verify_graphs, r.mtp_graphs, engine.drafter.k
    T, P, B = k + 1, k + 2, len(batch)
    dev, page = r.device, r.pages.page_size
    out = r.step([st for _, st, _ in batch])  # 1. verify forward (VerifyGraphs.step, checked by fast_spec_step)
    vb = r._last[0] if r._last is not None else None
    if not isinstance(vb, VerifyBatch):  # fast_spec_step checked that the verify graphs serve this shape
        raise TypeError(f"one-sync speculative step: the verify step must run through the verify graphs (a "
                        f"VerifyBatch commit context), got {type(vb).__name__}")
    vbuf = vb.buf
    tok_BT = vbuf.tokens.view(vbuf.Bb, T)[:B]  # the step's tokens (static input buffer)
    start_B = vbuf.positions.view(vbuf.Bb, T)[:B, 0]
    # 2. acceptance
    a_BT = torch.cat(out.logits).argmax(-1).view(B, T)  # [B, T] the target's greedy tokens
    kept_B = accept_lengths(a_BT, tok_BT[:, 1:])  # [B] in 1..T
    # 3. rollback: host fields (slots, rows, live) from placeholder lengths, then kept and src by device ops
    vb.kept = [1] * B
    c, st_pool = vbuf.commit, r.states

    def put_commit() -> None:
        _put(c.kept, kept_B)
        _put(c.src, commit_src(kept_B, c.slots[:B], st_pool.num_slots, st_pool.spec_tokens))

    vg.commit(vb, prepare=put_commit)
    # 4. MTP catch-up: P pairs per row, the first draft at pair kept
    h_BTD = out.hidden.view(B, T, -1)
    h0 = torch.stack([engine._spec[id(seq)].hidden for seq, _, _ in batch]).to(h_BTD.dtype)  # [B, D] h_{start-1}
    hid = torch.cat([h0[:, None], h_BTD], 1).flatten(0, 1).to(mg.dtype)  # [B * P, D] packed as the pairs
    x_BP = torch.cat([tok_BT[:, :1], a_BT], 1)  # [B, P] x_0 = first token, x_r = a[:, r-1]
    rows = torch.arange(B, device=dev)

    def put_pairs() -> None:
        _put(cbuf.tokens.view(cbuf.Bb, P), x_BP)
        _put(cbuf.out_rows, rows * P + kept_B)
        torch.index_select(hid, 0, cbuf.hid_rows, out=cbuf.hidden_in)

    x, logits = mg._launch(cbuf, mg._host_inputs(pairs, cbuf), put_pairs)
    drafts = [logits[:B].argmax(-1)]
    # 5. drafts 2..k: one pair per row, (previous MTP output, previous draft) at slot start + kept + r
    host = mg._host_inputs(singles, dbuf) if k > 1 else None
    for i in range(1, k):
        pos = start_B + kept_B + i

        def put_draft(prev=drafts[-1], x=x, pos=pos) -> None:
            _put(dbuf.tokens, prev)
            _put(dbuf.positions, pos)
            _put(dbuf.slot_mapping, latent_rows(pos, dbuf.block_table[:B], page))
            torch.index_select(x, 0, dbuf.hid_rows, out=dbuf.hidden_in)

        x, logits = mg._launch(dbuf, host, put_draft)
        drafts.append(logits[:B].argmax(-1))
    # 6. the next SpecState.hidden: h at the last kept token
    h_next = h_BTD[rows, kept_B - 1]  # [B, D]
    # 7. the one host read
    return torch.cat([a_BT.flatten(), kept_B, torch.stack(drafts, 1).flatten()]).tolist(), h_next
