"""The demo's corpus: the English reference text that ships with Python (`pydoc_data.topics`).

About 460 KB of prose and code examples from the language reference, present in every CPython
installation, so the demo downloads nothing. The text is used as raw UTF-8 bytes (a byte-level
language model needs no tokenizer); the last 5% is held out for evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def load_corpus() -> bytes:
    """The concatenated `pydoc_data.topics` documents, in a fixed order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics)).encode("utf-8")


@dataclass(frozen=True)
class ByteDataset:
    """Random windows of a byte string: inputs `x[t]` and next-byte targets `y[t] = x[t + 1]`.

    Attributes:
        data: the bytes as a uint8 tensor.
        context: window length.
    """

    data: torch.Tensor
    context: int

    @classmethod
    def split(cls, corpus: bytes, context: int, held_out: float = 0.05) -> tuple[ByteDataset, ByteDataset]:
        """(train, held-out) datasets over the first and last parts of `corpus`."""
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        cut = int(len(data) * (1 - held_out))
        return cls(data[:cut], context), cls(data[cut:], context)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random windows: (inputs, targets), both int64 of shape (batch, context)."""
        starts = torch.randint(0, len(self.data) - self.context - 1, (batch_size,), generator=generator)
        offsets = torch.arange(self.context + 1)
        windows = self.data[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]
