"""`swarm-peer export --transformers CONFIG`: a run made with the transformers integration written as a
directory `from_pretrained` loads (``config.json`` and ``model.safetensors``).

The swarm's state names its parameters ``param.<i>`` in the optimizer's order, which for the
transformers integration (`swarm.integrations.session.SwarmSession`) is the model's trainable
``parameters()`` order; a checkpoint whose trainer named them (`CheckpointConfig.param_names`)
carries the model's names already. The model's configuration (a ``config.json``, or a directory
holding one: the Trainer's ``output_dir`` or any of its checkpoints) tells the architecture; the
model is built on the meta device (no memory, no random initialisation) only to learn its
parameters' names and shapes, and the export is refused, with the first difference, when the
checkpoint's parameters do not match them one for one (another model, or parameters that were
frozen during the run and so are not in the swarm's state).

The dtype is not compared: the file holds the parameters in the dtype the run trained them in
(bfloat16, float16 or float32), whatever the configuration's ``torch_dtype`` says, which tells how
the model was saved rather than how it was trained (``from_pretrained`` casts to the dtype it is
asked for). A parameter that is not floating point is not a trained parameter: refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from swarm.checkpoint import RawTensor
from swarm.core.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
FLOATING = ("F64", "F32", "F16", "BF16")  # the dtypes a trained parameter can have


def model_params(config_path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of the model the configuration at `config_path` describes: (name, shape)
    each, in ``named_parameters()`` order.

    Raises:
        ConfigError: transformers is missing, or the configuration does not load.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ConfigError(f"--transformers needs transformers and torch (pip install 'swarm-peer[transformers]'): "
                          f"{e}") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model's configuration at {config_path}: {e}") from None
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        model = model_class(config) if model_class is not None else transformers.AutoModel.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def match_names(saved: Sequence[tuple[str, RawTensor]], expected: Sequence[tuple[str, tuple[int, ...]]]
                ) -> list[tuple[str, RawTensor]]:
    """The checkpoint's parameters under the model's names: by name when the checkpoint has them,
    else by position (``param.<i>``), each in the dtype the checkpoint holds.

    Raises:
        ConfigError: the count, a name or a shape differs, or a parameter is not floating point (the
            first difference named).
    """
    if len(saved) != len(expected):
        raise ConfigError(f"the checkpoint holds {len(saved)} parameters, the model {len(expected)} (another model, "
                          f"or parameters frozen during the run)")
    by_name = dict(saved)
    names_known = all(name in by_name for name, _ in expected)
    out = []
    for i, (name, shape) in enumerate(expected):
        saved_name, tensor = (name, by_name[name]) if names_known else saved[i]
        if tuple(tensor.shape) != shape:
            raise ConfigError(f"parameter {saved_name!r} is {list(tensor.shape)}, the model's {name!r} "
                              f"is {list(shape)}: another model")
        if tensor.dtype not in FLOATING:
            raise ConfigError(f"parameter {saved_name!r} is {tensor.dtype}, not floating point: not a model's "
                              f"trained parameter")
        out.append((name, tensor))
    return out


def pretrained_params(params: Sequence[tuple[str, RawTensor]], config_path: Path) -> list[tuple[str, RawTensor]]:
    """The parameters under the names of the model `config_path` describes.

    Raises:
        ConfigError: see `model_params` and `match_names`.
    """
    return match_names(params, model_params(config_path))


def copy_config(config_path: Path, out: Path) -> None:
    """Copies the model's ``config.json`` into the directory `out`."""
    source = config_path / "config.json" if config_path.is_dir() else config_path
    if source.resolve() != (out / "config.json").resolve():
        shutil.copyfile(source, out / "config.json")
