"""The in-house policy's shape, importable without torch.

`PolicyConfig` is what `rlbus.models.policy.Policy` is built from; the run config's ``[model]`` table
(`rlbus.launch.config`) is read into it, and the prompt producer and reward worker load that module without
ever importing torch, so the shape lives here rather than beside the model. `DEMO_SHAPE` is the policy
`rlbus demo` trains (and every run config's default): 3 blocks of width 96, 4 experts top-2, 0.6 M
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbus.errors import ConfigError


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of the policy. ``n_experts = 0`` makes every feed-forward a dense SwiGLU MLP."""

    vocab: int = 272
    """Vocabulary size; 272 = the byte tokenizer's 256 bytes + 16 special tokens."""
    d_model: int = 128
    """Residual stream width."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads; d_model / n_head must be even (RoPE rotates pairs)."""
    max_seq: int = 256
    """Context length the model is meant for (prompt + generated tokens)."""
    rope_theta: float = 10_000.0
    """RoPE base: frequencies are theta^(-2i/head_dim)."""
    n_experts: int = 4
    """Experts per MoE feed-forward; 0 = dense."""
    top_k: int = 2
    """Experts each token is routed to."""
    d_ff: int = 128
    """Hidden width of each expert MLP (of the dense MLP when n_experts = 0)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss in `LMOutput.aux_loss`."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layer", "n_head", "max_seq", "d_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be positive")
        if self.d_model % self.n_head != 0:
            raise ConfigError("n_head", f"must divide d_model={self.d_model}")
        if (self.d_model // self.n_head) % 2 != 0:
            raise ConfigError("n_head", "head_dim = d_model / n_head must be even for RoPE")
        if self.n_experts < 0:
            raise ConfigError("n_experts", "must be >= 0")
        if self.n_experts > 0 and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError("top_k", f"must be in [1, n_experts={self.n_experts}]")
        if self.aux_loss_coef < 0:
            raise ConfigError("aux_loss_coef", "must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @classmethod
    def tiny(cls) -> PolicyConfig:
        """~1.1M parameters, MoE 4 experts top-2: fast enough for unit tests on a shared CPU."""
        return cls(vocab=272, d_model=128, n_layer=4, n_head=4, max_seq=256, n_experts=4, top_k=2, d_ff=128)

    @classmethod
    def bench(cls) -> PolicyConfig:
        """~95M parameters (~38M active per token), MoE 8 experts top-2: the benchmark model."""
        return cls(vocab=272, d_model=768, n_layer=8, n_head=12, max_seq=1024, n_experts=8, top_k=2, d_ff=512)


#: The demo's policy (0.6 M parameters, byte-level): the default of the run config's ``[model]`` table.
DEMO_SHAPE = PolicyConfig(vocab=272, d_model=96, n_layer=3, n_head=4, max_seq=64, n_experts=4, top_k=2, d_ff=128)
