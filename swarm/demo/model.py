"""The demo's model: a small byte-level transformer whose middle layer is a remote mixture of experts.

    bytes -> embedding -> causal attention block -> RemoteMixtureOfExperts -> causal attention block
          -> layer norm -> next-byte logits

The dense layers (embeddings, attention blocks, the mixture's gating network, the head) live in
every trainer and are trained together through `swarm.Optimizer`; the experts are `ffn` blocks
(``x + FFN(LayerNorm(x))``) on an expert server, trained there by the gradients trainers send
back. Every token is routed on its own, so a batch of B windows of T bytes sends B*T rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swarm.core.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model.

    Attributes:
        hidden_dim: width of every layer; the experts' `--hidden-dim` must match.
        context: bytes per training window (positions the model knows).
        heads: attention heads per block.
        grid_size: the expert grid, e.g. (2, 2) for experts ffn.0.0 .. ffn.1.1.
        uid_prefix: the grid's UID prefix.
        k_best: experts each token is routed to.
    """

    hidden_dim: int = 128
    context: int = 64
    heads: int = 4
    grid_size: tuple[int, int] = (2, 2)
    uid_prefix: str = "ffn."
    k_best: int = 2

    def __post_init__(self) -> None:
        if self.hidden_dim % self.heads:
            raise ConfigError(f"hidden_dim {self.hidden_dim} must be a multiple of heads {self.heads}")
        if self.context < 2 or self.k_best < 1:
            raise ConfigError("context must be >= 2 and k_best >= 1")

    @property
    def expert_pattern(self) -> str:
        """The `--experts` pattern of a server holding the whole grid, e.g. 'ffn.[0:2].[0:2]'."""
        return self.uid_prefix + ".".join(f"[0:{n}]" for n in self.grid_size)


def causal_block(config: ModelConfig) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(config.hidden_dim, config.heads, 4 * config.hidden_dim, dropout=0.0,
                                      activation="gelu", batch_first=True, norm_first=True)


class ByteLM(nn.Module):
    mask: torch.Tensor
    """Next-byte prediction with a mixture-of-experts layer in the middle.

    Args:
        config: model sizes.
        mixture: the middle layer: a `swarm.RemoteMixtureOfExperts` over `(..., hidden_dim)`
            (or any module with that signature, e.g. a local stand-in for tests).
    """

    def __init__(self, config: ModelConfig, mixture: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(256, config.hidden_dim)
        self.position = nn.Parameter(torch.randn(config.context, config.hidden_dim) * 0.02)
        self.lower = causal_block(config)
        self.mixture = mixture
        self.upper = causal_block(config)
        self.norm = nn.LayerNorm(config.hidden_dim)
        self.head = nn.Linear(config.hidden_dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(config.context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits `(batch, length, 256)` for int64 `tokens` `(batch, length)`, length <= context."""
        length = tokens.shape[1]
        mask = self.mask[:length, :length]
        h = self.embed(tokens) + self.position[:length]
        h = self.lower(h, src_mask=mask, is_causal=True)
        h = self.mixture(h)
        h = self.upper(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the next byte, in nats."""
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def dense_parameters(self) -> list[nn.Parameter]:
        """What `swarm.Optimizer` trains: everything here (the experts' parameters live on servers)."""
        return [p for p in self.parameters() if p.requires_grad]

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, generator: torch.Generator, temperature: float = 0.8) -> bytes:
        """Samples `length` bytes after `prompt`, one at a time."""
        out = bytearray(prompt)
        for _ in range(length):
            window = torch.tensor(list(out[-self.config.context:]), dtype=torch.long)[None]
            logits = self(window)[0, -1] / temperature
            out.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
        return bytes(out[len(prompt):])


class LocalExperts(nn.Module):
    """A local stand-in for the mixture: the mean of `ffn` blocks (for tests without a server)."""

    def __init__(self, config: ModelConfig, count: int = 2) -> None:
        super().__init__()
        from swarm.moe.server.experts import FeedforwardExpert

        self.experts = nn.ModuleList(FeedforwardExpert(config.hidden_dim) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts) / len(self.experts)
