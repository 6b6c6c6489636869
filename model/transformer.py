"""K3Model: the Kimi K3 architecture (architecture.md), one forward for training, prefill and decode.

Features:
- hybrid layout from the 1-based `full_attn_layers` list: Kimi Delta Attention everywhere else (3:1 in presets)
- gated MLA with an unrotated ("nope") or rotated ("rope") position slot; absorbed decode over a latent cache
- Block Attention Residuals (or plain Pre-LN, `residual: preln`, for ablations)
- layer 0 (first_k_dense) a dense C2-GLU MLP, every other layer a Stable LatentMoE with a sigmoid router
- one depth-1 MTP module sharing the embedding and head; it never changes the main logits
- untied embedding and head

Modes: `forward(tokens)` trains on full sequences; `forward(tokens, state=model.new_state(B))` prefills and
returns logits while filling `state`; calling it again with the same state decodes the new tokens against it.

Legend: B batch, T tokens, D width, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.kernels.moe import grouped_mm_available

from .attnres import AttnResBlocks, AttnResSource, PseudoQuery, attn_res_mix, attn_res_mix_blocks
from .cache import InferenceState, KDACache, MLACache, PagedLatentView
from .config import ModelConfig
from .kda import KimiDeltaAttention
from .layers import GatedMLP, RMSNorm
from .mla import GatedMLA
from .moe import LatentMoE
from .mtp import MTPModule


@dataclass
class K3Output:
    logits: torch.Tensor | None  # [B, T, V]; None from forward(head=False)
    hidden: torch.Tensor  # [B, T, D] final hidden before the final norm (the MTP input)
    mtp_logits: torch.Tensor | None = None  # [B, T, V] predictions of t_{i+2}, when mtp_tokens were given
    head_input: torch.Tensor | None = None  # [B, T, D] the normed hidden the LM head reads, from forward(head=False)
    mtp_head_input: torch.Tensor | None = None  # [B, T, D] the same for the MTP logits (head=False, mtp_tokens)


class K3DecoderLayer(nn.Module):
    """Mixer (KDA or MLA) + MLP (dense or LatentMoE), each behind an RMSNorm; AttnRes mixers when enabled."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        d, eps = cfg.d_model, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[layer_idx]
        self.mlp_type = cfg.mlp_types[layer_idx]
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if self.layer_type == "kda" else GatedMLA(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.mlp_type == "dense":
            self.mlp = GatedMLP(d, cfg.dense_intermediate_size, cfg.hidden_act, cfg.c2glu_beta1, cfg.c2glu_beta2)
        else:
            self.mlp = LatentMoE(cfg)
        if cfg.residual == "attnres":
            if layer_idx > 0:  # layer 0's mixer reads the embedding alone: it has no depth mixture
                self.attn_res_norm = RMSNorm(d, eps)  # only .weight is used: the key-norm gain
                self.attn_res_proj = PseudoQuery(d)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = PseudoQuery(d)


class K3Backbone(nn.Module):
    """Embedding, layers, the output AttnRes and the final norm (HF prefix `model.`).

    `activation_checkpointing` ("none" | "mla" | "all", a plain attribute the train loop sets from
    train.activation_checkpointing): under autograd, the mixer and the MLP of the MLA layers ("mla") or of every
    layer ("all") keep only their input and run again in the backward (torch.utils.checkpoint, non-reentrant).
    The residual stream and the AttnRes mixtures stay saved: they are cheap and hold no per-head activations.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if cfg.residual == "attnres":
            self.output_attn_res_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
            self.output_attn_res_proj = PseudoQuery(cfg.d_model)
        self.activation_checkpointing = "none"

    def _sublayers(self, layer: K3DecoderLayer, cache):
        """(mixer, mlp): functions of the normalised-to-be input x [B, T, D], recomputed in the backward where
        activation checkpointing covers this layer."""
        mixer = lambda x: layer.self_attn(layer.input_layernorm(x), cache=cache)
        mlp = lambda x: layer.mlp(layer.post_attention_layernorm(x))
        mode = self.activation_checkpointing
        if mode not in ("none", "mla", "all"):
            raise ValueError(f"activation_checkpointing must be none, mla or all, got {mode!r}")
        if cache is not None or not torch.is_grad_enabled() or mode == "none" or (
                mode == "mla" and layer.layer_type != "mla"):
            return mixer, mlp
        if isinstance(layer.mlp, LatentMoE):
            _probe_grouped_mm(layer.mlp)
        return (lambda x: checkpoint(mixer, x, use_reentrant=False),
                lambda x: checkpoint(mlp, x, use_reentrant=False))

    def forward(self, emb_BTD: torch.Tensor, state: InferenceState | None = None) -> torch.Tensor:
        """Embedded tokens [B, T, D] -> final hidden [B, T, D] (before the final norm); layer i's mixer reads and
        writes its state through the view `state.layers[i]` (k3.model.cache) when a state is given.
        Pre-LN or the Block AttnRes loop of architecture.md 4.2 (block size counts layers; layer 0 snapshots the
        embedding)."""
        caches = state.layers if state is not None else [None] * len(self.layers)
        x_BTD = emb_BTD
        if self.cfg.residual == "preln":
            for layer, cache in zip(self.layers, caches):
                mixer, mlp = self._sublayers(layer, cache)
                x_BTD = x_BTD + mixer(x_BTD)
                x_BTD = x_BTD + mlp(x_BTD)
            return x_BTD
        eps, bsz = self.cfg.rms_norm_eps, self.cfg.attn_res_block_size
        # inference stacks the completed blocks once (a fixed kernel count per mixture); under autograd the list
        # form keeps no re-stacked copies alive for the backward
        stacked = not torch.is_grad_enabled()
        blocks = AttnResBlocks() if stacked else []

        def mix(partial, norm: RMSNorm, proj: PseudoQuery):
            src = AttnResSource(partial, eps)
            if stacked:
                return attn_res_mix_blocks(blocks, src, norm.weight, proj.weight)
            return attn_res_mix(blocks + [src], norm.weight, proj.weight)

        partial = x_BTD
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            mixer, mlp = self._sublayers(layer, cache)
            x = mix(partial, layer.attn_res_norm, layer.attn_res_proj) if len(blocks) else partial
            if i % bsz == 0:
                blocks.append(AttnResSource(partial, eps))
                partial = None
            a = mixer(x)
            partial = a if partial is None else partial + a
            x = mix(partial, layer.mlp_res_norm, layer.mlp_res_proj)
            partial = partial + mlp(x)
        return mix(partial, self.output_attn_res_norm, self.output_attn_res_proj)


def _autocast_dtype(emb_BTD: torch.Tensor) -> torch.Tensor:
    """The embedding in the autocast dtype where autocast is on (float64 stays). Under bf16 autocast the other
    AttnRes sources are bf16 and a mixture returns its first source's dtype: an fp32 embedding made every sub-layer
    input fp32, re-cast by each projection, with fp32 gradients and their casts back (~15% of k3-small's step on an
    H200). Pre-LN keeps the fp32 embedding: its residual stream accumulates over the depth."""
    dev = emb_BTD.device.type
    if torch.is_autocast_enabled(dev) and emb_BTD.dtype == torch.float32:
        return emb_BTD.to(torch.get_autocast_dtype(dev))
    return emb_BTD


def _probe_grouped_mm(moe: LatentMoE) -> None:
    """Run k3.kernels.moe's one-time probe of torch._grouped_mm (per device and dtype) outside any checkpointed
    region: it saves tensors of its own, so its first run inside one would make the forward save more tensors than
    the recomputation, which torch.utils.checkpoint refuses."""
    w = getattr(moe.experts, "gate_up_proj", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():  # quantized experts: no grouped matmul
        return
    dtypes = {w.dtype} | ({torch.get_autocast_dtype(w.device.type)} if torch.is_autocast_enabled(w.device.type)
                          else set())
    with torch.enable_grad():
        for dt in dtypes:
            grouped_mm_available(torch.zeros(1, w.shape[2], device=w.device, dtype=dt), w.detach().to(dt))


class K3Model(nn.Module):
    """Causal LM: `model` (backbone), `lm_head`, optional `mtp`. See the module docstring for the modes."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = K3Backbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPModule(cfg) if cfg.mtp_depth > 0 else None

    def new_state(self, batch_size: int = 1) -> InferenceState:
        """Empty inference state for `batch_size` sequences (filled by the first forward that receives it)."""
        del batch_size  # caches are allocated lazily by the layers on first use, with the batch's size
        layers = [KDACache() if t == "kda" else MLACache() for t in self.config.layer_types]
        return InferenceState(layers=layers, mtp=MLACache() if self.mtp is not None else None)

    def forward(self, tokens_BT: torch.Tensor, state: InferenceState | None = None,
                mtp_tokens_BT: torch.Tensor | None = None, head: bool = True) -> K3Output:
        """tokens [B, T] -> K3Output. With `state`, consume the tokens after state.seq_len and advance it.

        mtp_tokens_BT: the tokens following each input position (t_{i+1}, i.e. the main targets); when given and
        the model has an MTP module, also return `mtp_logits` predicting t_{i+2}.
        head=False: stop before the LM head and return what it would read (`head_input`, `mtp_head_input`: the
        final norms' outputs) in place of the logits, for a loss that applies the head itself in pieces (the
        fused head + cross-entropy of training; `plain_head_weight`).
        """
        hidden = self.hidden_states(tokens_BT, state)
        mtp = mtp_tokens_BT is not None and self.mtp is not None
        mtp_cache = None if state is None else state.mtp
        if head:
            out = K3Output(logits=self.logits(hidden), hidden=hidden,
                           mtp_logits=self.mtp_logits(hidden, mtp_tokens_BT, mtp_cache) if mtp else None)
        else:
            out = K3Output(logits=None, hidden=hidden, head_input=self.head_input(hidden),
                           mtp_head_input=self.mtp_head_input(self.mtp_hidden(hidden, mtp_tokens_BT, mtp_cache))
                           if mtp else None)
        if state is not None:
            state.seq_len += tokens_BT.shape[1]
        return out

    def hidden_states(self, tokens_BT: torch.Tensor, state: InferenceState | None = None) -> torch.Tensor:
        """tokens [B, T] -> final hidden [B, T, D] before the final norm, through the mixers' cache views when a
        state is given (its seq_len is not advanced: `forward` does that). The serving engine's steps call this
        with its paged views, then `logits` on the rows it samples from."""
        if tokens_BT.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens_BT.shape)}")
        emb = self.model.embed_tokens(tokens_BT)
        return self.model(_autocast_dtype(emb) if self.config.residual == "attnres" else emb, state)

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm: hidden [..., D] (before the norm) -> what the LM head reads [..., D]."""
        return self.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over the final norm: hidden [..., D] (before the norm) -> logits [..., V] in the model's dtype."""
        return self.lm_head(self.head_input(hidden))

    def plain_head_weight(self) -> torch.Tensor | None:
        """The LM head's weight [V, D] when the head is a plain bias-free nn.Linear, so that logits = head_input
        @ weight.T and a loss may apply it in pieces; None for any other head (QAT's FakeQuantLinear, a quantized
        QuantLinear), which must run its own forward."""
        head = self.lm_head
        return head.weight if type(head) is nn.Linear and head.bias is None else None

    def mtp_hidden(self, hidden_BTD: torch.Tensor, next_tokens_BT: torch.Tensor,
                   cache: MLACache | PagedLatentView | None = None) -> torch.Tensor:
        """The MTP block's output [B, T, D] (before its norm) from the main hidden h_i and the next token t_{i+1}."""
        return self.mtp(hidden_BTD, _autocast_dtype(self.model.embed_tokens(next_tokens_BT)), cache=cache)

    def mtp_head_input(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP block's final norm: its outputs [..., D] -> what the shared LM head reads [..., D]."""
        return self.mtp.norm(mtp_hidden)

    def mtp_head(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of t_{i+2} from MTP outputs [..., D] (its norm, then the shared LM head)."""
        return self.lm_head(self.mtp_head_input(mtp_hidden))

    def mtp_logits(self, hidden_BTD: torch.Tensor, next_tokens_BT: torch.Tensor,
                   cache: MLACache | PagedLatentView | None = None) -> torch.Tensor:
        """Logits of t_{i+2} from the main hidden h_i and the next token t_{i+1}: [B, T, V]."""
        return self.mtp_head(self.mtp_hidden(hidden_BTD, next_tokens_BT, cache))

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    def mla_layers(self) -> list[GatedMLA]:
        """MLA layers of the main model (QK-Clip applies to these and to the MTP's)."""
        return [m for m in self.modules() if isinstance(m, GatedMLA)]


# --------------------------------------------------------------------------------------------------------------------
# initialisation and counting


_MTP_SEED_OFFSET = 1_000_003  # MTP weights come from their own generator, so adding MTP leaves main init unchanged


def init_weights(model: K3Model, seed: int) -> None:
    """Initialise every weight deterministically from `seed` (the only init in k3).

    Linear/embedding/expert weights ~ N(0, initializer_range); norm gains 1; AttnRes pseudo-queries 0 (required:
    uniform depth mixture at init); KDA A_log, dt_bias per kda.md section 2; short convs U(-1/sqrt(W), 1/sqrt(W));
    router bias 0. MTP parameters use a separate generator (architecture.md section 10 test: lambda = 0 trains
    bit-identically to a model without MTP).
    """
    cfg = model.config
    std = cfg.initializer_range
    gens = {"main": torch.Generator().manual_seed(seed), "mtp": torch.Generator().manual_seed(seed + _MTP_SEED_OFFSET)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = gens["mtp" if name.startswith("mtp.") else "main"]
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("_res_proj.weight"):
                p.zero_()
            elif leaf == "A_log":
                if cfg.kda_gate_lower_bound is not None:
                    p.zero_()
                else:
                    p.copy_(torch.empty_like(p, device="cpu").uniform_(1, 16, generator=g).log())
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty_like(p, device="cpu").uniform_(
                    torch.log(torch.tensor(1e-3)).item(), torch.log(torch.tensor(1e-1)).item(), generator=g))
                dt = dt.clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif "_conv1d" in name:
                bound = 1.0 / cfg.kda_conv_kernel ** 0.5
                p.copy_(torch.empty_like(p, device="cpu").uniform_(-bound, bound, generator=g))
            elif p.dim() == 1:
                p.fill_(1.0)  # RMSNorm gains
            else:
                p.copy_(torch.empty_like(p, device="cpu").normal_(0.0, std, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> K3Model:
    """Construct and initialise a K3Model on `device`."""
    model = K3Model(cfg)
    init_weights(model, seed)
    return model.to(device)


def weight_numels(model: nn.Module) -> dict[str, int]:
    """name -> element count of every weight: the parameters, plus the logical weights of quantized routed experts
    (k3.model.quant.QuantGroupedExperts holds them as packed integer buffers), counted as the tensors they stand for,
    so a quantized model counts as its unquantized source. QAT's learned scales (`*_scales` parameters,
    k3.model.quant.enable_fake_quant) are quantization state, not weights: left out."""
    out = {n: p.numel() for n, p in model.named_parameters() if not n.endswith("_scales")}
    for mn, m in model.named_modules():
        for n, numel in getattr(m, "logical_weights", lambda: ())():
            out[f"{mn}.{n}"] = numel
    return out


def count_parameters(model: K3Model) -> dict[str, int]:
    """Parameter counts as in architecture.md section 2 (main model, MTP counted apart).

    total / active (top-K of the routed experts) / active_nonembed (without embedding and head) / mtp.
    """
    cfg = model.config
    numels = weight_numels(model)
    main = {n: k for n, k in numels.items() if not n.startswith("mtp.")}
    total = sum(main.values())
    inactive = 0
    for n, k in main.items():
        if ".mlp.experts." in n:
            inactive += k * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    # from the logical counts: a quantized head's `weight` buffer holds packed int4 pairs
    embed = numels["model.embed_tokens.weight"] + (0 if cfg.tie_word_embeddings else numels["lm_head.weight"])
    mtp = sum(k for n, k in numels.items() if n.startswith("mtp."))
    return {"total": total, "active": total - inactive, "active_nonembed": total - inactive - embed,
            "total_nonembed": total - embed, "mtp": mtp}


def describe_parameters(counts: dict[str, int]) -> str:
    """The size line every command prints for a model, from `count_parameters`, so that `k3 pretrain` and `k3 serve`
    give one checkpoint the same figures: the main model's total (the MTP module apart, as architecture.md section 2
    counts), its active part, and the MTP module.

    Example: describe_parameters(count_parameters(model)) -> "0.31M params (0.25M active, MTP 0.05M)"
    """
    return (f"{counts['total'] / 1e6:.2f}M params ({counts['active'] / 1e6:.2f}M active, "
            f"MTP {counts['mtp'] / 1e6:.2f}M)")
