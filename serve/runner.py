"""ModelRunner: one engine step of a K3Model over the engine's pools (the model's own forward with paged cache views).

A step runs one of two ways:
- a static step (k3.serve.graphs: decodes, prefill chunks of equal length up to 64 tokens, speculative verify steps,
  MTP drafts), replayed from CUDA graphs on a GPU;
- the eager step here for everything else (prompts of different lengths, long prefill chunks, snapshots inside a
  chunk, prompt logprobs): the new tokens of all sequences packed into one row [1, T] (T = sum of per-sequence
  counts) with varlen offsets, or [N, Tn] rows when every sequence brings the same Tn (a lone prefill chunk too), so
  norms, MLPs, MoE and AttnRes run once on all tokens. The runner builds every index of the step on the host and
  sends them in one copy (`StepContext`), then hands the model one cache view per layer (k3.serve.cache).

A step mixing verify sequences with others runs as separate calls (sequences are independent: own slots and pages;
shared prefix pages are only read). With graph prefill on (CUDA graphs captured), a step mixing decodes with prefill
chunks also runs split: the decodes through their graph, each chunk length through its own, so the running streams
keep their graph step instead of waiting for an eager whole-batch forward (on a GPU ~70 ms of host work for k3-small).

Speculative decoding (serving.md 2.4): a verify step keeps the KDA state after every token in the scratch slots;
`commit_spec` sets the working state and conv tails to the accepted length once the engine knows it (rejected drafts
roll back without recompute; rejected latents stay in the pages past the sequence's length and are overwritten).
`mtp_step` runs the model's MTP block over the same pools (its latents are one more page layer).

Legend: N sequences, T packed tokens, Tn tokens of sequence n, D width, V_ vocab, G pages per sequence.
"""

from __future__ import annotations

import logging

import torch

from k3.model.cache import InferenceState, LatentGroup, PagedLatentView
from k3.model.mla import warm_up_paged_attention
from k3.model.transformer import K3Model

from .cache import PoolKDAView, SnapshotPlan, snapshot_table, to_device, write_hidden
from .config import ServeConfig
from .graphs import COMMON_BATCHES, GraphRunner
from .pools import PagePool, SnapshotStore, StatePool
from .step import StepOutput, StepSeq, VerifyRecord, merge_outputs

_BATCHED_MAX_LEN = 16  # eager steps: sequences of at most this many tokens share one attention call per length


