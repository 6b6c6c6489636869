"""The one train loop shared by every training-like command (pretrain now; extend-context and distill later).

Per optimizer step: `grad_accum` micro-batches (forward, CE + lambda * MTP CE, backward), gradient clipping,
the optimizer step, QK-Clip on every MLA head whose max logit passed tau, and the router-bias update from this
step's routing (Quantile Balancing by default), which takes effect from the next step. Logging to metrics.jsonl,
evaluation, atomic checkpoints, SIGINT/SIGTERM -> checkpoint and clean exit, NaN/inf -> stop with a message.

Exact resume: model, optimizer, data position, RNG and step all live in the training checkpoint; on CPU a
resumed run reproduces the uninterrupted run's losses bit for bit (tested).
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from k3.kernels.loss import linear_cross_entropy
from k3.model.checkpoint import load_state_into
from k3.model.transformer import K3Model

from .balance import loss_free_update, qb_update_exact, qb_update_histogram_from_scores, router_stats
from .checkpoint import Checkpointer
from .config import CheckpointConfig, OptimConfig, TrainConfig
from .graphs import GraphedMicroSteps
from .optim import qk_clip_model_
from .schedule import lr_at, mtp_lambda_at


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, ...); the message names the step and the last good checkpoint."""


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # training tokens consumed (targets counted, incl. masked)
    best_val_loss: float | None = None
    wall_time: float = 0.0  # seconds of training in earlier segments of this run (before a resume)
    last_eval: dict = field(default_factory=dict)


