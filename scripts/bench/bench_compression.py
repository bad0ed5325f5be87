"""Throughput of each compression codec on a float32 tensor streamed in ~1 MiB payloads.

For every CompressionType, encodes a tensor chunk by chunk (each chunk sized with
`codec.chunk_numel(chunk_bytes)`, as the averager does), then adds every payload into an
accumulator with `decode_add`, as a reducer does. Prints one line per figure, in GB/s of float32
input (tensor bytes / seconds, best of `--repeats`), with a memcpy and a float16 cast into warm
buffers as baselines measured in the same run, then each codec's compression ratio and error.

`encode` returns a fresh `bytes` per chunk (what gRPC sends); without malloc tuning each 1 MiB
allocation is a fresh mmap and its page faults dominate NONE's encode. `--mallopt` applies
the tuning of `swarm.core.malloc` (M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB) at start-up.

    .venv/bin/python scripts/bench/bench_compression.py [--size-mb 64] [--mallopt] [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time
from collections.abc import Callable

import torch

from swarm.compression import Codec, CompressionType, get_codec

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def apply_mallopt() -> bool:
    """Keeps glibc from returning freed chunk-sized blocks to the kernel; False if not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        )
    except (OSError, AttributeError):
        return False


def best_seconds(action: Callable[[], object], repeats: int) -> float:
    action()  # warm up: scratch buffers, page faults, lazily built tables
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def bench_codec(codec: Codec, tensor: torch.Tensor, chunk_bytes: int, repeats: int) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    step = codec.chunk_numel(chunk_bytes)
    chunks = tensor.split(step)
    payloads: list[bytes] = []

    def encode_all() -> None:
        payloads[:] = [codec.encode(chunk) for chunk in chunks]

    accumulator = torch.zeros_like(tensor)
    parts = accumulator.split(step)

    def decode_add_all() -> None:
        for payload, part in zip(payloads, parts):
            codec.decode_add(payload, part, 0.5)

    encode_s = best_seconds(encode_all, repeats)
    decode_s = best_seconds(decode_add_all, repeats)
    decoded = torch.empty_like(tensor)
    for payload, part in zip(payloads, decoded.split(step)):
        codec.decode(payload, part)
    error = (decoded - tensor).double()
    ratio = nbytes / sum(len(p) for p in payloads)
    name = codec.kind.name
    print(f"{name} encode: {nbytes / encode_s / 1e9:.2f} GB/s")
    print(f"{name} decode_add: {nbytes / decode_s / 1e9:.2f} GB/s")
    print(f"{name} compression ratio: {ratio:.2f}x ({len(payloads)} payloads of {len(payloads[0])} bytes)")
    rms = error.pow(2).mean().sqrt().item()
    print(
        f"{name} mean/RMS/max abs error: {error.abs().mean().item():.3g} / {rms:.3g} / {error.abs().max().item():.3g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=64, help="tensor size in MiB of float32")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help="target payload size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--mallopt", action="store_true", help="apply glibc malloc tuning first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tuned = apply_mallopt() if args.mallopt else False
    if args.threads:
        torch.set_num_threads(args.threads)
    tensor = torch.randn((args.size_mb << 20) // 4, generator=torch.Generator().manual_seed(args.seed))
    nbytes = tensor.numel() * tensor.element_size()
    print(
        f"tensor: {args.size_mb} MiB float32 normal, payloads of ~{args.chunk_bytes} bytes, "
        f"torch threads={torch.get_num_threads()}, mallopt={'on' if tuned else 'off'}"
    )
    scratch = torch.empty_like(tensor)
    seconds = best_seconds(lambda: scratch.copy_(tensor), args.repeats)
    print(f"baseline memcpy into warm buffer: {nbytes / seconds / 1e9:.2f} GB/s")
    halves = torch.empty(tensor.numel(), dtype=torch.float16)
    seconds = best_seconds(lambda: halves.copy_(tensor), args.repeats)
    print(f"baseline float16 cast into warm buffer: {nbytes / seconds / 1e9:.2f} GB/s")
    for kind in CompressionType:
        bench_codec(get_codec(kind), tensor, args.chunk_bytes, args.repeats)


if __name__ == "__main__":
    main()
