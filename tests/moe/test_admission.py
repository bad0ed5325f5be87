"""Tests of swarm.moe.server.admission: header checks before allocation, and in-flight limits."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.core.errors import InvalidRequest, ResourceExhausted
from swarm.moe.schema import TensorSchema
from swarm.moe.server.admission import Admission, check_declared
from swarm.proto import tensor_pb2

SCHEMAS = (TensorSchema((4,), torch.float32), TensorSchema((2, 3), torch.int64))


def header(*metas: tuple[str, list[int]]) -> tensor_pb2.TensorBundleHeader:
    sizes = {"float32": 4, "int64": 8, "float64": 8}
    out = []
    for dtype, shape in metas:
        numel = 1
        for d in shape:
            numel *= d
        out.append(tensor_pb2.TensorMeta(dtype=dtype, shape=shape, nbytes=numel * sizes[dtype]))
    return tensor_pb2.TensorBundleHeader(tensors=out)


def test_a_fitting_header_returns_its_byte_count() -> None:
    assert check_declared(header(("float32", [5, 4]), ("int64", [5, 2, 3])), SCHEMAS, 8, "call") == 80 + 240


@pytest.mark.parametrize(
    ("metas", "error", "fragment"),
    [
        ([("float32", [5, 4])], InvalidRequest, "expected 2 tensors, got 1"),
        ([("float64", [5, 4]), ("int64", [5, 2, 3])], InvalidRequest, "dtype float64, expected float32"),
        ([("float32", [5, 5]), ("int64", [5, 2, 3])], InvalidRequest, r"shape \(5, 5\), expected \(batch, 4\)"),
        ([("float32", [5, 4]), ("int64", [5, 6])], InvalidRequest, r"expected \(batch, 2, 3\)"),
        ([("float32", [5, 4]), ("int64", [6, 2, 3])], InvalidRequest, r"disagree on the batch size: \[5, 6\]"),
        ([("float32", [0, 4]), ("int64", [0, 2, 3])], InvalidRequest, "the batch is empty"),
        ([("float32", [9, 4]), ("int64", [9, 2, 3])], ResourceExhausted, "batch of 9 rows exceeds the limit of 8"),
    ],
)
def test_bad_headers_are_refused(metas, error, fragment) -> None:
    with pytest.raises(error, match=fragment):
        check_declared(header(*metas), SCHEMAS, 8, "call")


def test_admission_limits_requests_and_bytes_and_reports_idle() -> None:
    admission = Admission(max_requests=2, max_bytes=100)

    async def main() -> None:
        with admission.request("a"), admission.request("b"):
            with pytest.raises(ResourceExhausted, match="2 requests in flight"), admission.request("c"):
                pass
            with (
                admission.reserve(60, "a"),
                pytest.raises(ResourceExhausted, match="60 of 100 bytes held"),
                admission.reserve(41, "b"),
            ):
                pass
            assert admission.bytes == 0
            waiter = asyncio.ensure_future(admission.wait_idle())
            await asyncio.sleep(0)
            assert not waiter.done()
        await asyncio.wait_for(waiter, 5)
        assert admission.requests == admission.bytes == 0
        assert admission.admitted == 2 and admission.refused == 2

    asyncio.run(main())


def test_one_caller_holds_at_most_its_share_of_the_slots() -> None:
    admission = Admission(max_requests=4, max_bytes=1 << 20, max_per_caller=2)
    with admission.request("forward", "mallory"), admission.request("forward", "mallory"):
        with pytest.raises(ResourceExhausted, match="limit per caller"), admission.request("forward", "mallory"):
            pass
        with admission.request("forward", "alice"):
            assert admission.by_caller == {"mallory": 2, "alice": 1}
    assert admission.by_caller == {} and admission.requests == 0


def test_a_stream_that_sends_no_header_is_refused_after_the_deadline() -> None:
    from swarm.core.errors import DeadlineExceeded
    from swarm.moe.server.admission import drain_request, receive_header

    async def silent():
        await asyncio.Event().wait()
        yield b""

    async def main() -> None:
        with pytest.raises(DeadlineExceeded, match="no request header within 0.05 s"):
            await receive_header(silent(), 0.05, "forward")
        await asyncio.wait_for(drain_request(silent(), 1 << 20, timeout=0.05), 5)  # returns, does not hang

    asyncio.run(main())
