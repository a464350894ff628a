"""Mixture-of-experts layout as data: which blocks route their feed-forward through experts, how many, top-k.

A MoE block is a dense block whose MLP is replaced by a router (one linear, hidden -> num_experts) and
`num_experts` SwiGLU experts of `expert_intermediate_size`; each token runs the `top_k` experts of highest
softmax probability, weighted by those probabilities (renormalised over the k when `norm_topk_prob`).
Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek differ only in these values and in the checkpoint's tensor names
(`naming`), so one implementation serves them all. Read from a Hugging Face config.json by `moe_from_hf_config`.
"""
from __future__ import annotations

from dataclasses import dataclass

from helmc.errors import HelmcError
from helmc.model.arch import ARCHITECTURES

MOE_ARCHITECTURES = tuple(name for name, entry in ARCHITECTURES.items() if entry.moe)   # the registry's
# Checkpoint names (relative to model.layers.{i}.) per naming scheme: the router's weight, and one expert's
# gate, up and down weights with {e} its index.
NAMINGS = {
    "qwen_moe": ("mlp.gate.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                     "mlp.experts.{e}.down_proj.weight")),
    "mixtral": ("block_sparse_moe.gate.weight", ("block_sparse_moe.experts.{e}.w1.weight",
                                                 "block_sparse_moe.experts.{e}.w3.weight",
                                                 "block_sparse_moe.experts.{e}.w2.weight")),
    # gpt-oss: the checkpoint's fused experts (mlp.experts.gate_up_proj [E, H, 2I] and down_proj [E, I, H], with
    # their biases) read as these per-expert names (runtime/weights/fused_experts.py); llama.cpp's stacks alike.
    "gpt_oss": ("mlp.router.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                      "mlp.experts.{e}.down_proj.weight")),
}
# Namings whose checkpoints store each block's experts fused in a few tensors, split by the weights reader.
FUSED_EXPERT_NAMINGS = ("gpt_oss",)
MAX_EXPERTS = 4096
# How a router's logits become the k experts' weights: softmax over all experts then the k largest (renormalised
# when norm_topk_prob; Qwen, Mixtral), or the k largest logits then a softmax over those k (gpt-oss).
ROUTINGS = ("softmax_topk", "topk_softmax")
# The experts' gated activation: SwiGLU, down(silu(gate) * up); or gpt-oss's clamped one: gate clamped above at
# swiglu_limit, up to +-swiglu_limit, down((up + 1) * gate * sigmoid(swiglu_alpha * gate)).
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int                        # experts per token (num_experts_per_tok)
    norm_topk_prob: bool              # renormalise the k selected probabilities to sum to 1
    expert_intermediate_size: int     # moe_intermediate_size
    dense_layers: tuple[int, ...] = ()  # blocks with a dense MLP (mlp_only_layers, decoder_sparse_step)
    num_shared_experts: int = 0       # always-on experts beside the routed ones (Qwen2-MoE, DeepSeek)
    shared_intermediate_size: int = 0
    naming: str = "qwen_moe"
    routing: str = "softmax_topk"     # a ROUTINGS entry
    router_bias: bool = False         # the router linear has a bias (gpt-oss)
    expert_bias: bool = False         # each expert's gate, up and down have biases (gpt-oss)
    expert_act: str = "silu"          # an EXPERT_ACTIVATIONS entry, with its alpha and limit
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name, most in (("num_experts", MAX_EXPERTS), ("top_k", MAX_EXPERTS), ("expert_intermediate_size", 1 << 20)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v > most:
                raise HelmcError(f"model spec: moe {name} expected a positive integer of at most {most}, found {v!r}")
        if self.top_k > self.num_experts:
            raise HelmcError(f"model spec: moe top_k expected at most num_experts ({self.num_experts}), found {self.top_k}")
        if list(self.dense_layers) != sorted(set(self.dense_layers)) or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.dense_layers):
            raise HelmcError(f"model spec: moe dense_layers expected increasing block indices, found "
                             f"{str(self.dense_layers)[:80]}")
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0 or \
                (self.num_shared_experts > 0) != (self.shared_intermediate_size > 0):
            raise HelmcError(f"model spec: moe shared experts expected a count and a size both 0 or both positive, "
                             f"found {self.num_shared_experts} and {self.shared_intermediate_size}")
        for name, choices in (("routing", ROUTINGS), ("expert_act", EXPERT_ACTIVATIONS)):
            if getattr(self, name) not in choices:
                raise HelmcError(f"model spec: moe {name} expected one of {choices}, found {getattr(self, name)!r:.60}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise HelmcError(f"model spec: moe {name} expected a positive finite number, found {v!r:.60}")
        if self.naming not in NAMINGS:
            raise HelmcError(f"model spec: moe naming expected one of {sorted(NAMINGS)}, found {self.naming!r}")

    @property
    def router_name(self) -> str:
        return NAMINGS[self.naming][0]

    @property
    def router_bias_name(self) -> str | None:
        return self.router_name.replace(".weight", ".bias") if self.router_bias else None

    @property
    def fused_experts(self) -> bool:
        """The checkpoint stores a block's experts fused (FUSED_EXPERT_NAMINGS), split when read."""
        return self.naming in FUSED_EXPERT_NAMINGS

    @property
    def plain_experts(self) -> bool:
        """The experts are down(silu(gate) * up) without biases: the GPU expert kernels' computation and the CPU's
        one-call expert sums'; gpt-oss's biased, clamped experts have CPU sums of their own (`biased_experts`)."""
        return self.expert_act == "silu" and not self.expert_bias

    @property
    def biased_experts(self) -> bool:
        """gpt-oss's experts: biases and the clamped SwiGLU (the CPU's biased one-call expert sums)."""
        return self.expert_act == "swiglu_clamped" and self.expert_bias

    def expert_bias_names(self, expert: int) -> tuple[str, ...]:
        """Expert `expert`'s gate, up and down biases (gpt-oss), else ()."""
        if not self.expert_bias:
            return ()
        return tuple(n.replace(".weight", ".bias") for n in self.expert_weight_names(expert))

    def expert_param_names(self, expert: int) -> tuple[str, ...]:
        """The compiled expert function's weight parameters: gate, up, down, then their biases where present."""
        return self.expert_weight_names(expert) + self.expert_bias_names(expert)

    def expert_weight_names(self, expert: int) -> tuple[str, str, str]:
        """Expert `expert`'s gate, up and down weights (relative to model.layers.{i}.), the compiled expert
        function's parameter order."""
        return tuple(n.format(e=expert) for n in NAMINGS[self.naming][1])

    def expert_kind(self, name: str) -> int | None:
        """0, 1, 2 for an expert's gate, up, down weight name (relative to model.layers.{i}.), else None."""
        for kind, template in enumerate(NAMINGS[self.naming][1]):
            head, tail = template.split("{e}")
            if name.startswith(head) and name.endswith(tail) and name[len(head):len(name) - len(tail)].isdigit():
                return kind
        return None

    def layer_weight_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """The feed-forward weights of a MoE block: the router's, then every expert's gate, up, down."""
        I = self.expert_intermediate_size
        out = {self.router_name: (self.num_experts, hidden)}
        if self.router_bias:
            out[self.router_bias_name] = (self.num_experts,)
        for e in range(self.num_experts):
            g, u, d = self.expert_weight_names(e)
            out.update({g: (I, hidden), u: (I, hidden), d: (hidden, I)})
            out.update(zip(self.expert_bias_names(e), ((I,), (I,), (hidden,))))
        return out


def moe_from_hf_config(cfg: dict, arch: str, num_layers: int, where: str) -> MoeSpec | None:
    """The MoE layout of a config.json of `arch` (None for a dense architecture). Qwen3-MoE writes num_experts
    (transformers >= 5 also num_local_experts); a block is dense when listed in mlp_only_layers or when
    (i + 1) is not a multiple of decoder_sparse_step. Mixtral: every block routed, intermediate_size the
    experts', the top-k always renormalised."""
    if arch not in MOE_ARCHITECTURES:
        return None

    def integer(key, default=None, alt=None):
        v = cfg.get(key, cfg.get(alt) if alt else None)
        if v is None and default is not None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise HelmcError(f"{where}: {key!r} expected a non-negative integer for {arch}, found {v!r:.60}")
        return v
    if arch == "GptOssForCausalLM":
        return _gpt_oss_moe(cfg, integer, where)
    if arch == "MixtralForCausalLM":
        try:
            return MoeSpec(num_experts=integer("num_local_experts"), top_k=integer("num_experts_per_tok"),
                           norm_topk_prob=True, expert_intermediate_size=integer("intermediate_size"),
                           naming=ARCHITECTURES[arch].moe_naming)
        except HelmcError as e:
            raise HelmcError(f"{where}: {e}") from None
    experts = integer("num_experts", alt="num_local_experts")
    step = integer("decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                             for i in only):
        raise HelmcError(f"{where}: mlp_only_layers expected a list of block indices below {num_layers}, "
                         f"found {str(only)[:60]}")
    if step < 1:
        raise HelmcError(f"{where}: decoder_sparse_step expected a positive integer, found {step}")
    dense = tuple(i for i in range(num_layers) if i in only or experts == 0 or (i + 1) % step)
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise HelmcError(f"{where}: norm_topk_prob expected true or false, found {norm!r:.60}")
    try:
        return MoeSpec(num_experts=experts, top_k=integer("num_experts_per_tok"), norm_topk_prob=norm,
                       expert_intermediate_size=integer("moe_intermediate_size"), dense_layers=dense)
    except HelmcError as e:
        raise HelmcError(f"{where}: {e}") from None


def _gpt_oss_moe(cfg: dict, integer, where: str) -> MoeSpec:
    """gpt-oss: every block routed, intermediate_size the experts', top-k logits then a softmax over those k, router
    and expert biases, the clamped SwiGLU with config.json's swiglu_alpha (transformers' 1.702 where absent) and
    swiglu_limit."""
    def positive(key, default):
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise HelmcError(f"{where}: {key!r} expected a positive finite number, found {v!r:.60}")
        return float(v)
    try:
        return MoeSpec(num_experts=integer("num_local_experts"), top_k=integer("num_experts_per_tok"),
                       norm_topk_prob=True, expert_intermediate_size=integer("intermediate_size"), naming="gpt_oss",
                       routing="topk_softmax", router_bias=True, expert_bias=True, expert_act="swiglu_clamped",
                       swiglu_alpha=positive("swiglu_alpha", 1.702), swiglu_limit=positive("swiglu_limit", 7.0))
    except HelmcError as e:
        raise HelmcError(f"{where}: {e}") from None
