"""ModelRunner: one forward of a K3Model over a ragged batch, reading and writing the engine's pools.

Every step packs the new tokens of all scheduled sequences into one row [1, T, D] (T = sum of per-sequence token
counts: 1 for a decode, up to a chunk for a prefill), so norms, MLPs, MoE and AttnRes run once on all tokens. Only
the token mixers need per-sequence context:
- KDA: varlen kernels (`cu_seqlens`) starting from each sequence's pool slot; decode-sized steps use
  `fused_recurrent_kda` on the pool in place (`ssm_state_indices`), longer ones `chunk_kda`, which also yields the
  fp32 per-chunk states used as prefix snapshots at 64-token boundaries (kda.md section 8); every layer writes all
  of a step's snapshots with a fixed number of ops (k3.serve.prefill), and the chunk kernel gets the offsets as
  host ints too (`cu_seqlens_cpu`), so a prefill step's host work does not grow with its block boundaries.
- MLA: the new latents [c_kv ; k_rope] are written into each sequence's pages, then absorbed ("MQA") attention runs
  over the pages gathered by block table, with per-sequence causal masks (architecture.md 6.2). The same formula as
  `k3.model.mla.mla_absorbed_attention`, with a per-row query position and key length.
- Speculative decoding (serving.md 2.4): a verify sequence (`StepSeq.spec`) runs its KDA tokens through
  `fused_recurrent_kda` with per-token state slots (`ssm_state_indices` [N, S_max], the state after token t goes to
  `StatePool.token_slot(slot, t)`); its conv tails and state are set to the accepted length by `commit_spec` once
  the engine knows how many drafts survived. Rejected latents stay in the pages past the sequence's length and
  are overwritten later. `mtp_step` runs the MTP module over the same paged pools (its latent cache is one more
  page layer, see k3.serve.speculative for the slot convention).

The layer weights and the layer loop (K3Backbone.run_layers) are the model's own; this file supplies only the
mixers' cache plumbing. The module-level helpers (`final_logits`, `mla_project`, `mla_output`, `kda_output`) are
shared with the fixed-shape decode path of k3.serve.graphs, which serves steps of plain decodes when enabled
(`enable_decode_graphs`; on CUDA captured in CUDA graphs), and with the verify and MTP draft paths of
k3.serve.spec_graphs (enabled with it when the engine speculates).
Legend: N sequences, T packed tokens, Tn tokens of sequence n, S keys, D width, H heads, C kv_lora, R rope dim,
X = C + R, K = V KDA head dim, W conv kernel, G pages per sequence, V_ vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from k3.kernels.conv import causal_conv1d
from k3.kernels.dispatch import trusted_inputs
from k3.kernels.kda import chunk_kda, fused_recurrent_kda
from k3.kernels.kda.fused_recurrent import fused_recurrent_kda_pool_trusted
from k3.kernels.mla import paged_mla_decode, warm_up_paged_mla_decode
from k3.model.kda import RECURRENT_MAX_TOKENS, KimiDeltaAttention
from k3.model.mla import GatedMLA, apply_rope, rope_cos_sin
from k3.model.transformer import K3Model

from .cache import PagePool, SnapshotStore, StatePool
from .config import ServeConfig
from .prefill import snapshot_table, to_device, write_hidden, write_snapshots


@dataclass
class StepSeq:
    """The work of one sequence in one step."""

    tokens: list[int]  # new tokens [Tn]
    start: int  # absolute position of tokens[0] (= tokens already in the caches)
    slot: int  # KDA working slot
    block_table: list[int]  # latent pages covering positions [0, start + Tn)
    logits: str = "last"  # "last" | "all" | "none": which positions' logits to return
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (boundary position p, snapshot entry)
    spec: bool = False  # verify step: keep the KDA state after every token so drafts can be rolled back


@dataclass
class StepOutput:
    logits: list[torch.Tensor | None]  # per sequence: [1, V_] ("last"), [Tn, V_] ("all") or None; fp32
    hidden_last: torch.Tensor  # [N, D] final hidden (before the final norm) at each sequence's last token
    hidden: torch.Tensor | None = None  # [T, D] final hidden of every packed token (rows cu[n]:cu[n+1])
    cu: list[int] = field(default_factory=list)  # [N+1] packed row offsets


class ModelRunner:
    """Binds a K3Model to its pools. `step(seqs)` -> StepOutput."""

    def __init__(self, model: K3Model, pages: PagePool, states: StatePool, snaps: SnapshotStore | None,
                 serve_cfg: ServeConfig | None = None, max_pages: int = 0):
        """serve_cfg.cuda_graphs on a CUDA model: plain-decode steps replay CUDA graphs (k3.serve.graphs);
        max_pages: latent pages of one sequence at max_model_len (the largest page bucket)."""
        self.model, self.cfg = model, model.config
        self.pages, self.states, self.snaps = pages, states, snaps
        self.kda_index, self.mla_index = {}, {}  # layer index -> index into the pool lists
        for i, t in enumerate(self.cfg.layer_types):
            (self.kda_index if t == "kda" else self.mla_index)[i] = len(self.kda_index if t == "kda" else
                                                                      self.mla_index)
        self.device = next(model.parameters()).device
        self.mtp_layer = len(self.mla_index)  # the MTP's latents: the page layer after the main MLA layers
        self._last: tuple | None = None  # (ctx, hidden, per-KDA-layer pre-conv inputs) of the last verify step
        self.graphs = None  # k3.serve.graphs.DecodeGraphs when the decode fast path is on
        self.verify_graphs = None  # k3.serve.spec_graphs.VerifyGraphs / MTPGraphs: the speculative fast path
        self.mtp_graphs = None
        self.tail_graphs = None  # k3.serve.tail_graphs.TailGraphs: prefill chunks of 2..64 tokens, one call per length
        self.split_mixed_steps = False  # split decode + prefill steps without capture too (CPU tests of the split)
        if serve_cfg is not None and serve_cfg.cuda_graphs and self.device.type == "cuda":
            self.enable_decode_graphs(max_pages, capture=True, compile=serve_cfg.compile_decode)
        elif serve_cfg is not None and serve_cfg.compile_decode:
            logging.getLogger("k3.serve").warning(
                "compile_decode compiles the CUDA-graph decode step: it needs a CUDA device and cuda_graphs on "
                "(device %s, cuda_graphs %s); ignored", self.device.type, serve_cfg.cuda_graphs)

    def enable_decode_graphs(self, max_pages: int, capture: bool, compile: bool = False, spec: bool = True) -> None:
        """Serve steps whose sequences are all plain decodes through the static-buffer decode path of
        k3.serve.graphs (batch buckets up to the state pool's slots, page buckets up to `max_pages`); `capture`
        records CUDA graphs (CUDA only), else the same function runs eagerly (CPU tests); `compile` runs it through
        torch.compile first. With `spec` and a pool that holds speculative scratch states (and an MTP head), verify
        steps and MTP draft steps get the same treatment (k3.serve.spec_graphs), sharing the graph pool and cap;
        `compile` covers the verify steps (a whole-model forward like decode) but not the MTP draft calls (one
        layer, yet k + 2 lengths per batch size: compiling them would add minutes of startup for little). Steps of
        equal-length prefill tails (2..64 tokens, k3.serve.tail_graphs) always get it too, never compiled."""
        from .graphs import DecodeGraphs  # graphs (and tail_graphs) import this module's helpers
        from .tail_graphs import TailGraphs

        self.graphs = DecodeGraphs(self, max_pages, capture=capture, compile=compile)
        # prefill tails after a prefix hit: same pool and cap, captured on first use, never compiled
        self.tail_graphs = TailGraphs(self, max_pages, capture=capture, budget=self.graphs.budget)
        self.verify_graphs = self.mtp_graphs = None
        if spec and self.states.spec_tokens and self.model.mtp is not None and len(self.pages.kv) > self.mtp_layer:
            from .spec_graphs import MTPGraphs, VerifyGraphs

            kw = {"capture": capture, "budget": self.graphs.budget}
            self.verify_graphs = VerifyGraphs(self, max_pages, compile=compile, **kw)
            self.mtp_graphs = MTPGraphs(self, max_pages, compile=False, **kw)

    def capture_decode_graphs(self, batches=None) -> None:
        """Capture the decode (and verify / MTP draft) buckets of `batches` and the 64-token prefill chunks up to the
        largest of them now (engine warmup, before /health turns 200; None: k3.serve.graphs.COMMON_BATCHES); no-op
        when off."""
        if self.graphs is not None and self.graphs.capture and self.pages.kv:  # MLA kernel variants of any tail length
            c = self.cfg
            warm_up_paged_mla_decode(self.pages.kv[0], c.mla_num_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                                     next(self.model.parameters()).dtype)
        for g in (self.graphs, self.verify_graphs, self.mtp_graphs, self.tail_graphs):
            if g is not None:
                g.capture_common(*(() if batches is None else (tuple(batches),)))
        if self.verify_graphs is not None and self.verify_graphs.capture:  # the one-sync step's post-verify graphs
            from .spec_fused import capture_post_graphs  # spec_fused imports this module's helpers

            capture_post_graphs(self, batches)

    # ---------------------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> StepOutput:
        """Run all sequences' new tokens through the model; update pools; return the requested logits."""
        if self._last is not None and None in getattr(self._last[0], "kept", ()):
            raise RuntimeError("the last verify step was not committed: call commit_spec for each of its sequences "
                               "before the next step")
        for g in (self.graphs, self.tail_graphs):  # plain decodes, then equal-length prefill tails
            if g is not None and g.accepts(seqs):
                out = g.step(seqs)  # None: this shape falls back to the eager path below
                if out is not None:
                    self._last = None
                    return out
        if (out := self._split_step(seqs)) is not None:
            return out
        if self.verify_graphs is not None and self.verify_graphs.accepts(seqs):
            res = self.verify_graphs.step(seqs)  # (StepOutput, the context commit_spec reads) or None: eager
            if res is not None:
                out, self._last = res
                return out
        dev = self.device
        lens = [len(s.tokens) for s in seqs]
        ctx = _StepContext(seqs, lens, dev, self.pages.page_size,
                           snap_geometry=(self.cfg.kda_conv_kernel - 1, self.cfg.kda_chunk_size))
        x = self.model.model.embed_tokens(ctx.tokens)[None]  # [1, T, D]
        self._pre: dict[int, list] = {}
        hidden = self._backbone(x, ctx)[0]  # [T, D]
        ends = ctx.cu_t[1:] - 1
        if self.snaps is not None and self.snaps.hidden is not None and ctx.num_snapshots:
            # the hidden of the token before each boundary, for the MTP drafter
            write_hidden(self.snaps, ctx.snap["snap_entry"], ctx.snap["snap_hidden"], hidden)
        self._last = (ctx, hidden, self._pre) if any(s.spec for s in seqs) else None
        want = [i for i, s in enumerate(seqs) if s.logits != "none"]
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        if want:
            rows = torch.cat([torch.arange(ctx.cu[i], ctx.cu[i + 1], device=dev) if seqs[i].logits == "all"
                              else ends[i:i + 1] for i in want])
            out = final_logits(self.model, hidden[rows])
            off = 0
            for i in want:
                n = lens[i] if seqs[i].logits == "all" else 1
                logits[i] = out[off:off + n]
                off += n
        return StepOutput(logits=logits, hidden_last=hidden[ends], hidden=hidden, cu=ctx.cu)

    @property
    def graph_prefill(self) -> bool:
        """True when short prefills should come in graph chunks (64 tokens, then powers of two: k3.serve.engine,
        tail_graphs.prefill_chunk) and mixed steps run split (_split_step): CUDA graphs are captured, so a graph step
        beats an eager one by ~10x."""
        return self.tail_graphs is not None and (self.tail_graphs.capture or self.split_mixed_steps)

    def _split_step(self, seqs: list[StepSeq]) -> StepOutput | None:
        """A step run as several graph calls: the plain decodes through the decode graphs, then the prefill chunks,
        one tail-graph call per chunk length when every chunk is a plain one the tail graphs take (requests of
        different prompt lengths, or one joining running ones), else all chunks in one call (the tail graphs or
        eager). Outputs come back in the step's order. Sequences are independent (own slots and pages; shared prefix
        pages are only read), so the split changes no value, and the running streams keep their graph step instead
        of waiting for an eager whole-batch forward (on a GPU ~70 ms of host work for k3-small). None (one forward)
        when the graphs are off, a verify is in the step or the step has only one such part."""
        if not self.graph_prefill or any(s.spec for s in seqs):
            return None
        dec = [i for i, s in enumerate(seqs) if len(s.tokens) == 1 and s.logits == "last"]  # one-token prompt ends too
        rest = sorted(set(range(len(seqs))) - set(dec))
        parts = [dec] if dec else []
        if all(self.tail_graphs.accepts([seqs[i]]) for i in rest):  # plain chunks of 2..64 tokens: group by length
            by_len: dict[int, list[int]] = {}
            for i in rest:
                by_len.setdefault(len(seqs[i].tokens), []).append(i)
            parts += by_len.values()
        elif rest:
            parts.append(rest)
        if len(parts) < 2 or (dec and not self.graphs.accepts([seqs[i] for i in dec])):
            return None
        outs = []
        for part in parts:  # the decodes first: when their shape must run eagerly, nothing has run yet
            sub = [seqs[i] for i in part]
            out = self.graphs.step(sub) if part is dec else self.step(sub)  # a group never splits again
            if out is None:
                return None
            outs.append(out)
        self._last = None
        order = {i: (out, n) for part, out in zip(parts, outs) for n, i in enumerate(part)}
        rows, logits, lasts, cu = [], [], [], [0]
        for i in range(len(seqs)):
            out, n = order[i]
            a, b = out.cu[n], out.cu[n + 1]
            rows.append(out.hidden[a:b])
            logits.append(out.logits[n])
            lasts.append(out.hidden_last[n:n + 1])
            cu.append(cu[-1] + b - a)
        return StepOutput(logits=logits, hidden_last=torch.cat(lasts), hidden=torch.cat(rows), cu=cu)

    @torch.no_grad()
    def mtp_step(self, seqs: list[StepSeq], hidden_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward (architecture.md 10, same equations as k3.model.mtp.MTPModule) over packed pairs.

        seqs[n].tokens are the tokens t_j paired with hidden rows hidden_TD[cu[n]:cu[n+1]] = h_{j-1}, written at MTP
        slots j = start, start+1, ... of the sequence's pages (slot j holds the pair (h_{j-1}, t_j); slot 0 never
        holds one and is masked). Returns (pre-norm MTP output [N, D], fp32 logits [N, V_] of t_{j+1}) at each
        sequence's last pair."""
        if self.mtp_graphs is not None and self.mtp_graphs.accepts(seqs):
            out = self.mtp_graphs.step(seqs, hidden_TD)  # None: this shape falls back to the eager path below
            if out is not None:
                return out
        mtp = self.model.mtp
        lens = [len(s.tokens) for s in seqs]
        ctx = _StepContext(seqs, lens, self.device, self.pages.page_size)
        emb = self.model.model.embed_tokens(ctx.tokens)
        x = mtp.eh_proj(torch.cat([mtp.hnorm(hidden_TD), mtp.enorm(emb)], dim=-1))[None]  # [1, T, D]
        x = x + self._mla(self.mtp_layer, mtp.self_attn, mtp.input_layernorm(x), ctx, min_key=1)
        x = x + mtp.mlp(mtp.post_attention_layernorm(x))
        last = x[0, ctx.cu_t[1:] - 1]  # [N, D]
        return last, self.model.lm_head(mtp.norm(last)).float()

    def _backbone(self, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        """K3Backbone.forward with the mixers below; x [1, T, D] embedded tokens -> final hidden [1, T, D]."""
        return self.model.model.run_layers(x, lambda i, layer, h: self._mixer(i, layer, h, ctx))

    def _mixer(self, i: int, layer, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        if i in self.kda_index:
            return self._kda(self.kda_index[i], layer.self_attn, x, ctx)
        return self._mla(self.mla_index[i], layer.self_attn, x, ctx)

    # ---------------------------------------------------------------------------------------------------- KDA

    def _kda(self, li: int, attn: KimiDeltaAttention, x: torch.Tensor, ctx: _StepContext) -> torch.Tensor:
        """KDA over packed tokens x [1, T, D] from/to the sequences' slots; writes requested snapshots."""
        H, K = attn.num_heads, attn.head_k_dim
        slots = ctx.slots
        pool_tails = self.states.tails[li]
        qkv, pre = [], []
        for proj, conv, tail_pool in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                         (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d), pool_tails):
            p = proj(x)  # [1, T, C] pre-conv inputs
            tail0 = tail_pool[slots]  # [N, W-1, C]
            if ctx.uniform:  # N sequences of Tn tokens each: the batched conv ([N, Tn, C]), no varlen indexing
                N = len(ctx.seqs)
                y, tail1 = causal_conv1d(p.view(N, -1, p.shape[-1]), conv.weight[:, 0], activation="silu",
                                         initial_tail=tail0, output_final_tail=True)
                y = y.view(1, -1, y.shape[-1])
            else:
                with trusted_inputs():  # offsets built on the host by _StepContext
                    y, tail1 = causal_conv1d(p, conv.weight[:, 0], activation="silu", initial_tail=tail0,
                                             output_final_tail=True, cu_seqlens=ctx.cu_t)
            tail_pool[slots] = tail1.to(tail_pool.dtype)
            qkv.append(y.unflatten(-1, (H, K)))
            pre.append((tail0, p[0]))
        q, k, v = qkv
        z, b = attn.gate_input(x), attn.b_proj(x)
        verify = [n for n, s in enumerate(ctx.seqs) if s.spec]
        if not verify:
            o = self._kda_plain(li, attn, (q, k, v, z, b), ctx, None, pre)
        else:  # verify sequences and the others run separately (recurrences are per sequence), then merge
            self._pre[li] = pre
            plain = [n for n, s in enumerate(ctx.seqs) if not s.spec]
            o = torch.empty_like(v)
            o[:, ctx.rows(verify)] = self._kda_verify(li, attn, (q, k, v, z, b), ctx, verify)
            if plain:
                o[:, ctx.rows(plain)] = self._kda_plain(li, attn, (q, k, v, z, b), ctx, plain, pre)
        return kda_output(attn, x, o)

    @staticmethod
    def _kda_kwargs(attn: KimiDeltaAttention, cu_t: torch.Tensor) -> dict:
        return {**kda_gate_kwargs(attn), "cu_seqlens": cu_t}

    def _kda_plain(self, li, attn, inputs, ctx: _StepContext, group: list[int] | None, pre) -> torch.Tensor:
        """KDA of the sequences `group` (None = all) from/to their slots; writes requested snapshots.
        inputs: (q, k, v, z, b) of all packed tokens. Returns o [1, Tg, H, V] for the group's rows."""
        pool_state = self.states.state[li]
        idx = list(range(len(ctx.seqs))) if group is None else group
        if group is None:
            q, k, v, z, b = inputs
        else:
            rows = ctx.rows(group)
            q, k, v, z, b = (t[:, rows] for t in inputs)
        lens = [len(ctx.seqs[n].tokens) for n in idx]
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        if group is None:
            cu_t = ctx.cu_t
        else:  # built once per step, shared by every KDA layer
            key = ("cu", tuple(idx))
            if key not in ctx.memo:
                ctx.memo[key] = torch.tensor(cu, device=q.device)
            cu_t = ctx.memo[key]
        slots = ctx.slots if group is None else ctx.slots[idx]
        kw = self._kda_kwargs(attn, cu_t)
        interior = any(p < ctx.seqs[n].start + lens[i] for i, n in enumerate(idx) for p, _ in ctx.seqs[n].snapshots)
        final = hs = None
        if len(set(lens)) == 1 and lens[0] <= RECURRENT_MAX_TOKENS and not interior:
            # N sequences of Tn tokens (decode, or one prefill tail): the trusted pool entry on [N, Tn] rows (slots
            # checked on the host by _StepContext), in place, no host reads
            N, Tn = len(idx), lens[0]
            o = kda_pool_step(attn, *(t.reshape(N, Tn, *t.shape[2:]) for t in (q, k, v, z, b)), pool_state, slots)
            o = o.view(1, N * Tn, *o.shape[2:])
        elif max(lens) <= RECURRENT_MAX_TOKENS and not interior:
            # decode-sized: in place on the pool (the state after each sequence's last token lands in its slot);
            # trusted: offsets and slots were built and checked on the host (_StepContext), no device reads
            with trusted_inputs():
                o, _ = fused_recurrent_kda(q, k, v, z, b, initial_state=pool_state, ssm_state_indices=slots, **kw)
        else:
            with trusted_inputs():  # cu_seqlens_cpu: the kernel's chunk layout needs no read of the offsets
                o, final, hs = chunk_kda(q, k, v, z, b, initial_state=pool_state[slots], output_final_state=True,
                                         chunk_size=attn.chunk_size, safe_gate=attn.lower_bound is not None,
                                         return_intermediate_states=True, cu_seqlens_cpu=cu, **kw)
            pool_state[slots] = final
        if self.snaps is not None and ctx.num_snapshots:
            # every boundary of the step at once (k3.serve.prefill); interior ones come from the chunk states
            src, rows = ((pool_state, ctx.snap["snap_slot"]) if hs is None
                         else (torch.cat([hs[0], final]), ctx.snap["snap_chunk"]))
            write_snapshots(self.snaps, li, ctx.snap["snap_entry"], src, rows, ctx.snap["snap_tail"], pre)
        return o

    def _kda_verify(self, li, attn, inputs, ctx: _StepContext, group: list[int]) -> torch.Tensor:
        """Verify sequences: recurrent KDA writing the state after token t of sequence n to
        token_slot(slot_n, t) (vLLM's ssm_state_indices [N, S_max] convention, starting from the working slot)."""
        rows = ctx.rows(group)
        q, k, v, z, b = (t[:, rows] for t in inputs)
        key = ("verify", tuple(group))
        if key not in ctx.memo:  # built once per step, shared by every KDA layer
            lens = [len(ctx.seqs[n].tokens) for n in group]
            S_max = max(lens)
            idx = [[self.states.token_slot(ctx.seqs[n].slot, t) if t < L else -1 for t in range(S_max)]
                   for n, L in zip(group, lens)]
            cu = [0]
            for L in lens:
                cu.append(cu[-1] + L)
            ctx.memo[key] = (torch.tensor(idx, device=q.device), torch.tensor(cu, device=q.device),
                             torch.ones(len(group), dtype=torch.long, device=q.device))
        idx, cu_t, ones = ctx.memo[key]
        N, S_max = idx.shape
        if N * S_max == q.shape[1]:  # every sequence verifies S_max tokens: [N, S_max] rows, the trusted entry
            o = kda_pool_step(attn, *(t.view(N, S_max, *t.shape[2:]) for t in (q, k, v, z, b)),
                              self.states.state[li], idx)
            return o.view(1, N * S_max, *o.shape[2:])
        kw = self._kda_kwargs(attn, cu_t)
        with trusted_inputs():  # per-token slots are distinct by construction (StatePool.token_slot)
            o, _ = fused_recurrent_kda(q, k, v, z, b, initial_state=self.states.state[li], ssm_state_indices=idx,
                                       num_accepted_tokens=ones, **kw)
        return o

    def commit_spec(self, n: int, kept: int, snapshots: list[tuple[int, int]]) -> None:
        """After a verify step: sequence n of that step keeps its first `kept` tokens (>= 1). Write the snapshots
        at boundaries p in (start, start + kept] from the per-token states, then set the working slot's state and
        conv tails to those after token kept - 1 (rejected drafts roll back without recompute). Every verify
        sequence of the step must be committed before the next step: after a step served by the verify graphs,
        the states and tails of all its sequences are set in one batched call when the last one is committed."""
        ctx, hidden, pre_by_layer = self._last
        s = ctx.seqs[n]
        if not s.spec or not 1 <= kept <= len(s.tokens):
            raise ValueError(f"commit_spec: sequence {n} is not a verify sequence of {len(s.tokens)} tokens "
                             f"or kept={kept} is out of range")
        batched = getattr(ctx, "kept", None)  # k3.serve.spec_graphs.VerifyBatch: accepted lengths collected
        for li, pre in pre_by_layer.items():
            if batched is not None and not snapshots:
                break
            pool_state, pool_tails = self.states.state[li], self.states.tails[li]
            W1 = pre[0][0].shape[1]
            xps = [torch.cat([tail0[n], p_TC[ctx.cu[n]:ctx.cu[n + 1]].to(tail0.dtype)]) for tail0, p_TC in pre]
            for p, entry in snapshots:
                j = p - s.start  # tokens consumed at the boundary
                self.snaps.write(entry, li, pool_state[self.states.token_slot(s.slot, j - 1)],
                                 tuple(xp[j:j + W1] for xp in xps))
            if batched is not None:
                continue
            if kept > 1:
                pool_state[s.slot] = pool_state[self.states.token_slot(s.slot, kept - 1)]
            for dst, xp in zip(pool_tails, xps):  # [W-1 + Tn, C]: after `kept` tokens the tail is rows kept..
                dst[s.slot] = xp[kept:kept + W1]
        if self.snaps is not None and self.snaps.hidden is not None:
            for p, entry in snapshots:
                self.snaps.write_hidden(entry, hidden[ctx.cu[n] + p - s.start - 1])
        if batched is not None:
            if batched[n] is not None:
                raise ValueError(f"commit_spec: sequence {n} of this verify step was already committed")
            batched[n] = kept
            if None not in batched:  # the last one: every working slot and tail at once
                self.verify_graphs.commit(ctx)

    # ---------------------------------------------------------------------------------------------------- MLA

    def _mla(self, li: int, attn: GatedMLA, x: torch.Tensor, ctx: _StepContext, min_key: int = 0) -> torch.Tensor:
        """Absorbed MLA over packed tokens x [1, T, D]; new latents go to the pages first. Keys at positions below
        `min_key` are masked (the MTP's slot 0 holds no pair)."""
        H, R, C = attn.num_heads, attn.rope_dim, attn.kv_lora_rank
        q_lat, q_rope, latent = mla_project(attn, x, ctx.positions)
        kv_pool = self.pages.kv[li]  # [P, page, X]
        flat = kv_pool.view(-1, C + R)
        flat[ctx.slot_mapping] = latent.to(flat.dtype)
        o_lat = torch.empty_like(q_lat)
        for rows, seq_ids, t_max, bt in ctx.groups:  # equal short lengths batched together; long chunks alone
            ql = q_lat[rows].view(len(seq_ids), t_max, H, C)
            qr = q_rope[rows].view(len(seq_ids), t_max, H, R)
            qpos = ctx.positions[rows].view(len(seq_ids), t_max)
            # paged kernel (k3.kernels.mla): reads the pages in place on the triton backend, gathers on torch
            o_lat[rows] = paged_mla_decode(ql, qr, kv_pool, bt, qpos, scale=attn.softmax_scale,
                                           min_key=min_key).flatten(0, 1)
        return mla_output(attn, x, o_lat)


# -------------------------------------------------------------------------------------------------------- shared
# The pieces of one forward that do not touch the caches, shared with the decode graphs (k3.serve.graphs) so both
# paths run the model's modules in the same order with the same arithmetic.


def final_logits(model: K3Model, hidden_ND: torch.Tensor) -> torch.Tensor:
    """LM head over the final norm: hidden [N, D] (pre-norm) -> fp32 logits [N, V_]."""
    return model.lm_head(model.model.norm(hidden_ND)).float()


def kda_gate_kwargs(attn: KimiDeltaAttention) -> dict:
    """The KDA kernels' in-kernel gate, beta sigmoid and q/k L2 norm settings of layer `attn` (what every engine
    call passes)."""
    return {"A_log": attn.A_log, "dt_bias": attn.dt_bias, "lower_bound": attn.lower_bound,
            "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}


def kda_pool_step(attn: KimiDeltaAttention, q, k, v, z, b, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Recurrent KDA of B rows of T tokens ([B, T, ...] inputs) in place on the state pool, through the trusted
    entry (the caller checked `slots` on the host): slots [B] (state after the last token) or [B, T] (per token,
    speculative verification). Returns o [B, T, H, V]."""
    return fused_recurrent_kda_pool_trusted(q, k, v, z, b, pool=pool, ssm_state_indices=slots,
                                            **kda_gate_kwargs(attn))


def kda_output(attn: KimiDeltaAttention, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """KDA output stage: gated per-head RMSNorm of o [1, T, H, V] with the gate of x [1, T, D], then W_o."""
    H, K = attn.num_heads, attn.head_k_dim
    o = attn.o_norm(o, attn.g_proj(x).unflatten(-1, (H, K)))
    return attn.o_proj(o.flatten(-2))


def mla_project(attn: GatedMLA, x: torch.Tensor, positions_T: torch.Tensor):
    """MLA projections of packed tokens x [1, T, D] at positions [T] (architecture.md 6.2, absorbed form).
    Returns (q_lat [T, H, C] = q_nope absorbed through W_uk, q_rope [T, H, R] in q_lat's dtype, the new latents
    [T, X] = [c_kv ; k_rope] to write into the pages)."""
    T = x.shape[1]
    H, N, R, V, C = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, H, N + R)
    q_nope, q_rope = q.split([N, R], dim=-1)
    c_kv, k_rope = attn.kv_a_proj_with_mqa(x).split([C, R], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv)
    if attn.position == "rope" and R > 0:
        cos, sin = rope_cos_sin(positions_T, R, attn.rope_theta)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
    w_uk = attn.kv_b_proj.weight.view(H, N + V, C)[:, :N]
    q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)[0]  # [T, H, C]
    return q_lat, q_rope[0].to(q_lat.dtype), torch.cat([c_kv, k_rope], dim=-1)[0]


def mla_output(attn: GatedMLA, x: torch.Tensor, o_lat_THC: torch.Tensor) -> torch.Tensor:
    """MLA output stage: latent outputs [T, H, C] through W_uv, the optional sigmoid gate of x [1, T, D], W_o."""
    T = o_lat_THC.shape[0]
    H, N, V, C = attn.num_heads, attn.nope_dim, attn.v_dim, attn.kv_lora_rank
    w_uv = attn.kv_b_proj.weight.view(H, N + V, C)[:, N:]
    o = torch.einsum("thc,hvc->thv", o_lat_THC, w_uv).reshape(1, T, H * V)
    if attn.g_proj is not None:
        o = o * torch.sigmoid(attn.g_proj(x))
    return attn.o_proj(o)


class _StepContext:
    """Index tensors shared by all layers of one step, built on the host and sent to the device in ONE copy.

    A `torch.tensor(list, device="cuda")` is a blocking copy that waits for the queued GPU work; a step used to make
    several per layer. Here every index of the step (cu, slots, positions, latent slot mapping, each attention
    group's block table and packed rows, the KDA snapshot table) goes into one int64 host buffer, pinned on CUDA and
    copied without blocking (k3.serve.prefill.to_device), and the per-layer code slices it.
    snap_geometry: (conv width - 1, KDA chunk size) for a step that may write snapshots, else None."""

    def __init__(self, seqs: list[StepSeq], lens: list[int], dev, page_size: int,
                 snap_geometry: tuple[int, int] | None = None):
        self.seqs, self.max_len = seqs, max(lens)
        self.uniform = len(set(lens)) == 1  # every sequence brings the same number of tokens (decode, verify)
        self.memo: dict = {}  # per-step tensors the layers share (verify slot tables, group offsets)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.cu = cu
        slots = [s.slot for s in seqs]
        named = [x for x in slots if x >= 0]  # -1: no KDA slot (the MTP's steps)
        if len(set(named)) != len(named):  # the trusted recurrent kernels rely on it (no device-side check)
            raise ValueError(f"step: two sequences share a KDA slot: {slots}")
        pos, slot_map = [], []
        for s in seqs:
            ps, bt = range(s.start, s.start + len(s.tokens)), s.block_table
            pos += ps
            slot_map += [bt[p // page_size] * page_size + p % page_size for p in ps]
        by_len: dict = {}  # decodes (L = 1) and verify steps (L = 1 + drafts) of equal length attend together
        for n, L in enumerate(lens):
            by_len.setdefault(L if L <= _BATCHED_MAX_LEN else ("solo", n), []).append(n)
        parts = {"tokens": [t for s in seqs for t in s.tokens], "cu": cu, "slots": slots, "positions": pos,
                 "slot_mapping": slot_map}
        group_meta = []
        for gi, ns in enumerate(by_len.values()):
            G = max(len(seqs[n].block_table) for n in ns)
            parts[f"bt{gi}"] = [b for n in ns for b in seqs[n].block_table + [0] * (G - len(seqs[n].block_table))]
            parts[f"rows{gi}"] = [r for n in ns for r in range(cu[n], cu[n + 1])]
            group_meta.append((ns, lens[ns[0]], G))
        self.num_snapshots = sum(len(s.snapshots) for s in seqs) if snap_geometry is not None else 0
        if self.num_snapshots:  # which rows every KDA layer copies into the snapshot store (k3.serve.prefill)
            parts.update(snapshot_table(seqs, cu, *snap_geometry))
        get = to_device(parts, dev)
        self.snap = {name: t for name, t in get.items() if name.startswith("snap_")}
        self.tokens, self.cu_t, self.slots = get["tokens"], get["cu"], get["slots"]
        self.positions, self.slot_mapping = get["positions"], get["slot_mapping"]
        # (packed rows [sum Tn], sequence ids, tokens per sequence, block table [n, G]) per attention group
        self.groups = [(get[f"rows{gi}"], ns, t_max, get[f"bt{gi}"].view(len(ns), G))
                       for gi, (ns, t_max, G) in enumerate(group_meta)]

    def rows(self, group: list[int]) -> torch.Tensor:
        """Packed row indices of the sequences `group`, in order."""
        return torch.cat([torch.arange(self.cu[n], self.cu[n + 1], device=self.cu_t.device) for n in group])


_BATCHED_MAX_LEN = 16  # steps of at most this many tokens per sequence share one attention call per length