class ModelRunner:
    """Binds a K3Model to its pools. `step(seqs)` -> StepOutput; `commit_spec` after a verify step; `mtp_step`."""

    def __init__(self, model: K3Model, pages: PagePool, states: StatePool, snaps: SnapshotStore | None,
                 serve_cfg: ServeConfig | None = None, max_pages: int = 0):
        """serve_cfg.cuda_graphs on a CUDA model: static steps replay CUDA graphs (k3.serve.graphs); max_pages:
        latent pages of one sequence at max_model_len (the largest page bucket)."""
        self.model, self.cfg = model, model.config
        self.pages, self.states, self.snaps = pages, states, snaps
        self.kda_index, self.mla_index = {}, {}  # layer index -> index into the pool lists
        for i, t in enumerate(self.cfg.layer_types):
            (self.kda_index if t == "kda" else self.mla_index)[i] = len(self.kda_index if t == "kda" else
                                                                      self.mla_index)
        self.device = next(model.parameters()).device
        self.mtp_layer = len(self.mla_index)  # the MTP's latents: the page layer after the main MLA layers
        self.last_verify: VerifyRecord | None = None  # the last verify step, until every sequence is committed
        capture = serve_cfg is not None and serve_cfg.cuda_graphs and self.device.type == "cuda"
        compile = serve_cfg is not None and serve_cfg.compile_decode
        if compile and not capture:
            logging.getLogger("k3.serve").warning(
                "compile_decode compiles the CUDA-graph steps: it needs a CUDA device and cuda_graphs on (device %s, "
                "cuda_graphs %s); ignored", self.device.type, serve_cfg.cuda_graphs)
        self.max_pages = max_pages
        self.graphs = GraphRunner(self, max_pages, capture=capture, compile=compile and capture)
        # plain steps through the static path: always when captured; on the CPU only when asked (tests)
        self.static_steps = capture
        self.split_mixed_steps = False  # split decode + prefill steps without capture too (CPU tests of the split)
        self.has_mtp_pages = model.mtp is not None and len(pages.kv) > self.mtp_layer

    def enable_static_steps(self, capture: bool = False, compile: bool = False) -> None:
        """Serve plain steps (and MTP drafts) through the static path, on a new graph runner: captured in CUDA graphs
        (`capture`, a CUDA model), else run eagerly on the buffers (the CPU tests of that path)."""
        self.graphs = GraphRunner(self, self.max_pages, capture=capture, compile=compile)
        self.static_steps = True

    def capture_graphs(self, batches=None) -> None:
        """Warm-up, before /health turns 200: the paged attention kernel's variants, then the common graphs
        (GraphRunner.capture_common; None: its default batches). No-op without capture."""
        if not self.graphs.capture:
            return
        if self.pages.kv:
            warm_up_paged_attention(self.pages.kv[0], self.cfg, next(self.model.parameters()).dtype)
        self.graphs.capture_common(COMMON_BATCHES if batches is None else tuple(batches))

    @property
    def graph_prefill(self) -> bool:
        """True when short prefills should come in graph chunks (64 tokens, then powers of two:
        graphs.prefill_chunk) and mixed steps run split: CUDA graphs are captured, so a graph step beats an eager
        one by ~10x."""
        return self.graphs.capture or self.split_mixed_steps

    # ---------------------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, seqs: list[StepSeq]) -> StepOutput:
        """Run all sequences' new tokens through the model; update pools; return the requested logits."""
        if self.last_verify is not None and None in self.last_verify.kept:
            raise RuntimeError("the last verify step was not committed: call commit_spec for each of its sequences "
                               "before the next step")
        self.last_verify = None
        verify = [i for i, s in enumerate(seqs) if s.spec]
        if verify and len(verify) < len(seqs):  # verify sequences and the others run as separate calls
            rest = [i for i in range(len(seqs)) if not seqs[i].spec]
            parts = [(verify, self._verify([seqs[i] for i in verify])), (rest, self._plain([seqs[i] for i in rest]))]
            return merge_outputs(parts, len(seqs))
        return self._verify(seqs) if verify else self._plain(seqs)

    def _verify(self, seqs: list[StepSeq]) -> StepOutput:
        if not self.graphs.accepts_verify(seqs) or (res := self.graphs.verify(seqs)) is None:
            raise ValueError(f"verify step: every sequence must verify 1 + 1..{self.states.spec_tokens} tokens with "
                             f"'all' logits and no snapshot, within the largest page bucket; got lengths "
                             f"{[len(s.tokens) for s in seqs]}")
        out, self.last_verify = res
        return out

    def _plain(self, seqs: list[StepSeq]) -> StepOutput:
        if self.static_steps and self.graphs.accepts_step(seqs) and (out := self.graphs.step(seqs)) is not None:
            return out
        if self.graph_prefill and (out := self._split_step(seqs)) is not None:
            return out
        return self._eager(seqs)

    def _split_step(self, seqs: list[StepSeq]) -> StepOutput | None:
        """A step run as several static calls: the plain decodes, then the prefill chunks, one call per chunk length
        when every chunk is one the static path takes (requests of different prompt lengths, or one joining running
        ones), else all chunks in one eager call. None (one forward) when the step has only one such part or its
        decodes cannot run static."""
        g = self.graphs
        dec = [i for i, s in enumerate(seqs) if len(s.tokens) == 1 and s.logits == "last"]
        rest = [i for i in range(len(seqs)) if i not in set(dec)]
        parts = [dec] if dec else []
        if all(g.accepts_step([seqs[i]]) for i in rest):  # chunks of 1..64 tokens: group by length
            by_len: dict[int, list[int]] = {}
            for i in rest:
                by_len.setdefault(len(seqs[i].tokens), []).append(i)
            parts += by_len.values()
        elif rest:
            parts.append(rest)
        if len(parts) < 2 or (dec and not g.accepts_step([seqs[i] for i in dec])):
            return None
        outs = []
        for part in parts:  # the decodes first: when their shape must run eagerly, nothing has run yet
            sub = [seqs[i] for i in part]
            out = g.step(sub) if g.accepts_step(sub) else None
            if out is None:
                if not outs:
                    return None
                out = self._eager(sub)
            outs.append((part, out))
        return merge_outputs(outs, len(seqs))

    def _eager(self, seqs: list[StepSeq]) -> StepOutput:
        """One eager forward of the step (module docstring)."""
        ctx = StepContext(seqs, self.device, self.pages.page_size, snap_geometry=(self.cfg.kda_conv_kernel - 1,
                                                                                 self.cfg.kda_chunk_size))
        tokens = ctx.tokens.view(len(seqs), -1) if ctx.batched else ctx.tokens[None]  # [N, Tn] or [1, T]
        hidden = self.model.hidden_states(tokens, self._eager_state(ctx)).flatten(0, 1)  # [T, D]
        if self.snaps is not None and self.snaps.hidden is not None and ctx.num_snapshots:
            # the hidden of the token before each boundary, for the MTP drafter
            write_hidden(self.snaps, ctx.snap["snap_entry"], ctx.snap["snap_hidden"], hidden)
        ends = ctx.cu_t[1:] - 1
        want = [i for i, s in enumerate(seqs) if s.logits != "none"]
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        if want:
            rows = torch.cat([torch.arange(ctx.cu[i], ctx.cu[i + 1], device=self.device) if seqs[i].logits == "all"
                              else ends[i:i + 1] for i in want])
            out = self.model.logits(hidden[rows]).float()
            off = 0
            for i in want:
                n = len(seqs[i].tokens) if seqs[i].logits == "all" else 1
                logits[i] = out[off:off + n]
                off += n
        return StepOutput(logits=logits, hidden_last=hidden[ends], hidden=hidden, cu=ctx.cu)

    def _eager_state(self, ctx: StepContext) -> InferenceState:
        """The per-layer cache views of an eager step."""
        plan = None
        if self.snaps is not None and ctx.num_snapshots:
            sn = ctx.snap
            plan = SnapshotPlan(self.snaps, sn["snap_entry"], sn["snap_slot"], sn["snap_chunk"], sn["snap_tail"])
        cu, cu_cpu = (None, None) if ctx.batched else (ctx.cu_t, ctx.cu)
        layers = []
        for i, kind in enumerate(self.cfg.layer_types):
            if kind == "kda":
                li = self.kda_index[i]
                layers.append(PoolKDAView(self.states.state[li], self.states.tails[li], ctx.slots, layer=li,
                                          cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, max_len=ctx.max_len,
                                          allow_recurrent=not ctx.interior, plan=plan))
            else:
                layers.append(ctx.latent_view(self.pages.kv[self.mla_index[i]]))
        return InferenceState(layers=layers)

    # ---------------------------------------------------------------------------------------------------- spec

    def commit_spec(self, st: StepSeq, kept: int, snapshots: list[tuple[int, int]]) -> None:
        """After a verify step: its sequence `st` keeps its first `kept` tokens (>= 1). Writes the snapshots at
        boundaries p in (start, start + kept] at once (from the per-token states and the pre-conv inputs); once every
        sequence of the step is committed, every working slot and conv tail is set to its accepted length in one
        batched call (GraphRunner.commit)."""
        rec = self.last_verify
        n = next((j for j, s in enumerate(rec.seqs) if s is st), None) if rec is not None else None
        if n is None:
            raise ValueError("commit_spec: this sequence was not in the last verify step")
        if not 1 <= kept <= len(st.tokens):
            raise ValueError(f"commit_spec: the sequence verified {len(st.tokens)} tokens, kept={kept} is out of "
                             "range")
        if rec.kept[n] is not None:
            raise ValueError(f"commit_spec: sequence {n} of this verify step was already committed")
        if snapshots:
            self._verify_snapshots(rec, n, snapshots)
        rec.kept[n] = kept
        if None not in rec.kept:  # the last one: every working slot and tail at once
            self.graphs.commit(rec)

    def _verify_snapshots(self, rec: VerifyRecord, n: int, snapshots: list[tuple[int, int]]) -> None:
        """Snapshots at boundaries inside a verify step of sequence n: the state after token j - 1 from its
        per-token slot, the conv tails from [tail0 ; pre-conv inputs], the MTP hidden from the verify hidden."""
        s, buf, T = rec.seqs[n], rec.buf, rec.buf.T
        for li in range(len(self.states.state)):
            xps = []
            for c in range(3):
                tail0, p = buf.pre[6 * li + 2 * c], buf.pre[6 * li + 2 * c + 1]  # [Bb, W1, C], [Bb * T, C]
                xps.append(torch.cat([tail0[n], p[n * T:(n + 1) * T].to(tail0.dtype)]))  # [W1 + T, C]
            W1 = buf.pre[0].shape[1]
            for p_, entry in snapshots:
                j = p_ - s.start  # tokens consumed at the boundary
                self.snaps.write(entry, li, self.states.state[li][self.states.token_slot(s.slot, j - 1)],
                                 tuple(xp[j:j + W1] for xp in xps))
        if self.snaps.hidden is not None:
            for p_, entry in snapshots:
                self.snaps.write_hidden(entry, rec.hidden[rec.cu[n] + p_ - s.start - 1])

    @torch.no_grad()
    def mtp_step(self, seqs: list[StepSeq], hidden_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward (the model's MTP block, K3Model.mtp_hidden) over packed pairs.

        seqs[n].tokens are the tokens t_j paired with hidden rows hidden_TD[cu[n]:cu[n+1]] = h_{j-1}, written at MTP
        slots j = start, start+1, ... of the sequence's pages (slot j holds the pair (h_{j-1}, t_j); slot 0 never
        holds one and is masked). Returns (MTP output before its norm [N, D], fp32 logits [N, V_] of t_{j+1}) at
        each sequence's last pair."""
        if self.static_steps and self.graphs.accepts_mtp(seqs):
            out = self.graphs.mtp(seqs, hidden_TD)
            if out is not None:
                return out
        ctx = StepContext(seqs, self.device, self.pages.page_size)
        view = ctx.latent_view(self.pages.kv[self.mtp_layer], min_key=1)
        x = self.model.mtp_hidden(hidden_TD[None], ctx.tokens[None], view)[0]  # [T, D]
        last = x[ctx.cu_t[1:] - 1]  # [N, D]
        return last, self.model.mtp_head(last).float()


class StepContext:
    """Index tensors shared by all layers of one eager step, built on the host and sent to the device in ONE copy.

    A `torch.tensor(list, device="cuda")` is a blocking copy that waits for the queued GPU work; every index of the
    step (tokens, cu, slots, positions, latent slot mapping, each attention group's block table and packed rows, the
    KDA snapshot table) goes into one int64 host buffer, copied without blocking (k3.serve.cache.to_device), and the
    per-layer views slice it. snap_geometry: (conv width - 1, KDA chunk size) for a step that may write snapshots."""

    def __init__(self, seqs: list[StepSeq], dev, page_size: int, snap_geometry: tuple[int, int] | None = None):
        lens = [len(s.tokens) for s in seqs]
        self.seqs, self.max_len = seqs, max(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.cu = cu
        slots = [s.slot for s in seqs]
        named = [x for x in slots if x >= 0]  # -1: no KDA slot (the MTP's steps)
        if len(set(named)) != len(named):  # the in-place recurrent kernels rely on it (no device-side check)
            raise ValueError(f"step: two sequences share a KDA slot: {slots}")
        # a snapshot inside a sequence's chunk needs the chunk kernel's per-chunk states
        self.interior = any(p < s.start + len(s.tokens) for s in seqs for p, _ in s.snapshots)
        # N sequences of Tn tokens each (one prefill chunk alone, decodes): [N, Tn] rows, no varlen offsets (the
        # in-place recurrent kernel up to 64 tokens, the chunk kernel beyond or with interior snapshots); a packed
        # row would take the conv's varlen gather, ~30 more tensor ops a conv (18 a step), host time on a GPU
        self.batched = len(set(lens)) == 1
        pos, slot_map = [], []
        for s in seqs:
            ps, bt = range(s.start, s.start + len(s.tokens)), s.block_table
            pos += ps
            slot_map += [bt[p // page_size] * page_size + p % page_size for p in ps]
        by_len: dict = {}  # decodes (L = 1) and short chunks of equal length attend together
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
        if self.num_snapshots:  # which rows every KDA layer copies into the snapshot store
            parts.update(snapshot_table(seqs, cu, *snap_geometry))
        get = to_device(parts, dev)
        self.snap = {name: t for name, t in get.items() if name.startswith("snap_")}
        self.tokens, self.cu_t, self.slots = get["tokens"], get["cu"], get["slots"]
        self.positions, self.slot_mapping = get["positions"], get["slot_mapping"]
        rows_all = len(group_meta) == 1 and len(group_meta[0][0]) == len(seqs)  # one group of every row, in order
        self.groups = [LatentGroup(None if rows_all else get[f"rows{gi}"], len(ns), t, get[f"bt{gi}"].view(len(ns), G),
                                   get["positions"][get[f"rows{gi}"]].view(len(ns), t))
                       for gi, (ns, t, G) in enumerate(group_meta)]

    def latent_view(self, kv_pool: torch.Tensor, min_key: int = 0) -> PagedLatentView:
        """One MLA layer's view of this step over its page pool."""
        return PagedLatentView(kv_pool, self.slot_mapping, self.positions, self.groups, min_key)
