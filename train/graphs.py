"""The training micro-step in one CUDA graph (train.cuda_graph): forward, CE + lambda * MTP CE, backward, captured
once and replayed for every later micro-batch of the same shape.

Why: on one H200 the k3-small step launches ~5,800 kernels and the device idles most of the eager step while the
host launches them; a replay launches the whole step at once (benchmarks/model.py --cuda-graph: 0.26x -> 0.43x of
the dense anchor at 4 x 4,096 tokens, benchmarks/RESULTS.md). The kernels are the ones the eager step ran, so the
numbers are the eager step's.

How it fits the loop (k3.train.loop.Trainer):
- The first optimizer step of a shape, and any step whose micro-step changes form (MTP on or off, a loss mask or
  none, another batch shape), runs eagerly: it warms up the lazy parts (Triton's autotuning, cuBLAS handles,
  the grouped GEMM probe) and is a real step. The next step with that form captures, then replays.
- Inputs are copied into static buffers; lambda is a device scalar, so its schedule needs no new capture.
- The gradients come out in the graph's own tensors: with grad_accum = 1 they become p.grad; with more micro-batches
  they are summed into buffers of the loop's own, in the order eager autograd adds them (first assigns, then +=).
- What the forward leaves on the modules for the loop (LatentMoE.last_scores / last_topk_idx; the MLA max-logit
  buffers are written in place) is pointed back at the graph's tensors after each replay, since an eager evaluation
  in between may have replaced it.

Only the plain next-token objective on one process is captured: a custom batch loss (k3 distill), FSDP2 (its
collectives) and torch.compile are refused at configuration time (k3.train.pretrain).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MicroStep = Callable[[torch.Tensor, torch.Tensor | None, object, bool], dict[str, torch.Tensor]]


class GraphedMicroSteps:
    """Runs `micro_step(tokens [B, T+1], mask [B, T] | None, lam, with_mtp) -> losses` (which also runs the
    backward) eagerly or from a CUDA graph; see the module docstring for when each."""

    def __init__(self, model: nn.Module, micro_step: MicroStep, grad_accum: int):
        self.model, self.micro_step, self.grad_accum = model, micro_step, grad_accum
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.moes = model.moe_layers() if hasattr(model, "moe_layers") else []
        self.form: tuple | None = None  # the micro-step form of the last step
        self.eager_forms: set[tuple] = set()  # forms that ran eagerly once (warm)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_form: tuple | None = None
        self.captures = 0  # graphs captured (a test and the log read it)
        self.replays = 0

    @staticmethod
    def form_of(tokens: torch.Tensor, mask: torch.Tensor | None, with_mtp: bool) -> tuple:
        return (tuple(tokens.shape), tokens.dtype, None if mask is None else (tuple(mask.shape), mask.dtype),
                bool(with_mtp), str(tokens.device))

    def begin_step(self, form: tuple) -> bool:
        """Called before an optimizer step's micro-batches, all of form `form`; True when this step is graphed."""
        graphed = form in self.eager_forms
        if not graphed:
            self.eager_forms.add(form)
        self.form = form
        self._acc: list[torch.Tensor] | None = None
        self._micro = 0
        return graphed

    # ------------------------------------------------------------------ one micro-batch
    def run(self, tokens: torch.Tensor, mask: torch.Tensor | None, lam: float, with_mtp: bool,
            graphed: bool) -> dict[str, torch.Tensor]:
        if not graphed:
            return self.micro_step(tokens, mask, lam, with_mtp)
        form = self.form_of(tokens, mask, with_mtp)
        if self.graph is None or self.graph_form != form:
            self._capture(tokens, mask, with_mtp, form)
        self.static_tokens.copy_(tokens)
        if mask is not None:
            self.static_mask.copy_(mask)
        self.static_lam.fill_(lam)
        self.graph.replay()
        self.replays += 1
        for moe, (s, k) in zip(self.moes, self.static_router):
            # the loop keeps each micro-batch's router tensors until the step's balance update; the next replay
            # overwrites the graph's own, so with accumulation each micro-batch gets its copy
            moe.last_scores, moe.last_topk_idx = (s.clone(), k.clone()) if self.grad_accum > 1 else (s, k)
        self._collect_grads()
        # copies: the loop holds a step's losses until its one read back, and the next replay rewrites the graph's own
        return {k: v.clone() for k, v in self.static_losses.items()}

    def _capture(self, tokens, mask, with_mtp, form) -> None:
        self.graph = None  # the old graph's pool goes before the new one is captured
        torch.cuda.synchronize()
        self.static_tokens = tokens.clone()
        self.static_mask = None if mask is None else mask.clone()
        self.static_lam = torch.zeros((), dtype=torch.float32, device=tokens.device)
        held = [p.grad for p in self.params]  # an accumulation in progress (grads of earlier micro-batches)
        for p in self.params:
            p.grad = None  # the captured backward assigns its gradients (no += into tensors outside the graph)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            losses = self.micro_step(self.static_tokens, self.static_mask, self.static_lam, with_mtp)
        self.static_losses = {k: v for k, v in losses.items()}
        self.static_grads = [p.grad for p in self.params]
        self.static_router = [(m.last_scores, m.last_topk_idx) for m in self.moes]
        for p, g in zip(self.params, held):
            p.grad = g
        self.graph, self.graph_form = graph, form
        self.captures += 1

    def _collect_grads(self) -> None:
        """The replay's gradients into p.grad: as they are for one micro-batch, summed over several."""
        self._micro += 1
        if self.grad_accum == 1:
            for p, g in zip(self.params, self.static_grads):
                p.grad = g
            return
        pairs = [(p, g) for p, g in zip(self.params, self.static_grads) if g is not None]
        if self._micro == 1:
            self._acc = [g.clone() for _, g in pairs]
            for (p, _), a in zip(pairs, self._acc):
                p.grad = a
        else:
            torch._foreach_add_(self._acc, [g for _, g in pairs])
