"""Optimizers: Muon (+ Per-Head Muon) for hidden matrices, AdamW for the rest, and QK-Clip (architecture.md 11).

Muon (Keller Jordan, github.com/KellerJordan/Muon) with the Moonlight update scale ("Muon is Scalable for LLM
Training", arXiv 2502.16982, section 2.2), for a matrix W [A, B] with gradient G:

    M ← μM + G;   Ĝ = G + μM (Nesterov);   O = NS5(Ĝ) ≈ U Vᵀ
    W ← W·(1 − η·λ) − η · 0.2·√max(A, B) · O

The 0.2·√max(A, B) factor gives the update the RMS of a typical AdamW update (~0.2), so Muon and AdamW share one η
and one λ. Per-Head Muon (K3, reported; partition: architecture.md 11.2, k3 choice) orthogonalizes each head's
[d_h, d_in] block of a head-major [H·d_h, d_in] matrix on its own, scale 0.2·√max(d_h, d_in). QK-Clip (Kimi K2,
arXiv 2507.20534 section 2.1) rescales the query/key rows of MLA heads whose max logit exceeded τ.

Limits (read before scaling up):
- Muon needs the FULL gradient matrix of every parameter it updates. Orthogonalizing a shard is wrong (DeepSpeed
  issue #7807); sharded (DTensor) parameters are refused unless the optimizer gets a `sharded_update`, the gather /
  NS5 / scatter of k3.train.parallel.muon that FSDP2 training attaches (docs/parallel.md).
- NS5 runs in bf16 on CUDA, as Keller Jordan's reference does (github.com/KellerJordan/Muon, muon.py:
  `X = G.bfloat16()` before the iterations), and in fp32 on CPU (bf16 matmuls on CPU are far slower than fp32);
  float64 input on CPU stays float64 so the tests can compare against exact references. The Frobenius normalization
  accumulates in fp32, each iteration's products accumulate in fp32 inside the GEMMs (three per iteration: X Xᵀ and
  two baddbmm that fold the a, b, c terms into the epilogue), and the bf16 result is added into fp32 parameters in
  fp32 without an fp32 copy of the update. bf16 NS5 lands within 1.1-1.9% (relative Frobenius, per matrix) of fp32
  NS5; the form with the polynomial in bf16 elementwise ops was 2.6-3.9% (both measured 2026-12-02, CPU-forced bf16).
- Packed [gate | up] weights (`*gate_up_proj*`, 2-D [2F, D] or 3-D experts [E, 2F, D]) are orthogonalized as two
  blocks, which is exactly Muon on the unpacked W_gate and W_up (what Moonlight trained); packing is a runtime layout
  and must not change the math.
- NS5 is batched across the whole step: every [a, b] block (heads, experts, gate/up halves, whole matrices) of
  equal shape is orthogonalized in one stacked call [n, a, b], the stack written straight from G + μM in NS5's
  working dtype and the result added straight into each parameter's block view (no fp32 stack, no unblocking copy).

Legend: A, B matrix rows and columns; H heads; E experts; leading dims of a batched matrix stack are written `...`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from k3.kernels.quant import FakeQuant
from k3.model.config import ConfigError
from k3.train.config import OptimConfig

NS5_COEFFS = (3.4445, -4.7750, 2.0315)  # (a, b, c): KellerJordan/Muon; tuned so the slope at 0 is large (a = 3.4445)
MOONLIGHT_SCALE = 0.2  # arXiv 2502.16982 eq. 4: matches AdamW's update RMS


def ns_work_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """NS5's working dtype: bf16 on CUDA (KellerJordan/Muon), fp32 elsewhere; float64 stays float64 (references)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float64 if dtype == torch.float64 else torch.float32


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate U Vᵀ (the nearest semi-orthogonal matrix) of every matrix in G [..., A, B] -> [..., A, B].

    Quintic Newton–Schulz: X ← G/(‖G‖_F + 1e-7) per matrix, then `steps` times A = X Xᵀ, X ← aX + (bA + cA²)X with
    (a, b, c) = (3.4445, −4.7750, 2.0315) (KellerJordan/Muon; Moonlight arXiv 2502.16982 Algorithm 1). The
    coefficients trade exactness for speed: singular values land in roughly [0.7, 1.2], not at 1. Iterates on the wide
    orientation (rows ≤ cols) so X Xᵀ is the smaller Gram matrix; all matrices of G in one bmm chain. Computes in
    `dtype` (default `ns_work_dtype`: bf16 on CUDA, fp32 on CPU, float64 stays float64) with the norm accumulated in
    fp32 at least; returns G's dtype. Example: O = zeropower_via_newtonschulz5(torch.randn(256, 1024)).
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower_via_newtonschulz5 needs a matrix [..., A, B], got shape {tuple(G.shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    a, b, c = NS5_COEFFS
    work = dtype or ns_work_dtype(G.device, G.dtype)
    X = G.mT if G.size(-2) > G.size(-1) else G  # a view: the division below writes the wide layout
    *lead, rows, cols = X.shape
    X = X.reshape(-1, rows, cols)  # [n, A, B], A <= B
    acc = torch.promote_types(torch.promote_types(work, X.dtype), torch.float32)  # fp32 at least, never narrowing
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=acc)
    # spectral norm <= 1 before iterating; divided at the norm's precision, rounded once into the working dtype
    X = torch.div(X, norm + 1e-7, out=torch.empty((X.shape[0], rows, cols), dtype=work, device=G.device))
    for _ in range(steps):
        gram = torch.bmm(X, X.mT)  # [n, A, A]
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # bA + cA²
        X = torch.baddbmm(X, poly, X, beta=a)  # aX + (bA + cA²)X
    X = X.view(*lead, rows, cols)
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X.to(G.dtype)


def _is_sharded(t: torch.Tensor) -> bool:
    # DTensor is the only sharded tensor type torch ships; checked by name so non-distributed builds need no import.
    return type(t).__name__ == "DTensor"


def _block_view(x: torch.Tensor, num_heads: int | None, head_axis: int) -> torch.Tensor:
    """[..., A, B] -> [..., H, A/H, B] (head_axis 0, row blocks) or [..., H, A, B/H] (head_axis 1, column blocks).

    Always a view of x (x must be contiguous), so updates written into it land in x."""
    if num_heads is None:
        return x
    *lead, rows, cols = x.shape
    if head_axis == 0:
        return x.view(*lead, num_heads, rows // num_heads, cols)
    return x.view(*lead, rows, num_heads, cols // num_heads).movedim(-2, -3)


def muon_update(grad: torch.Tensor, num_heads: int | None = None, head_axis: int = 0,
                ns_steps: int = 5) -> torch.Tensor:
    """Scaled orthogonalized update 0.2·√max(a, b)·NS5(grad) of a matrix [A, B] or expert stack [E, A, B].

    Each [a, b] block is orthogonalized independently: the whole matrix (num_heads None), each of E expert slices,
    and with num_heads = H each head's row block [A/H, B] (head_axis 0) or column block [A, B/H] (head_axis 1).
    Returns a tensor shaped like grad. Example: muon_update(torch.randn(64, 32), num_heads=4).shape == (64, 32).
    """
    out = torch.zeros_like(grad, memory_format=torch.contiguous_format)
    rule = {"num_heads": num_heads, "head_axis": head_axis, "ns_steps": ns_steps, "lr": -1.0}
    _apply_muon_updates([(out, rule, grad.contiguous())])  # 0 + 1 · scale · NS5(grad), the step's own code
    return out


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum, decoupled weight decay and the Moonlight 0.2·√max(A, B) scale.

    Parameters must be matrices [A, B] or expert stacks [E, A, B] (each slice orthogonalized alone). Group options:
    lr, momentum (μ), weight_decay (λ), nesterov, ns_steps, num_heads (None | H: orthogonalize H equal head blocks),
    head_axis (0: heads are row blocks of a head-major [H·d_h, d_in]; 1: column blocks, as in W_o [d, H·d_v]).
    State per parameter: `momentum_buffer` (param dtype). Example:
        opt = Muon([{"params": [w_q], "num_heads": 8}, {"params": [w_down]}], lr=3e-3, weight_decay=0.1)
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, ns_steps: int = 5, num_heads: int | None = None, head_axis: int = 0,
                 sharded_update: Callable[[list], None] | None = None):
        if lr < 0.0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must lie in [0, 1), got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                    "ns_steps": ns_steps, "num_heads": num_heads, "head_axis": head_axis}
        # sharded_update(todo) replaces _apply_muon_updates for DTensor parameters (k3.train.parallel.muon)
        self.sharded_update = sharded_update
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group after checking every parameter can be orthogonalized as configured."""
        super().add_param_group(param_group)
        heads, axis = param_group["num_heads"], param_group["head_axis"]
        if axis not in (0, 1):
            raise ValueError(f"Muon head_axis must be 0 (row blocks) or 1 (column blocks), got {axis}")
        for p in param_group["params"]:
            if _is_sharded(p) and self.sharded_update is None:
                raise ValueError("Muon got a sharded (DTensor) parameter; orthogonalizing a shard is wrong. Pass "
                                 "sharded_update (k3.train.parallel.muon.ShardedMuonUpdate), give Muon full matrices "
                                 "or put the parameter in the AdamW group")
            if p.ndim not in (2, 3):
                raise ValueError(f"Muon takes matrices [A, B] or expert stacks [E, A, B], got shape {tuple(p.shape)}; "
                                 "put this parameter in the AdamW group")
            if heads is not None and p.shape[p.ndim - 2 + axis] % heads:
                raise ValueError(f"Muon num_heads={heads} does not divide dim {p.ndim - 2 + axis} of shape "
                                 f"{tuple(p.shape)}; fix num_heads or drop per-head for this parameter")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon update of every parameter that has a gradient; returns closure() if given.

        Batched across parameters: momentum and decay use foreach ops, and every [a, b] block of every parameter of
        the step with the same (a, b, NS5 working dtype, ns_steps) is orthogonalized in ONE stacked NS5 call (each
        block is normalized and iterated on its own, so this equals the per-parameter loop; `_apply_muon_updates`).
        On a GPU the per-parameter loop was host-bound: ~30 small kernels per parameter, 450 ms of a 968 ms k3-small
        training step; on the 2-core CPU, k3-tiny pretraining ran ~8% faster stacked (measured 2026-11-29).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # (param, group, direction source)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = []
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(self.state[p]["momentum_buffer"])
            grads = [p.grad for p in params]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads)  # M <- mu M + G
            # decoupled decay with the unscaled lr (Moonlight); the update reads only G and M, so it may come first
            torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            # the direction G^ = G + mu M (Nesterov) or M is formed while the NS5 stack is written
            todo += [(p, group, (p.grad, b) if group["nesterov"] else b) for p, b in zip(params, bufs, strict=True)]
        (self.sharded_update or _apply_muon_updates)(todo)
        return loss


def _apply_muon_updates(todo: list[tuple[torch.Tensor, dict, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]):
    """W ← W − lr · 0.2·√max(a, b) · NS5(D) for every (W, rule, D) in todo, blockwise per the rule's num_heads /
    head_axis, with D a tensor or a pair (G, M) standing for G + rule["momentum"] · M.

    All [a, b] blocks of the step with equal shape, NS5 working dtype, device and step count form one stack [n, a, b]:
    each D is written into it by one cast-on-write op (the Nesterov sum included), NS5 runs once on the stack, and
    each parameter's block view takes its slice in place (a bf16 result accumulates into fp32 W in fp32)."""
    for i, ortho, scale in orthogonalized_blocks(todo):
        p, rule, _ = todo[i]
        _block_view(p, rule["num_heads"], rule["head_axis"]).add_(ortho, alpha=-rule["lr"] * scale)


def orthogonalized_blocks(todo: list[tuple[torch.Tensor, dict, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]):
    """Yield (i, NS5(D_i) shaped like W_i's block view, the Moonlight scale 0.2·√max(a, b)) for every (W, rule, D) of
    todo (see _apply_muon_updates), bucket by bucket; W gives only the shape and block layout. A bucket's results are
    consumed before the next bucket is computed, so an update written into W between yields is safe."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, rule, d) in enumerate(todo):
        if not p.is_contiguous():
            raise ValueError(f"Muon writes updates into block views of each parameter; a parameter of shape "
                             f"{tuple(p.shape)} is not contiguous: make it contiguous before building the optimizer")
        ab = tuple(_block_view(p, rule["num_heads"], rule["head_axis"]).shape[-2:])
        src = d[1] if isinstance(d, tuple) else d
        buckets[(ab, ns_work_dtype(src.device, src.dtype), src.device, rule["ns_steps"])].append(i)
    for (ab, work, device, steps), idx in buckets.items():
        counts = [todo[i][0].numel() // (ab[0] * ab[1]) for i in idx]
        stack = torch.empty((sum(counts), *ab), dtype=work, device=device)  # [n, a, b]
        for i, part in zip(idx, stack.split(counts), strict=True):
            p, rule, d = todo[i]
            blocks = _block_view(p, rule["num_heads"], rule["head_axis"])
            dst = part.view(blocks.shape)
            if isinstance(d, tuple):  # G^ = G + mu M, summed at the parameter's precision, rounded once into dst
                g, m = (_block_view(t.contiguous(), rule["num_heads"], rule["head_axis"]) for t in d)
                torch.add(g, m, alpha=rule["momentum"], out=dst)
            else:
                dst.copy_(_block_view(d, rule["num_heads"], rule["head_axis"]))
        ortho = zeropower_via_newtonschulz5(stack, steps)
        scale = MOONLIGHT_SCALE * math.sqrt(max(ab))
        for i, part in zip(idx, ortho.split(counts), strict=True):
            p, rule, _ = todo[i]
            yield i, part.view(_block_view(p, rule["num_heads"], rule["head_axis"]).shape), scale


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer object over a Muon and an AdamW: step, zero_grad, param_groups, state, state_dict and
    load_state_dict cover both, so a schedule sets `group["lr"]` on every group of `param_groups`.

    param_groups lists Muon's groups then AdamW's (the same dicts, so edits reach the inner optimizers). state_dict
    has the standard torch layout with parameter ids numbered across both in that order (what
    torch.distributed.checkpoint expects). Example: opt = MuonAdamW(Muon(mats), torch.optim.AdamW(vecs)); opt.step()
    """

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        self._parts = (muon, adamw)
        # The base class registers the inner optimizers' own group dicts (it only re-lists their "params").
        super().__init__([g for part in self._parts for g in part.param_groups], defaults={})
        self._wrapped = True
        self._sync()

    def _sync(self) -> None:
        # load_state_dict of the inner optimizers replaces their group dicts and state; re-point the views.
        self.param_groups = [g for part in self._parts for g in part.param_groups]
        merged: defaultdict = defaultdict(dict)
        for part in self._parts:
            merged.update(part.state)
        self.state = merged

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Muon step then AdamW step; closure (if any) is evaluated once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        self._sync()
        return loss

    def state_dict(self) -> dict:
        """{"state": {id: ...}, "param_groups": [...]} with ids 0.. over Muon's then AdamW's parameters."""
        state, groups, offset = {}, [], 0
        for part in self._parts:
            sd = part.state_dict()
            state.update({i + offset: v for i, v in sd["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of state_dict(); the saved grouping must match this optimizer's (same model, same config)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(saved)} param groups, this optimizer {len(self.param_groups)};"
                             " the model or optim config changed since the checkpoint was written")
        # Keys are opaque (ints here, FQN strings from torch.distributed.checkpoint): torch matches saved params to
        # its own by position within the groups, so each part just receives its slice of groups and their state.
        first = 0
        for part in self._parts:
            mine = saved[first:first + len(part.param_groups)]
            keys = [k for g in mine for k in g["params"]]
            part.load_state_dict({"state": {k: state_dict["state"][k] for k in keys if k in state_dict["state"]},
                                  "param_groups": mine})
            first += len(part.param_groups)
        self._sync()

    def add_param_group(self, param_group: dict) -> None:
        """Only the constructor adds groups: each belongs to the inner Muon or AdamW, chosen by build_optimizer."""
        if getattr(self, "_wrapped", False):
            raise TypeError("MuonAdamW cannot take new groups; add them to .muon or .adamw before wrapping")
        super().add_param_group(param_group)


# --------------------------------------------------------------------------------------------------------------------
# parameter grouping (architecture.md 11.1 table)

EMBED_NAMES = ("embed_tokens",)
HEAD_NAMES = ("lm_head",)


def _is_vector_like(p: torch.Tensor) -> bool:
    # Norm gains, biases, A_log, dt_bias, and AttnRes pseudo-queries stored as [1, D]: at most one dim above 1.
    return sum(s > 1 for s in p.shape) <= 1


def _quant_scale_lr(module: nn.Module, param_name: str) -> float | None:
    """The lr multiplier of a QAT learned-scale parameter (`<weight>_scales` of a module with a learned FakeQuant),
    None for any other parameter."""
    fq = getattr(module, "fake_quant", None)
    if isinstance(fq, FakeQuant) and fq.learned and param_name.endswith("_scales"):
        return fq.scale_lr
    return None


def _kind(module_name: str, module: nn.Module, param_name: str, p: torch.Tensor) -> str:
    """'embed' | 'head' | 'vector' | 'conv' | 'matrix' for one parameter (name-based, following the model's names)."""
    owner = module_name.rsplit(".", 1)[-1]
    if owner in EMBED_NAMES or isinstance(module, nn.Embedding):
        return "embed"
    if owner in HEAD_NAMES:
        return "head"
    if _is_vector_like(p) or owner.endswith("res_proj"):
        return "vector"
    if owner.endswith("_conv1d") or isinstance(module, nn.Conv1d):
        return "conv"
    if p.ndim in (2, 3):
        return "matrix"
    raise ValueError(f"no optimizer rule for parameter {module_name}.{param_name} of shape {tuple(p.shape)}; "
                     "k3 expects matrices, expert stacks [E, A, B], vectors or short-conv kernels")


def _head_split(module_name: str, modules: dict[str, nn.Module], p: torch.Tensor,
                cfg: OptimConfig) -> tuple[int | None, int]:
    """(num_heads, head_axis) for a Muon matrix: per-head when its module is listed and its parent has num_heads."""
    owner = module_name.rsplit(".", 1)[-1]
    if cfg.per_head_muon and owner in cfg.per_head_params and p.ndim == 2:
        parent = modules[module_name.rsplit(".", 1)[0] if "." in module_name else ""]
        heads = getattr(parent, "num_heads", None)
        axis = 1 if owner == "o_proj" else 0  # W_o [d, H·d_v] splits its columns per head (architecture.md 11.2)
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and p.shape[axis] % heads == 0:
            return heads, axis
    return None, 0


def param_groups_for(model: nn.Module, cfg: OptimConfig) -> dict[str, dict]:
    """Split the trainable parameters of `model` into named optimizer groups (pure: reads names and shapes only).

    Rules (architecture.md 11.1): Muon for every hidden matrix (>= 2-D, incl. 3-D expert stacks, the router weight
    `gate.weight`, the MTP projection); AdamW for the embedding (`embed_tokens`), the LM head (`lm_head`), vector-like
    params (norm gains, biases, A_log, dt_bias, AttnRes pseudo-queries `*res_proj`) and short-conv kernels
    (`*_conv1d`). Weight decay cfg.weight_decay on every param with >= 2 dims that is not vector-like (Muon matrices,
    embedding, head, conv kernels [C, 1, W]); 0 on vector-like params. Buffers (router bias) and frozen params are
    never included. With cfg.optimizer == "adamw" the matrices join AdamW with decay.
    QAT's learned int4 scales (`*_scales` of a module whose `fake_quant` is learned, k3.model.quant) go to AdamW
    group `adamw_quant_scales` without decay (decay would shrink the clipping range), at lr x the FakeQuant's
    scale_lr (modules whose multiplier differs from the first one's: `adamw_quant_scales_x{scale_lr}`): they are
    [.., N, K/g] like matrices, but each entry is a step size, not a direction for Muon.
    Per-head: with cfg.per_head_muon, a matrix owned by a module named in cfg.per_head_params whose parent module has
    an int `num_heads` dividing its rows (columns for `o_proj`) goes to group `muon_h{H}` (`muon_h{H}_cols`).
    Packed [gate | up] weights (`gate_up` in the name) go to `muon_gate_up` (two row blocks).

    Returns {group_name: {"optimizer": "muon" | "adamw", "weight_decay": float, "num_heads": int | None,
    "head_axis": 0 | 1, "lr_scale": float, "names": [str], "params": [Parameter]}}, only non-empty groups, in
    first-seen order.
    Example: {k: len(g["params"]) for k, g in param_groups_for(model, OptimConfig()).items()}
    """
    if cfg.optimizer not in ("muon", "adamw"):
        raise ConfigError(f"optim.optimizer={cfg.optimizer!r} is unknown; use 'muon' or 'adamw'")
    modules = dict(model.named_modules())
    groups: dict[str, dict] = {}
    seen: set[int] = set()

    def put(group: str, optimizer: str, wd: float, name: str, p: torch.Tensor, heads: int | None = None,
            axis: int = 0, lr_scale: float = 1.0) -> None:
        g = groups.setdefault(group, {"optimizer": optimizer, "weight_decay": wd, "num_heads": heads,
                                      "head_axis": axis, "lr_scale": lr_scale, "names": [], "params": []})
        if g["lr_scale"] != lr_scale:
            raise ValueError(f"{name}: lr multiplier {lr_scale} differs from {g['lr_scale']} of group {group}")
        g["names"].append(name)
        g["params"].append(p)

    for module_name, module in modules.items():
        for param_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # frozen, or tied (counted once)
                continue
            seen.add(id(p))
            full = f"{module_name}.{param_name}" if module_name else param_name
            scale_lr = _quant_scale_lr(module, param_name)
            if scale_lr is not None:
                first = groups.get("adamw_quant_scales", {"lr_scale": scale_lr})["lr_scale"]
                group = "adamw_quant_scales" + ("" if scale_lr == first else f"_x{scale_lr:g}")
                put(group, "adamw", 0.0, full, p, lr_scale=scale_lr)
                continue
            kind = _kind(module_name, module, param_name, p)
            if kind == "vector":
                put("adamw_no_decay", "adamw", 0.0, full, p)
            elif kind != "matrix" or cfg.optimizer == "adamw":
                put("adamw_decay", "adamw", cfg.weight_decay, full, p)
            elif "gate_up" in f"{module_name.rsplit('.', 1)[-1]}.{param_name}":
                put("muon_gate_up", "muon", cfg.weight_decay, full, p, heads=2, axis=0)
            else:
                heads, axis = _head_split(module_name, modules, p, cfg)
                group = "muon" if heads is None else f"muon_h{heads}" + ("_cols" if axis else "")
                put(group, "muon", cfg.weight_decay, full, p, heads=heads, axis=axis)
    return groups


def group_summary(groups: dict[str, dict]) -> dict[str, dict]:
    """{group_name: {"tensors": count, "numel": total elements}} of param_groups_for's result, for the run log."""
    return {k: {"tensors": len(g["params"]), "numel": sum(p.numel() for p in g["params"])} for k, g in groups.items()}


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    sharded_update: Callable[[list], None] | None = None) -> torch.optim.Optimizer:
    """The training optimizer for `model`: MuonAdamW (cfg.optimizer "muon") or torch AdamW ("adamw").
    sharded_update: Muon's update of FSDP2-sharded matrices (k3.train.parallel.muon), None on one process.

    Every torch param group starts at lr = cfg.lr and carries its `group` name; schedules set `group["lr"]` on all of
    `optimizer.param_groups`. If one side would be empty (a model with no matrices, say) the other is returned alone.
    Example: opt = build_optimizer(model, OptimConfig(lr=2e-3)); opt.step(); opt.zero_grad()
    """
    groups = param_groups_for(model, cfg)
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters (all frozen?)")
    muon_groups, adamw_groups = [], []
    for name, g in groups.items():
        # the train loop sets lr x lr_scale on every step (k3.train.loop); the same from the start
        tg = {"params": g["params"], "lr": cfg.lr * g["lr_scale"], "weight_decay": g["weight_decay"], "group": name,
              **({"lr_scale": g["lr_scale"]} if g["lr_scale"] != 1.0 else {})}
        if g["optimizer"] == "muon":
            muon_groups.append({**tg, "num_heads": g["num_heads"], "head_axis": g["head_axis"]})
        else:
            adamw_groups.append(tg)
    adamw = muon = None
    if adamw_groups:
        adamw = torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    if muon_groups:
        muon = Muon(muon_groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    ns_steps=cfg.ns_steps, sharded_update=sharded_update)
    if muon is None or adamw is None:
        return muon or adamw
    return MuonAdamW(muon, adamw)


# --------------------------------------------------------------------------------------------------------------------
# QK-Clip (Kimi K2 arXiv 2507.20534 section 2.1; Su, kexue.fm/archives/11126; architecture.md 11.3)


def _mla_dims(mla: nn.Module) -> tuple[int, int, int, int]:
    """(H, nope, rope, v) from the module's int attributes (either naming style), else from its ModelConfig."""
    cfg = getattr(mla, "config", None) or getattr(mla, "cfg", None)

    def dim(attrs: tuple[str, ...], cfg_field: str) -> int:
        for a in attrs:
            v = getattr(mla, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        v = getattr(cfg, cfg_field, None)
        if isinstance(v, int):
            return v
        raise ValueError(f"qk_clip_: {type(mla).__name__} must expose `{attrs[0]}` (or a ModelConfig as .config)")

    return (dim(("num_heads",), "mla_num_heads"), dim(("qk_nope_head_dim", "nope_dim"), "qk_nope_head_dim"),
            dim(("qk_rope_head_dim", "rope_dim"), "qk_rope_head_dim"), dim(("v_head_dim", "v_dim"), "v_head_dim"))


@torch.no_grad()
def qk_clip_(mla: nn.Module, tau: float) -> int:
    """Rescale the query/key rows of every head of `mla` whose max logit exceeded tau; returns the heads clipped.

    Reads `mla.max_logit_per_head` [H] (fp32, the max over the last forward of the scaled pre-softmax logit). For head
    h with S = S_max^h > tau and gamma = tau / S (weights [out, in], N nope, R rope, V value dims):
        q_b_proj rows  h(N+R) + [0, N)    *= sqrt(gamma)     W^{UQ}_h
        kv_b_proj rows h(N+V) + [0, N)    *= sqrt(gamma)     W^{UK}_h   (q^C·k^C scales by gamma)
        q_b_proj rows  h(N+R) + [N, N+R)  *= gamma           W^{QR}_h   (k^R is shared, so q^R takes all of gamma)
    kv_a_proj_with_mqa (shared k^R, latent) and W^{UV}_h are untouched. Per head, never per layer, so innocent heads
    are not over-clipped. A model without q_lora (direct `q_proj`) is handled the same way.
    Example: n = qk_clip_(layer.self_attn, 100.0)
    """
    if not tau > 0:
        raise ValueError(f"QK-Clip tau must be > 0, got {tau}")
    H, N, R, V = _mla_dims(mla)
    q_w = (mla.q_b_proj if getattr(mla, "q_b_proj", None) is not None else mla.q_proj).weight  # [H(N+R), Q]
    kv_w = mla.kv_b_proj.weight  # [H(N+V), C]
    smax_H = mla.max_logit_per_head.detach().float()
    if smax_H.shape != (H,) or q_w.shape[0] != H * (N + R) or kv_w.shape[0] != H * (N + V):
        raise ValueError(f"qk_clip_: shapes disagree with H={H}, N={N}, R={R}, V={V}: max_logit_per_head "
                         f"{tuple(smax_H.shape)}, q rows {q_w.shape[0]}, kv_b rows {kv_w.shape[0]}")
    over_H = smax_H > tau  # NaN / -inf (no tracked forward) never clip
    n_clipped = int(over_H.sum())
    if n_clipped == 0:
        return 0
    gamma_H = torch.where(over_H, tau / smax_H, torch.ones_like(smax_H))  # exactly 1 for innocent heads
    root_H = gamma_H.sqrt()
    q_scale = torch.cat([root_H[:, None].expand(H, N), gamma_H[:, None].expand(H, R)], dim=1)  # [H, N+R]
    kv_scale = torch.cat([root_H[:, None].expand(H, N), torch.ones(H, V, device=smax_H.device)], dim=1)  # [H, N+V]
    _scale_rows_(q_w, q_scale.reshape(-1))
    _scale_rows_(kv_w, kv_scale.reshape(-1))
    return n_clipped


def _scale_rows_(w: torch.Tensor, scale_A: torch.Tensor) -> None:
    """w [A, B] *= scale [A] per row; a DTensor w (FSDP2 shards rows) takes the rows of scale its shard holds,
    sliced on each rank without communication (every rank computed the same scale from reduced max logits)."""
    s = scale_A.reshape(-1, 1).to(w.device, w.dtype)
    if _is_sharded(w):
        from torch.distributed.tensor import distribute_tensor

        s = distribute_tensor(s, w.device_mesh, w.placements, src_data_rank=None)
    w.mul_(s)


def qk_clip_model_(model: nn.Module, tau: float | None) -> dict:
    """Apply qk_clip_ to every module with a `max_logit_per_head` buffer (MLA layers, the MTP's MLA).

    Modules with `track_max_logit` False are skipped: their buffer is stale and would clip the same heads again at
    every step. tau None only collects the statistics. Returns {"qk_clipped_heads": int, "max_logit": float (max
    over all heads of the tracking layers before the clip, -inf without any), "layers": tracking MLA modules seen}.
    Example: stats = qk_clip_model_(model, cfg.optim.qk_clip_tau)
    """
    clipped, layers, peak = 0, 0, float("-inf")
    for module in model.modules():
        buf = getattr(module, "max_logit_per_head", None)
        if not isinstance(buf, torch.Tensor) or getattr(module, "track_max_logit", True) is False:
            continue
        layers += 1
        if buf.numel():
            peak = max(peak, float(buf.detach().float().max()))
        if tau is not None:
            clipped += qk_clip_(module, tau)
    return {"qk_clipped_heads": clipped, "max_logit": peak, "layers": layers}
