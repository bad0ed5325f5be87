"""Tensor compression for the wire: pure torch, no networking.

Peers stream each tensor part in ~1 MiB chunks; each chunk is encoded as a self-contained payload
whose first byte names its `CompressionType`, and a reducer adds chunks into its accumulator as
they arrive with `decode_add`. Policies choose a type per tensor by size or role.

    payload = encode(chunk, CompressionType.UNIFORM_8BIT)
    decode_add(payload, accumulator_chunk, weight=0.25)

Non-finite values: lossy types (SCALED_FLOAT16, UNIFORM_8BIT, QUANTILE_8BIT, UNIFORM_4BIT) refuse NaN/inf with
`CompressionError`; NONE and FLOAT16 carry them through, and callers check with `has_nonfinite`.
"""

import swarm.core.needs_torch  # noqa: F401  (first: without torch, an error naming the install command)
from swarm.compression.base import (
    HEADER_SIZE,
    SUPPORTED_DTYPES,
    Codec,
    CompressionError,
    CompressionType,
    PayloadHeader,
    read_header,
)
from swarm.compression.floating import (
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    has_nonfinite,
)
from swarm.compression.payload import decode, decode_add, encode, get_codec
from swarm.compression.policy import (
    CompressionPolicy,
    FixedCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
    TensorRole,
)
from swarm.compression.quantile import Quantile8BitQuantization
from swarm.compression.uniform import Uniform8BitQuantization
from swarm.compression.uniform4 import Uniform4BitQuantization

__all__ = [
    "HEADER_SIZE",
    "SUPPORTED_DTYPES",
    "Codec",
    "CompressionError",
    "CompressionPolicy",
    "CompressionType",
    "FixedCompression",
    "Float16Compression",
    "NoCompression",
    "PayloadHeader",
    "Quantile8BitQuantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SizeAdaptiveCompression",
    "TensorRole",
    "Uniform4BitQuantization",
    "Uniform8BitQuantization",
    "decode",
    "decode_add",
    "encode",
    "get_codec",
    "has_nonfinite",
    "read_header",
]
