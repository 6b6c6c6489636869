"""The `k3 ablate` suites as data: for each claim of the K3 report, the paired arms, what is read from each run
and the criterion its verdict applies (docs/ablate.md).

An arm is a label plus the `--set` overrides it adds to the scale's base (the `tiny` or `small` pretrain preset,
shortened to the scale's step budget). Every arm of a suite shares the base, so they share data (data.seed), the
seed of each seed index (train.seed) and max_steps x batch x seq_len; the pairing test checks that the resolved
configs of two arms differ in exactly the keys their overrides name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3.model.config import ConfigError


class AblateError(ConfigError):
    """A suite name, scale or run directory that cannot be used; the message names it and the fix.
    A ConfigError, so `k3` prints it as `error: ...` with exit code 2."""


@dataclass(frozen=True)
class Scale:
    """A scale: the pretrain preset arms start from and the budget every pretrain arm trains for."""

    name: str
    preset: str  # pretrain preset
    steps: int  # train.max_steps of every pretrain arm
    eval_every: int
    extend_preset: str  # extend-context preset of the nope suite's children
    extend_steps: int
    extend_seq_len: int  # the children's sequence length (the parent trains at the preset's)
    passkey_lengths: tuple[int, ...]  # nope: 2-16x the parent's training length
    hybrid_passkey_lengths: tuple[int, ...]  # hybrid: within the training length
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_trials: int = 4
    qk_tau: float = 20.0  # muon suite: the forced QK-Clip threshold
    high_lr: float = 0.05  # muon suite: the learning rate that drives the logits up
    quantize_preset: str = "default"  # qat suite: the k3 quantize preset
    quantize_steps: int = 30  # qat suite: QAT fine-tuning steps
    loss_batches: int = 8  # qat suite: validation batches of the common loss evaluation of every release
    extend_keep_tokens: bool = True  # children train the parent's tokens per step (batch = tokens / length)
    extra_sets: tuple[str, ...] = ()  # --set overrides of every run at this scale (data caps of a smoke scale)
    # opd suite: the teacher and the student parent pretrain for these steps; both students then train opd_steps
    # steps of opd_batch prompts (opd) or sequences (sft) of opd_prompt_tokens + opd_new_tokens tokens
    opd_teacher_steps: int = 120
    opd_student_steps: int = 30
    opd_steps: int = 30
    opd_batch: int = 16
    opd_prompt_tokens: int = 32  # BOS included
    opd_new_tokens: int = 64  # distill.max_new_tokens: completion tokens per prompt at most
    opd_eval_prompts: int = 64  # held-out prompts of the reverse-KL / teacher-sample evaluation
    opd_preset: str = "default"  # the k3 distill preset (optimizer and sampling settings of both students)
    opd_sft_val_fraction: float = 0.05  # the teacher samples the sft run holds out (its own validation)


# tiny: the default CPU preset (d=128, 8 layers, 16 x 256 tokens per step, ~2 s per step on 2 idle cores), 60 steps
# (246k tokens) per arm: the 19 pretrain arms and 2 extensions of claims 1-8 take about an hour at one seed
SCALES = {
    "tiny": Scale("tiny", "tiny", steps=60, eval_every=30, extend_preset="tiny", extend_steps=30, extend_seq_len=512,
                  passkey_lengths=(512, 1024, 2048, 4096), hybrid_passkey_lengths=(128, 256), passkey_trials=4,
                  # unclipped at lr 0.05 the tiny model's max MLA logit grew ~0.1 per step (2.1 at step 20 of a
                  # 20-step check): a tau of 3 is crossed within the 60 steps, the default 100 never would be
                  qk_tau=3.0),
    "small": Scale("small", "small", steps=1000, eval_every=250, extend_preset="small", extend_steps=200,
                   extend_seq_len=8192, passkey_lengths=(8192, 16384, 32768, 65536),
                   hybrid_passkey_lengths=(1024, 4096), passkey_trials=8, high_lr=0.02,
                   quantize_preset="small", quantize_steps=200, extend_keep_tokens=False,
                   # a teacher of twice the pretrain budget; the distill preset small's 64 prompts x 256 tokens
                   opd_teacher_steps=2000, opd_student_steps=500, opd_steps=200, opd_batch=64, opd_prompt_tokens=128,
                   opd_new_tokens=256, opd_eval_prompts=256, opd_preset="small"),
}


@dataclass(frozen=True)
class Arm:
    label: str
    sets: tuple[str, ...] = ()  # --set overrides on top of the suite's shared base
    # "pretrain" | "extend-context" | "quantize" | "finetune" (pretrain --init parent) | "distill" (k3 distill)
    command: str = "pretrain"
    parent: str | None = None  # extend-context / quantize / finetune / distill: the arm whose final/ it starts from
    position: str | None = None  # extend-context: nope | rope
    mode: str | None = None  # quantize: ptq | qat
    teacher: str | None = None  # distill, and the finetune on the teacher's samples: the teacher arm
    budget: str = "quantize"  # finetune: the command whose steps, batch and optimizer it copies (quantize | distill)


@dataclass(frozen=True)
class Comparison:
    """One verdict: treatment vs baseline on `metric`, paired by seed (delta = treatment - baseline).

    kind: "lower" (claim holds when the mean delta < 0), "higher" (> 0), "not_worse" (delta <= tol),
    "at_most" (treatment's value <= bound, a suite field), "exceeds" (treatment's value > bound; a precondition),
    "recovered" (per seed (baseline - treatment) / (baseline - reference): the fraction of the baseline's loss
    gap to the reference the treatment recovers; holds when its mean > 0).
    """

    claim: str  # the verdict line's text, e.g. "attnres lowers val loss"
    treatment: str
    baseline: str | None
    metric: str
    kind: str
    tol: float = 0.0
    bound: str | None = None  # at_most / exceeds: a Scale field (qk_tau)
    precondition: str | None = None  # at_most: the arm whose `exceeds` comparison must hold for this to be tested
    reference: str | None = None  # recovered: the unquantized arm


@dataclass(frozen=True)
class Suite:
    name: str
    claim_no: int
    claim: str
    arms: tuple[Arm, ...]
    comparisons: tuple[Comparison, ...]
    base_sets: tuple[str, ...] = ()  # shared by every arm of the suite
    metrics: tuple[str, ...] = ("val_loss", "val_bpb", "tokens_per_s")
    glu_hook: bool = False  # record max |h| of the GLU intermediate (c2glu)
    passkey: tuple[str, ...] = ()  # labels of the arms evaluated with k3 eval passkey
    loss_eval: tuple[str, ...] = ()  # labels of the arms whose releases get the common loss evaluation (qat, opd)
    opd_eval: tuple[str, ...] = ()  # labels of the arms scored against the teacher on held-out prompts (opd)
    plots: tuple[str, ...] = ("loss",)
    note: str = ""
    wired: bool = True


EQUAL_TOL = 0.01  # nats: "equal or better loss" allows the treatment this much above the baseline

SUITES: dict[str, Suite] = {}


def _add(s: Suite) -> None:
    SUITES[s.name] = s


_add(Suite(
    "attnres", 1, "Block Attention Residuals lower loss vs Pre-LN; one block per layer reduces to Pre-LN exactly",
    arms=(Arm("attnres"), Arm("preln", ("model.residual=preln",)),
          Arm("attnres-b1", ("model.attn_res_block_size=1",))),
    comparisons=(Comparison("attnres lowers val loss vs Pre-LN", "attnres", "preln", "val_loss", "lower"),),
    note="The exact reduction is an identity of the forward, checked by tests/model (not by training); "
         "attnres-b1 (one layer per block) is reported alongside."))

_add(Suite(
    "c2glu", 2, "C2-GLU bounds the intermediate activations (max |h| over training) at no loss cost vs SwiGLU",
    arms=(Arm("c2glu"), Arm("swiglu", ("model.hidden_act=swiglu",))),
    comparisons=(Comparison("c2glu lowers max |h| vs SwiGLU", "c2glu", "swiglu", "glu_max_abs", "lower"),
                 Comparison("c2glu loss equal or better than SwiGLU", "c2glu", "swiglu", "val_loss", "not_worse",
                            tol=EQUAL_TOL)),
    metrics=("val_loss", "val_bpb", "glu_max_abs", "tokens_per_s"), glu_hook=True, plots=("loss", "glu"),
    note="max |h|: the largest |h| of any GLU intermediate (dense MLP, shared and routed experts, MTP) in any "
         "training forward; C2-GLU's bound is beta1 x beta2 = 100."))

_add(Suite(
    "balance", 3, "Quantile Balancing keeps expert load more even than the loss-free bias rule, equal or better loss",
    base_sets=("model.first_k_dense=0",),
    arms=(Arm("qb", ("optim.router_balance=qb",)), Arm("loss_free", ("optim.router_balance=loss_free",))),
    comparisons=(Comparison("qb lowers router max violation vs loss-free", "qb", "loss_free",
                            "router_max_violation", "lower"),
                 Comparison("qb loss equal or better than loss-free", "qb", "loss_free", "val_loss", "not_worse",
                            tol=EQUAL_TOL)),
    metrics=("val_loss", "router_max_violation", "router_cv", "tokens_per_s"), plots=("loss", "router"),
    note="Layer 1 is an MoE layer in both arms (model.first_k_dense=0). router_max_violation: the train loop's "
         "per-step maximum over layers of max load / mean load - 1, averaged over the second half of the logged "
         "steps; router_cv likewise (the mean over layers of the load's coefficient of variation)."))

_add(Suite(
    "latent_moe", 4, "Latent MoE cuts dispatch bytes per token by the latent ratio at equal or better loss vs a "
                     "standard MoE of equal active expert parameters",
    arms=(Arm("latent"),
          # l = d (full-width dispatch), no latent norm, half the expert width: K x 3 x m x l, the experts'
          # active parameters, equals the latent arm's; its d x d projections are extra capacity the baseline keeps
          Arm("standard", ("model.moe_latent_size=@d_model", "model.latent_norm_pos=none",
                           "model.moe_intermediate_size=@half_moe_intermediate"))),
    comparisons=(Comparison("latent MoE cuts dispatch bytes per token", "latent", "standard",
                            "dispatch_bytes_per_token", "lower"),
                 Comparison("latent MoE loss equal or better than standard", "latent", "standard", "val_loss",
                            "not_worse", tol=EQUAL_TOL)),
    metrics=("val_loss", "dispatch_bytes_per_token", "n_params_active", "tokens_per_s"),
    note="dispatch bytes per token and MoE layer: 2 K w b (both directions, bf16 b = 2, w = model.moe_latent_size; "
         "docs/parallel.md), from the recorded config. The standard arm's W_down / W_up (d x d) are not identities, "
         "so it has more active parameters than a true standard MoE: the comparison favours the baseline."))

_add(Suite(
    "hybrid", 5, "3:1 KDA:MLA hybrid vs all-MLA and all-KDA: loss, passkey accuracy and tokens/s",
    base_sets=("data.passkey_fraction=0.1",),
    arms=(Arm("hybrid"), Arm("all-mla", ("model.full_attn_layers=@all_layers",)),
          Arm("all-kda", ("model.full_attn_layers=[]",))),
    comparisons=(Comparison("hybrid loss equal or better than all-MLA", "hybrid", "all-mla", "val_loss",
                            "not_worse", tol=EQUAL_TOL),
                 Comparison("hybrid loss equal or better than all-KDA", "hybrid", "all-kda", "val_loss",
                            "not_worse", tol=EQUAL_TOL),
                 Comparison("hybrid passkey accuracy above all-KDA", "hybrid", "all-kda", "passkey", "higher"),
                 Comparison("hybrid faster than all-MLA (tokens/s)", "hybrid", "all-mla", "tokens_per_s",
                            "higher")),
    metrics=("val_loss", "val_bpb", "passkey", "tokens_per_s"), passkey=("hybrid", "all-mla", "all-kda"),
    plots=("loss", "passkey"),
    note="Every arm trains with 10% passkey documents so that retrieval is learnable; passkey: mean exact-match "
         "accuracy over the scale's lengths (within the training length) and depths."))

_add(Suite(
    "muon", 6, "Muon vs AdamW loss; QK-Clip keeps the max attention logit at or below tau (forced with a high LR)",
    arms=(Arm("muon"), Arm("adamw", ("optim.optimizer=adamw",)),
          Arm("clip-high-lr", ("optim.lr=@high_lr", "optim.qk_clip_tau=@qk_tau")),
          Arm("noclip-high-lr", ("optim.lr=@high_lr", "optim.qk_clip_tau=null"))),
    comparisons=(Comparison("muon lowers val loss vs AdamW", "muon", "adamw", "val_loss", "lower"),
                 Comparison("without QK-Clip the high LR drives the max logit above tau", "noclip-high-lr", None,
                            "max_attn_logit", "exceeds", bound="qk_tau"),
                 Comparison("QK-Clip keeps the max logit at or below tau", "clip-high-lr", None,
                            "max_attn_logit_after_first", "at_most", tol=0.6, bound="qk_tau",
                            precondition="noclip-high-lr")),
    metrics=("val_loss", "max_attn_logit", "max_attn_logit_after_first", "tokens_per_s"), plots=("loss", "logit"),
    base_sets=("train.log_every=1",),  # the max logit of every step, not of every tenth
    note="Both optimizers share optim.lr (the preset's). max_attn_logit: the largest per-step max MLA logit "
         "(measured in the forward, before that step's clip). The clip rescales W_q, W_k after the update with that "
         "step's forward max, so the post-clip logit of that batch is tau (to 1e-7); the next forward sees one "
         "more update and another batch, and exceeds tau by their product (measured at lr 0.05, tiny: growth per "
         "update up to 1.30, batch to batch up to 1.20). The criterion reads the max from the second step on and "
         "allows 60% above tau (4.8 at tau 3); unclipped, the same run reaches 12-15."))

_add(Suite(
    "nope", 7, "NoPE extension vs RoPE-kept extension from one parent: passkey at 2-16x the training length",
    arms=(Arm("parent"),
          Arm("extend-nope", command="extend-context", parent="parent", position="nope"),
          Arm("extend-rope", command="extend-context", parent="parent", position="rope")),
    comparisons=(Comparison("NoPE extension passkey above RoPE-kept", "extend-nope", "extend-rope", "passkey",
                            "higher"),
                 Comparison("NoPE extension val loss vs RoPE-kept", "extend-nope", "extend-rope", "val_loss",
                            "not_worse", tol=EQUAL_TOL)),
    metrics=("val_loss", "passkey", "tokens_per_s"), passkey=("extend-nope", "extend-rope"),
    plots=("loss", "passkey"),
    note="The parent pretrains at the preset's length; both children extend it with k3 extend-context's preset to "
         "the scale's extend length (10% passkey documents); passkey at 2-16x the parent's training length."))

_add(Suite(
    "schedule", 8, "Cosine vs WSD at equal steps",
    arms=(Arm("cosine", ("optim.schedule=cosine",)), Arm("wsd", ("optim.schedule=wsd",))),
    comparisons=(Comparison("WSD loss equal or better than cosine at equal steps", "wsd", "cosine", "val_loss",
                            "not_worse", tol=EQUAL_TOL),),
    note="WSD decays over the last optim.wsd_decay_fraction (20%) of the steps."))

_add(Suite(
    "opd", 9, "On-policy distillation vs SFT on teacher samples at equal student compute",
    arms=(Arm("teacher", ("train.max_steps=@opd_teacher_steps",)),
          Arm("student", ("train.max_steps=@opd_student_steps",)),
          Arm("opd", command="distill", parent="student", teacher="teacher"),
          Arm("sft", command="finetune", parent="student", teacher="teacher", budget="distill")),
    comparisons=(Comparison("the teacher's held-out loss is below the student parent's (the setup's precondition)",
                            "teacher", "student", "eval_loss", "lower"),
                 Comparison("OPD lowers the reverse KL to the teacher on held-out prompts vs SFT", "opd", "sft",
                            "reverse_kl", "lower"),
                 Comparison("OPD lowers the loss on the teacher's samples of held-out prompts vs SFT", "opd", "sft",
                            "teacher_nll", "lower")),
    metrics=("eval_loss", "reverse_kl", "teacher_nll", "completion_tokens_per_step", "train_tokens_per_step",
             "wall_time_s"),
    loss_eval=("teacher", "student", "opd", "sft"), opd_eval=("teacher", "student", "opd", "sft"), plots=("opd",),
    note="teacher and student: pretrain arms of the base config for the scale's opd_teacher_steps and "
         "opd_student_steps. opd: k3 distill of the student from the teacher (reverse KL on the student's own "
         "samples) on train prompts drawn from the training split; sft: the student fine-tuned (k3 pretrain --init) "
         "on the teacher's samples of the same prompts, generated once by k3 distill's batched generation with its "
         "sampling settings, loss on completion tokens only. Equal: the student's optimizer steps, optimizer and "
         "schedule (the distill preset's), prompts / sequences per step, seeds, and the tokens a step trains on "
         "(prompt + completion: the sft arm's sequence length is opd_prompt_tokens + opd_new_tokens, so that its "
         "packed windows hold as many completion tokens per step as the opd arm's completions; both columns show "
         "the measured counts). Not equal: opd also samples from the student and runs the teacher's forward every "
         "step (wall_time_s), sft samples the teacher once beforehand (not counted); sft windows are packed "
         "records that can straddle two samples, and it also learns the end-of-document token after each sample. "
         "eval_loss: every release on the student parent's first validation windows; reverse_kl: KL(student || "
         "teacher) per completion token of the student's samples of held-out prompts (the validation split), "
         "teacher_nll: the student's -log p of the teacher's samples of those prompts (same seeds for every arm)."))

_add(Suite(
    "qat", 10, "W4A8 QAT vs PTQ: recovered fraction",
    arms=(Arm("parent"), Arm("bf16-ft", ("data.source=stdlib",), command="finetune", parent="parent"),
          Arm("ptq", ("quantize.mode=ptq", "quantize.data=stdlib"), command="quantize", parent="bf16-ft",
              mode="ptq"),
          Arm("qat", ("quantize.mode=qat", "quantize.data=stdlib"), command="quantize", parent="parent",
              mode="qat")),
    comparisons=(Comparison("QAT recovers part of PTQ's loss gap to the unquantized model", "qat", "ptq",
                            "eval_loss", "recovered", tol=1e-3, reference="bf16-ft"),
                 Comparison("QAT release loss below PTQ's", "qat", "ptq", "eval_loss", "lower")),
    metrics=("eval_loss", "val_loss"), loss_eval=("parent", "bf16-ft", "ptq", "qat"),
    note="W4A8 (int4 weights in groups of 32, FP8 activations) of the routed experts (k3 quantize's default). ptq: "
         "round-to-nearest with clipping calibrated on the stdlib train split; qat: the scale's QAT steps of "
         "fake-quantized fine-tuning of the parent, then conversion; bf16-ft: the parent fine-tuned unquantized with "
         "QAT's steps, data and optimizer settings (k3 pretrain --init), and ptq quantizes bf16-ft, so that all three "
         "end with equal training. eval_loss: every release evaluated on the same first validation windows of the "
         "parent's data (the scale's loss_batches x train batch); recovered fraction = (ptq - qat) / "
         "(ptq - bf16-ft)."))


def _placeholders(model: dict, scale: Scale) -> dict[str, str]:
    """Values of the `@name` placeholders in arm overrides, from the scale's resolved base model."""
    n = int(model["n_layers"])
    return {"d_model": str(model["d_model"]), "half_moe_intermediate": str(max(8, int(model["moe_intermediate_size"]) // 2)),
            "all_layers": "[" + ",".join(str(i) for i in range(1, n + 1)) + "]",
            "high_lr": f"{scale.high_lr:g}", "qk_tau": f"{scale.qk_tau:g}",
            "opd_teacher_steps": str(scale.opd_teacher_steps), "opd_student_steps": str(scale.opd_student_steps)}


def expand_sets(sets: tuple[str, ...], model: dict, scale: Scale) -> list[str]:
    """The overrides with `@name` placeholders replaced: '--set model.moe_latent_size=@d_model' -> '...=128'."""
    ph = _placeholders(model, scale)
    out = []
    for s in sets:
        key, _, val = s.partition("=")
        out.append(f"{key}={ph[val[1:]]}" if val.startswith("@") else s)
    return out


@dataclass
class PlannedRun:
    """One run of the plan: suite, arm, seed, directory and the --set list of the equivalent command."""

    suite: Suite
    arm: Arm
    seed: int
    run_dir: object  # Path
    sets: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.suite.name}/{self.arm.label}/seed-{self.seed}"