def chunked_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden_BTD: torch.Tensor,
                          targets_BT: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean CE of head(hidden) [B, T, V] against targets [B, T] (-100 ignored), computed over chunks of
    `chunk_tokens` flattened tokens, each recomputed in the backward (torch.utils.checkpoint), so that only one
    chunk's fp32 logits exist at a time: at T = 131,072 and V = 32,768 the whole would be 16 GiB.
    Equals F.cross_entropy(head(hidden).float().flatten(0, 1), targets.flatten()) up to float summation order.
    """
    D = hidden_BTD.shape[-1]
    h_ND, t_N = hidden_BTD.reshape(-1, D), targets_BT.reshape(-1)

    def piece(h, t):
        z = head(h)
        return F.cross_entropy(z.to(torch.promote_types(z.dtype, torch.float32)), t, ignore_index=-100,
                               reduction="sum")

    total = sum(checkpoint(piece, h_ND[i:i + chunk_tokens], t_N[i:i + chunk_tokens], use_reentrant=False)
                for i in range(0, h_ND.shape[0], chunk_tokens))
    return total / (t_N != -100).sum()


def _targets(tokens_BT1: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    targets = tokens_BT1[:, 1:].clone()
    if mask_BT is not None:
        targets[~mask_BT] = -100
    return targets


def lm_losses(model: K3Model, tokens_BT1: torch.Tensor, mask_BT: torch.Tensor | None,
              with_mtp: bool = True, chunk_tokens: int = 0) -> dict[str, torch.Tensor]:
    """Next-token CE and MTP CE (t_{i+2}) for a packed batch tokens [B, T+1]; mask marks counted targets [B, T].

    with_mtp=False skips the MTP branch (evaluation, or lambda = 0: then MTP parameters get no gradient at all, so
    the step is bit-identical to a model without MTP, grad-norm reduction included). With a plain LM head
    (K3Model.plain_head_weight) both losses run the fused head + CE (k3.kernels.loss.linear_cross_entropy) over
    chunks of `chunk_tokens` tokens (0: its default), so the [B, T, V] logits never exist; another head (QAT's
    fake-quantized one) runs its own forward: over the whole logits, or chunk_tokens > 0 through
    `chunked_cross_entropy` (train.loss_chunk_tokens).
    """
    inputs, targets = tokens_BT1[:, :-1], _targets(tokens_BT1, mask_BT)
    use_mtp = with_mtp and model.mtp is not None
    # position i predicts t_{i+2} = targets[:, i+1]; the last position has no target
    mtp_t = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], -100)], dim=1) if use_mtp else None
    w_VD = model.plain_head_weight()
    if w_VD is not None:
        out = model(inputs, mtp_tokens_BT=tokens_BT1[:, 1:] if use_mtp else None, head=False)
        chunk = chunk_tokens or None
        res = {"ce": linear_cross_entropy(out.head_input.flatten(0, 1), w_VD, targets.flatten(), chunk)}
        if use_mtp:
            res["mtp_ce"] = linear_cross_entropy(out.mtp_head_input.flatten(0, 1), w_VD, mtp_t.flatten(), chunk)
        return res
    if chunk_tokens > 0:
        hidden = model.hidden_states(inputs)
        res = {"ce": chunked_cross_entropy(model.logits, hidden, targets, chunk_tokens)}
        if use_mtp:
            res["mtp_ce"] = chunked_cross_entropy(model.mtp_head, model.mtp_hidden(hidden, tokens_BT1[:, 1:]),
                                                  mtp_t, chunk_tokens)
        return res
    out = model(inputs, mtp_tokens_BT=tokens_BT1[:, 1:] if use_mtp else None)
    V = out.logits.shape[-1]
    res = {"ce": F.cross_entropy(out.logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-100)}
    if use_mtp:
        res["mtp_ce"] = F.cross_entropy(out.mtp_logits.float().reshape(-1, V), mtp_t.reshape(-1), ignore_index=-100)
    return res


@torch.no_grad()
def token_losses(model: K3Model, tokens_BT1: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    """Next-token CE in nats of every target [B, T] for tokens [B, T+1] (NaN where the mask leaves a target out):
    what `k3 eval loss` buckets by position."""
    targets = _targets(tokens_BT1, mask_BT)
    logits = model(tokens_BT1[:, :-1]).logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    return ce.masked_fill(targets == -100, float("nan"))


class Trainer:
    """Runs optimisation steps on `model` from `train_batches` (an iterator with state_dict/load_state_dict)."""

    def __init__(self, model: K3Model, optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig,
                 train_cfg: TrainConfig, ckpt_cfg: CheckpointConfig, run_dir: Path, train_loader,
                 val_batches: Callable[[], list], *, bytes_per_token: float | None, device: torch.device,
                 autocast_dtype: torch.dtype | None, flops_per_token: float | None = None,
                 peak_flops: float | None = None, on_log: Callable[[dict], None] | None = None,
                 extra_ckpt_info: Callable[[], dict] | None = None,
                 batch_loss: Callable[[K3Model, object], tuple[dict, int, dict]] | None = None):
        self.model, self.opt = model, optimizer
        self.ocfg, self.tcfg, self.ccfg = optim_cfg, train_cfg, ckpt_cfg
        self.run_dir = Path(run_dir)
        self.loader, self.val_batches = train_loader, val_batches
        self.bytes_per_token = bytes_per_token
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.device, self.autocast_dtype = device, autocast_dtype
        self.on_log = on_log or (lambda rec: None)
        self.ckpt = Checkpointer(ckpt_cfg, self.run_dir)
        self.state = LoopState()
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._stop_signal: int | None = None
        self.extra_ckpt_info = extra_ckpt_info or (dict)
        # another objective on the loader's own batches (k3 distill): batch_loss(model, batch) -> ({"ce": loss},
        # training tokens, floats logged with the step); None: next-token CE on (tokens, mask) batches
        self.batch_loss = batch_loss

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        s = self.state
        return self.ckpt.save(
            s.step, model_state=self.model.state_dict(), optim_state=self.opt.state_dict(),
            data_state=self.loader.state_dict(),
            extra={"tokens": s.tokens, "best_val_loss": s.best_val_loss, "wall_time": s.wall_time,
                   "last_eval": s.last_eval, **self.extra_ckpt_info()})

    def resume_from(self, path: Path) -> None:
        ck = self.ckpt.load(path)
        load_state_into(self.model, ck["model_state"])
        self.opt.load_state_dict(ck["optim_state"])
        self.loader.load_state_dict(ck["data_state"])
        ts = ck["train_state"]
        self.state = LoopState(step=int(ts["step"]), tokens=int(ts["tokens"]), best_val_loss=ts.get("best_val_loss"),
                               wall_time=float(ts.get("wall_time", 0.0)), last_eval=ts.get("last_eval") or {})
        self.ckpt.restore_rng(ck["rng"])

    # ---------------------------------------------------------------- helpers
    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        # autocast's cache of cast weights would hand a captured graph tensors freed after the capture
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype,
                              cache_enabled=not self.tcfg.cuda_graph)

    def _micro_step(self, tokens: torch.Tensor, mask: torch.Tensor | None, lam, with_mtp: bool) -> dict:
        """Forward, CE + lam * MTP CE (lam a float, or a device scalar inside a CUDA graph), backward of one
        micro-batch tokens [B, T+1] (mask [B, T] or None); returns the losses."""
        with self._autocast():
            losses = lm_losses(self.model, tokens, mask, with_mtp=with_mtp,
                               chunk_tokens=self.tcfg.loss_chunk_tokens)
        loss = losses["ce"] + (lam * losses["mtp_ce"] if "mtp_ce" in losses else 0.0)
        (loss / self.tcfg.grad_accum).backward()
        # detached: a loss kept by the caller would keep the parameters' AccumulateGrad nodes alive, and a CUDA
        # graph captured later on its own stream would then sync with theirs (an invalid capture)
        return {k: v.detach() for k, v in losses.items()}

    def _log(self, rec: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.on_log(rec)

    def _install_signals(self):
        def handler(signum, frame):
            self._stop_signal = signum
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return old

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean validation CE over the fixed validation batches, and bits per byte."""
        self.model.eval()
        total, count = 0.0, 0
        for tokens, mask in self.val_batches():
            tokens = tokens.to(self.device)
            mask = None if mask is None else mask.to(self.device)
            with self._autocast():
                losses = lm_losses(self.model, tokens, mask, with_mtp=False)
            n = int(mask.sum()) if mask is not None else tokens[:, 1:].numel()
            total += losses["ce"].item() * n
            count += n
        total, count = self._over_ranks(torch.tensor([total, count], dtype=torch.float64), "sum").tolist()
        self.model.train()
        val_loss = total / max(count, 1)
        rec = {"val_loss": val_loss}
        if self.bytes_per_token:
            rec["val_bpb"] = val_loss / math.log(2) / self.bytes_per_token
        return rec

    def _over_ranks(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """x summed, averaged or maxed ("sum" | "mean" | "max") over the data-parallel ranks (k3.train.parallel's
        trainer); x itself on one process."""
        return x

    def _balance_routers(self, scores_per_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
        """Router-bias update from this step's routing (applied from the next step) and routing statistics."""
        moes = self.model.moe_layers()
        violations, cvs = [], []
        for i, moe in enumerate(moes):
            chunks = scores_per_layer.get(i)
            if not chunks:
                continue
            scores = torch.cat([c[0] for c in chunks])  # [N, E] fp32, unbiased sigmoid scores of all micro-batches
            topk = torch.cat([c[1] for c in chunks])  # [N, K] the routes taken with the current bias
            bias = moe.gate.e_score_correction_bias
            k = moe.gate.top_k
            st = router_stats(topk, scores.shape[1])
            violations.append(float(st["max_violation"]))
            cvs.append(float(st["cv"]))
            method = self.ocfg.router_balance
            if method == "qb":
                if self.ocfg.qb_method == "exact":
                    new = qb_update_exact(scores, bias, k)
                else:
                    new = qb_update_histogram_from_scores(scores, bias, k, n_bins=self.ocfg.qb_bins)
                bias.copy_(new)
            elif method == "loss_free":
                bias.copy_(loss_free_update(st["load"].float(), bias, self.ocfg.loss_free_gamma))
        return {"router_max_violation": max(violations) if violations else 0.0,
                "router_cv": sum(cvs) / len(cvs) if cvs else 0.0}

    # ---------------------------------------------------------------- main loop
    def fit(self, progress=None) -> LoopState:
        """Train until train.max_steps (or a signal). Returns the final LoopState."""
        model, tcfg, ocfg = self.model, self.tcfg, self.ocfg
        model.train()
        moes = model.moe_layers()
        for m in moes:
            m.record_router = ocfg.router_balance != "none"
        mlas = model.mla_layers()
        for m in mlas:
            m.track_max_logit = tcfg.track_max_logit
        model.model.activation_checkpointing = tcfg.activation_checkpointing
        graphs = GraphedMicroSteps(model, self._micro_step, tcfg.grad_accum) if tcfg.cuda_graph else None
        self.graphs = graphs
        old_handlers = self._install_signals()
        t_seg = time.time()
        t_last, tok_last = time.time(), self.state.tokens
        last_ckpt = self.ckpt.latest()
        try:
            while self.state.step < tcfg.max_steps:
                step = self.state.step
                lr = lr_at(step, ocfg, tcfg.max_steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                lam = mtp_lambda_at(step, ocfg, tcfg.max_steps)
                scores_per_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
                # every per-micro-batch value stays on the device until the optimizer step is queued: one read back
                # a step, so the host queues the next micro-batch and the optimizer while the device still runs
                # (under train.cuda_graph the host would otherwise idle through each replay)
                max_logits = [torch.full((m.num_heads,), -float("inf"), device=self.device) for m in mlas]
                ce_parts: list[torch.Tensor] = []
                mtp_parts: list[torch.Tensor] = []
                step_tokens = 0
                stats: dict[str, list[float]] = {}
                for micro in range(tcfg.grad_accum):
                    if self.batch_loss is not None:
                        with self._autocast():
                            losses, n_tokens, extra = self.batch_loss(model, next(self.loader))
                        for k, v in extra.items():
                            stats.setdefault(k, []).append(v)
                        loss = losses["ce"] + (lam * losses["mtp_ce"] if "mtp_ce" in losses else 0.0)
                        (loss / tcfg.grad_accum).backward()
                    else:
                        tokens, mask = next(self.loader)
                        tokens = tokens.to(self.device, non_blocking=True)
                        mask = None if mask is None else mask.to(self.device, non_blocking=True)
                        if graphs is None:
                            losses = self._micro_step(tokens, mask, lam, lam > 0)
                        else:
                            if micro == 0:
                                graphed = graphs.begin_step(graphs.form_of(tokens, mask, lam > 0))
                            losses = graphs.run(tokens, mask, lam, lam > 0, graphed)
                        n_tokens = tokens[:, 1:].numel()
                    ce_parts.append(losses["ce"].detach().reshape(()))
                    if "mtp_ce" in losses:
                        mtp_parts.append(losses["mtp_ce"].detach().reshape(()))
                    step_tokens += n_tokens
                    for i, m in enumerate(moes):
                        if m.record_router and getattr(m, "last_scores", None) is not None:
                            scores_per_layer.setdefault(i, []).append((m.last_scores, m.last_topk_idx))
                    for j, m in enumerate(mlas):
                        if m.track_max_logit:
                            max_logits[j] = torch.maximum(max_logits[j], m.max_logit_per_head.detach().float())
                max_norm = ocfg.grad_clip if ocfg.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                # the step's losses, read once the optimizer is queued; summed on the host in float64 in micro-batch
                # order, as the per-micro-batch reads did
                parts = torch.stack([p.float() for p in ce_parts + mtp_parts]).cpu().tolist()
                sum_ce = sum_mtp = 0.0
                for i, v in enumerate(parts):
                    if i < len(ce_parts):
                        sum_ce += v
                    else:
                        sum_mtp += v
                max_logits = [ml.cpu() for ml in max_logits]
                sum_ce, sum_mtp = self._over_ranks(torch.tensor([sum_ce, sum_mtp], dtype=torch.float64), "mean").tolist()
                self.state.tokens += int(self._over_ranks(torch.tensor(step_tokens), "sum"))
                if max_logits:  # QK-Clip acts on the max over every rank's batch
                    max_logits = list(self._over_ranks(torch.cat(max_logits), "max").split([len(x) for x in max_logits]))
                ce = sum_ce / tcfg.grad_accum
                # a non-finite loss stops the run before anything is written: the update just applied to the weights
                # in memory is never saved
                if not math.isfinite(ce) or not math.isfinite(sum_mtp):
                    where = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
                    raise TrainingError(f"non-finite loss ({ce}) at step {step + 1}; {where}. Lower optim.lr or "
                                        f"check the data, then resume with --resume.")
                clip_stats = {"qk_clipped_heads": 0}
                if tcfg.track_max_logit and mlas:
                    for m, ml in zip(mlas, max_logits):
                        m.max_logit_per_head.copy_(ml.to(m.max_logit_per_head.device))
                    if ocfg.qk_clip_tau is not None:
                        clip_stats = qk_clip_model_(model, ocfg.qk_clip_tau)
                with torch.no_grad():
                    bal = self._balance_routers(scores_per_layer)
                self.state.step += 1
                step = self.state.step
                if progress is not None:
                    progress(step, ce)
                if step % tcfg.log_every == 0 or step == tcfg.max_steps:
                    now = time.time()
                    rec = {"step": step, "loss": ce, "lr": lr, "tokens": self.state.tokens,
                           "tokens_per_s": (self.state.tokens - tok_last) / max(now - t_last, 1e-9),
                           "grad_norm": float(grad_norm), "mtp_loss": sum_mtp / tcfg.grad_accum,
                           "mtp_lambda": lam, **bal,
                           "max_attn_logit": max((float(x.max()) for x in max_logits), default=0.0),
                           "qk_clipped_heads": int(clip_stats.get("qk_clipped_heads", 0)),
                           "elapsed_s": self.state.wall_time + now - t_seg,
                           **{k: sum(v) / len(v) for k, v in stats.items()}}
                    if self.flops_per_token and self.peak_flops:
                        rec["mfu"] = rec["tokens_per_s"] * self.flops_per_token / self.peak_flops
                    self._log(rec)
                    t_last, tok_last = now, self.state.tokens
                if tcfg.eval_every and step % tcfg.eval_every == 0 and step < tcfg.max_steps:
                    ev = self.evaluate()
                    self._record_eval(ev)
                if self.ccfg.every and step % self.ccfg.every == 0 and step < tcfg.max_steps:
                    self.state.wall_time += time.time() - t_seg
                    t_seg = time.time()
                    last_ckpt = self.save_checkpoint()
                self._stop_signal = int(self._over_ranks(torch.tensor(self._stop_signal or 0), "max")) or None
                if self._stop_signal is not None:
                    self.state.wall_time += time.time() - t_seg
                    t_seg = time.time()
                    last_ckpt = self.save_checkpoint()
                    self._log({"step": step, "event": "stopped_by_signal", "signal": int(self._stop_signal),
                               "checkpoint": str(last_ckpt)})
                    break
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            for m in moes:
                m.record_router = False
            for m in mlas:
                m.track_max_logit = False
            model.model.activation_checkpointing = "none"
        self.state.wall_time += time.time() - t_seg
        return self.state

    def _record_eval(self, ev: dict) -> None:
        self.state.last_eval = ev
        if self.state.best_val_loss is None or ev["val_loss"] < self.state.best_val_loss:
            self.state.best_val_loss = ev["val_loss"]
        self._log({"step": self.state.step, "tokens": self.state.tokens, **ev})

    @property
    def stopped_by_signal(self) -> bool:
        return self._stop_signal is not None

    @property
    def stop_signal(self) -> int | None:
        """The number of the signal (SIGINT, SIGTERM) that stopped `fit`, else None."""
        return self._stop_signal
