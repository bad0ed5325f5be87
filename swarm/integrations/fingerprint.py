"""A model's fingerprint, and the check that keeps a peer with another model out of a run.

Peers of one run average their gradients (or DiLoCo's pseudo-gradients) tensor by tensor, so they
must train the same model: the same architecture, vocabulary and parameter shapes. A peer that
brings another model (an older config, another tokenizer's vocabulary) would at best fail every
round and at worst, where the flat sizes happen to agree, average unrelated tensors. Each peer
therefore publishes its model's fingerprint in the run's DHT record (`ModelAdmission`) and checks
every other peer's before it takes part in any round; the fingerprint's digest also scopes the
averaging groups (`scoped_prefix`), so two different models never meet in one group even if both
joined at the same instant and neither saw the other's record yet.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from swarm.core.errors import SwarmError


class ModelMismatchError(SwarmError):
    """Another peer of the run trains a different model; the message names what differs on both sides."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What peers of one run must agree on about their model.

    Attributes:
        architecture: the model's class name (and its config's `model_type` where it has one).
        vocab_size: the vocabulary size (a transformers config's `vocab_size`, or the rows of the
            model's first embedding table), None if it has none.
        num_params: trainable parameters, in elements.
        num_tensors: trainable parameter tensors.
        shapes: a digest of every trainable parameter's name, shape and dtype, in order.
    """

    architecture: str
    vocab_size: int | None
    num_params: int
    num_tensors: int
    shapes: str

    @property
    def digest(self) -> str:
        """A short digest of the whole fingerprint (scopes the averaging groups)."""
        text = repr(sorted(asdict(self).items()))
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()

    def to_record(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: object) -> ModelFingerprint | None:
        """Decodes a DHT record; None when it is not a well-formed fingerprint."""
        if not isinstance(record, dict):
            return None
        try:
            fields = {k: record[k] for k in ("architecture", "vocab_size", "num_params", "num_tensors", "shapes")}
        except KeyError:
            return None
        if not isinstance(fields["architecture"], str) or not isinstance(fields["shapes"], str):
            return None
        if not all(isinstance(fields[k], int) and not isinstance(fields[k], bool)
                   for k in ("num_params", "num_tensors")):
            return None
        if fields["vocab_size"] is not None and not isinstance(fields["vocab_size"], int):
            return None
        return cls(**fields)

    def differences(self, other: ModelFingerprint) -> list[str]:
        """What differs, each as `field: this side's value vs the other's`."""
        out = []
        for name in ("architecture", "vocab_size", "num_params", "num_tensors", "shapes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name} {mine!r} here vs {theirs!r} there")
        return out


def model_fingerprint(model: torch.nn.Module, model_type: str | None = None,
                      vocab_size: int | None = None) -> ModelFingerprint:
    """The fingerprint of `model`'s trainable parameters and architecture.

    Args:
        model: the model every peer of the run trains.
        model_type: a finer name of the architecture (a transformers config's `model_type`).
        vocab_size: the vocabulary size; by default the rows of the model's first `nn.Embedding`
            (None if it has none).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if vocab_size is None:
        vocab_size = next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    architecture = type(model).__name__ + (f"/{model_type}" if model_type else "")
    h = hashlib.blake2b(digest_size=8)
    num_params = num_tensors = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        num_params += p.numel()
        num_tensors += 1
    return ModelFingerprint(architecture, vocab_size, num_params, num_tensors, h.hexdigest())


def mismatch_message(mine: ModelFingerprint, theirs: ModelFingerprint, my_id: str, their_id: str) -> str:
    """The error both sides report: which peer, and what differs."""
    return (f"peer {their_id} trains another model than this peer ({my_id}): "
            + "; ".join(mine.differences(theirs)))


def scoped_prefix(prefix: str, fingerprint: ModelFingerprint) -> str:
    """An averaging prefix only peers with this fingerprint share."""
    return f"{prefix}.m{fingerprint.digest}"
