"""What the GPT-2 examples share: a byte-level corpus from the text that ships with Python, and the model.

The corpus is `pydoc_data.topics` (the language reference's topics, present in every CPython), cut
into windows of `context + 1` bytes and held in a `datasets.Dataset`; the last 5% of the text is the
held-out set. Bytes are the tokens (vocabulary 256), so nothing is downloaded: no tokenizer, no
weights (the model starts from a random initialization of a `GPT2Config`).
"""

from __future__ import annotations

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def byte_corpus(context: int = 64, held_out: float = 0.05, limit: int | None = None) -> tuple[datasets.Dataset,
                                                                                                datasets.Dataset]:
    """(train, held-out) datasets of `input_ids`/`labels` windows (the model shifts labels itself)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name].strip() for name in sorted(topics)).encode("utf-8")
    if limit is not None:
        text = text[:limit]
    cut = int(len(text) * (1 - held_out))

    def windows(data: bytes, stride: int) -> datasets.Dataset:
        starts = range(0, len(data) - context - 1, stride)
        ids = [list(data[s:s + context]) for s in starts]
        return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).with_format("torch")

    return windows(text[:cut], context // 2), windows(text[cut:], context)


def tiny_gpt2(layers: int = 2, width: int = 64, heads: int = 4, context: int = 64, vocab: int = 256,
              seed: int = 0) -> GPT2LMHeadModel:
    """A GPT-2-architecture causal LM with random weights (the same on every peer given the same seed)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers, n_head=heads,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data: datasets.Dataset, batches: int = 8, batch_size: int = 16) -> float:
    """Mean loss over the first `batches` batches of `data`."""
    model.eval()
    losses = []
    for i in range(min(batches, len(data) // batch_size)):
        rows = data[i * batch_size:(i + 1) * batch_size]
        losses.append(float(model(input_ids=rows["input_ids"], labels=rows["labels"]).loss))
    model.train()
    return sum(losses) / max(len(losses), 1)
