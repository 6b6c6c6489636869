"""Calibrated clipping for post-training int4 quantization: each group's scale chosen by the output error.

For a weight W [N, K] in groups of g in-features and calibration inputs X [T, K] (the tensor's real inputs, read
by the model's own forward), the output error that group (n, j) alone adds when quantized on scale s is

    err(n, j; s) = sum_t (x_tj . (w_nj - Q_s(w_nj)))^2 = d^T C_j d,    d = w_nj - Q_s(w_nj),  C_j = X_j^T X_j  [g, g]

so only the per-group Gram matrices C_j are kept (K g floats per weight, per expert for routed experts), never the
inputs. The search is AWQ's clip search (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization", arXiv
2306.00978, its `auto_clip` step; GPTQ, arXiv 2210.17323, minimises the same layer-output error with updates
instead of a grid): scales s = r absmax(w_nj) / 7 on the ratios r = 1 - i / grid for i = 0 .. grid * max_shrink
(AWQ's defaults: 20 steps down to 0.5), each group independently keeping the ratio of least error, ties to the
largest (r = 1 is round-to-nearest, so no group ends worse than RTN on the calibration data). Values beyond the
clipped range saturate at -8 / +7.

The LM head keeps its round-to-nearest scales: its output error counts every vocabulary logit alike, while the loss
hangs on the few largest, and clipping the head's largest weights pays for the small logits with those. On
examples/quantize's bf16 control (k3-tiny, all_linear, w4a8, group 32) the search over every linear raised the
validation loss above RTN's (4.3320 vs 4.3296); the same search without the head lowered it (4.3288).

Legend: E experts, N out-features, K in-features, G = K / g groups, T calibration rows.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Self

import torch
from torch import nn

from k3.kernels.quant import int4_group_codes, int4_group_dequant, int4_group_scales
from k3.model.moe import GroupedExperts
from k3.model.quant import check_targets, module_weights

KEEP_RTN = ("lm_head",)  # module names whose scales stay round-to-nearest (module docstring)


def clip_ratios(grid: int, max_shrink: float) -> list[float]:
    """The searched ratios, largest first: clip_ratios(20, 0.5) == [1.0, 0.95, ..., 0.5]."""
    if grid < 1 or not 0 <= max_shrink < 1:
        raise ValueError(f"clip grid {grid} must be >= 1 and max_shrink {max_shrink} in [0, 1)")
    return [1 - i / grid for i in range(round(grid * max_shrink) + 1)]


def _add_gram(acc: torch.Tensor, x_TK: torch.Tensor, group: int) -> None:
    """acc [G, g, g] += per-group X_j^T X_j of x_TK [T, K] (float64 accumulation)."""
    x = x_TK.detach().double().reshape(x_TK.shape[0], -1, group)  # [T, G, g]
    acc += torch.einsum("tgi,tgj->gij", x, x)


class GramRecorder:
    """Accumulates per-group input Gram matrices of the selected weights (but KEEP_RTN's) during ordinary forwards.

    grams: weight name -> [G, g, g] (nn.Linear) or [E, G, g, g] (routed experts), float64 on the weight's device.
    Use as a context manager around `model(tokens)` calls; the hooks are removed on exit.
    """

    def __init__(self, model: nn.Module, quantization_config: dict):
        self.group = quantization_config["group_size"]
        self.targets = [t for t in check_targets(model, quantization_config) if t[0] not in KEEP_RTN]
        self.grams: dict[str, torch.Tensor] = {}
        for name, m, _ in self.targets:
            for n, w in module_weights(name, m):
                lead = (w.shape[0],) if w.dim() == 3 else ()
                self.grams[n] = torch.zeros(*lead, w.shape[-1] // self.group, self.group, self.group,
                                            dtype=torch.float64, device=w.device)
        self._stack = ExitStack()

    def __enter__(self) -> Self:
        for name, m, _ in self.targets:
            if isinstance(m, GroupedExperts):
                m.input_observer = self._expert_observer(name)
                self._stack.callback(setattr, m, "input_observer", None)
            else:
                h = m.register_forward_pre_hook(self._linear_hook(f"{name}.weight"))
                self._stack.callback(h.remove)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _linear_hook(self, key: str):
        def hook(module, args):
            x = args[0]
            _add_gram(self.grams[key], x.reshape(-1, x.shape[-1]), self.group)
        return hook

    def _expert_observer(self, name: str):
        def observe(weight: str, x_MI: torch.Tensor, counts_E: torch.Tensor) -> None:
            acc = self.grams[f"{name}.{weight}"]
            x = x_MI.detach()
            start = 0
            for e, c in enumerate(counts_E.tolist()):  # calibration only: the host sync is fine
                if c:
                    _add_gram(acc[e], x[start:start + c], self.group)
                start += c
        return observe


def search_clip(w: torch.Tensor, gram: torch.Tensor, group: int, ratios: list[float]
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-group scales of least output error for one weight (module docstring).

    Args: w [.., N, K] floating; gram [.., G, g, g] (the leading dims of w but N); ratios largest first.
    Returns: (scales fp32 [.., N, G], {"rtn_error", "error", "output_energy"}): the summed output error at r = 1
    and at the chosen ratios, and sum_nj w_nj^T C_j w_nj (the error's scale).

    Example: s, st = search_clip(w_NK, C_GGg, 32, clip_ratios(20, 0.5))
    """
    wf = w.detach().float()
    gram = gram.to(wf.device)
    s_rtn = int4_group_scales(wf, group)  # [.., N, G]
    gram = gram.to(torch.float64)
    w_G = wf.double().reshape(*s_rtn.shape, group)  # [.., N, G, g]
    best_err = best_s = None
    for r in ratios:
        s = s_rtn * r
        d = (w_G - int4_group_dequant(int4_group_codes(wf, s), s, torch.float64).reshape(w_G.shape))
        err = torch.einsum("...ngi,...gij,...ngj->...ng", d, gram, d)  # [.., N, G]
        if best_err is None:
            best_err, best_s, rtn_err = err, s, err
        else:
            better = err < best_err  # strict: ties keep the larger ratio
            best_err, best_s = torch.where(better, err, best_err), torch.where(better, s, best_s)
    energy = torch.einsum("...ngi,...gij,...ngj->", w_G, gram, w_G).item()
    return best_s, {"rtn_error": rtn_err.sum().item(), "error": best_err.sum().item(), "output_energy": energy}


def calibrated_scales(model: nn.Module, quantization_config: dict, grams: dict[str, torch.Tensor],
                      ratios: list[float]) -> tuple[dict[str, torch.Tensor], dict]:
    """Search every recorded weight of `model`: ({weight name: scales}, summary with the output error of RTN and
    of the chosen clipping relative to the output, sqrt(sum err / sum energy), over all weights)."""
    group = quantization_config["group_size"]
    weights = {n: w for name, m, _ in check_targets(model, quantization_config) for n, w in module_weights(name, m)}
    scales, tot = {}, {"rtn_error": 0.0, "error": 0.0, "output_energy": 0.0}
    for n, gram in grams.items():
        scales[n], st = search_clip(weights[n], gram, group, ratios)
        for k in tot:
            tot[k] += st[k]
    e = max(tot["output_energy"], 1e-30)
    summary = {"rtn_rel_output_error": (tot["rtn_error"] / e) ** 0.5,
               "calibrated_rel_output_error": (tot["error"] / e) ** 0.5, "clip_ratios": ratios}
    return scales, summary
