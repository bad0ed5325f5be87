"""What the GPT-2 examples share: a byte-level corpus from the text that ships with Python, and the model.

The corpus is `pydoc_data.topics` (the language reference's topics, present in every CPython), cut
into windows of `context + 1` bytes and held in a `datasets.Dataset`; the last 5% of the text is the
held-out set. Bytes are the tokens (vocabulary 256), so nothing is downloaded: no tokenizer, no
weights (the model starts from a random initialization of a `GPT2Config`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Sequence

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from swarm.peer import Peer


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


class HeldOutPrinter:
    """Prints (and keeps) the held-out loss each `every` swarm steps; `losses[0]` is before training."""

    def __init__(self, model: torch.nn.Module, held_out: datasets.Dataset, every: int) -> None:
        self.model, self.held_out, self.every, self.last = model, held_out, max(1, every), 0
        self.losses: list[float] = []
        self.report(0)

    def report(self, step: int) -> None:
        loss = held_out_loss(self.model, self.held_out)
        self.losses.append(loss)
        print(f"swarm step {step:4d}  held-out loss {loss:.3f}", flush=True)

    def at_step(self, step: int) -> None:
        """Reports when `step` (the swarm's, which can move by more than one) passed the next multiple of `every`."""
        if step >= self.last + self.every:
            self.last = step
            self.report(step)


def example_arguments(description: str, argv: Sequence[str] | None,
                      more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The examples' command line: `--steps` (the swarm's), `--peers`, `--limit` (corpus bytes)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60, help="the swarm's steps")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="use only the corpus's first LIMIT bytes")
    if more is not None:
        more(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    return args


def local_peers(count: int) -> list[Peer]:
    """`count` peers of one swarm on loopback (each bootstraps from the first)."""
    peers: list[Peer] = []
    for _ in range(count):
        peers.append(Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=peers[0].addrs if peers else ()))
    return peers


class InThreads:
    """Runs each callable in a thread of its own (the examples' peers share one process)."""

    def __init__(self, targets: Sequence[Callable[[], object]]) -> None:
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(t,)) for t in targets]
        for thread in self.threads:
            thread.start()

    def _run(self, target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 -- raised again by join
            self.errors.append(e)

    def join(self, timeout: float | None = None) -> None:
        """Waits for every thread (each up to `timeout` s); raises the first error one of them met."""
        for thread in self.threads:
            thread.join(timeout)
        if any(thread.is_alive() for thread in self.threads):
            raise TimeoutError(f"a peer's training did not end within {timeout} s")
        if self.errors:
            raise self.errors[0]


def train_together(peers: Sequence[Peer], targets: Sequence[Callable[[], object]]) -> None:
    """Runs each peer's training in a thread of its own, then stops the peers."""
    try:
        InThreads(targets).join()
    finally:
        for peer in peers:
            peer.shutdown()
