"""Tensor streaming: header + ~1 MiB raw chunks, over a real gRPC stream and against lying senders."""

import pytest
import torch

from swarm.core.errors import InvalidRequest, ResourceExhausted
from swarm.net.streaming import TensorReceiver, receive_tensors, tensors_to_messages


def reassemble(messages, max_bytes=1 << 30):
    receiver = TensorReceiver(messages[0], max_bytes)
    for m in messages[1:]:
        receiver.feed(m)
    return receiver.result(), receiver.metadata


def test_round_trip_across_chunk_boundaries():
    tensors = [torch.randn(1000, 3), torch.arange(10, dtype=torch.int64), torch.empty(0, 5),
               torch.randn(7).half(), torch.tensor(True)]
    messages = list(tensors_to_messages(tensors, metadata={"uid": "ffn.0.0"}, chunk_bytes=4096))
    assert all(len(m) <= 4096 for m in messages[1:])
    out, meta = reassemble(messages)
    assert meta == {"uid": "ffn.0.0"}
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_non_contiguous_input_is_sent_in_logical_order():
    t = torch.randn(64, 32).t()
    out, _ = reassemble(list(tensors_to_messages([t], chunk_bytes=1000)))
    assert torch.equal(out[0], t)


def test_header_declaring_too_much_is_refused_before_allocating():
    messages = list(tensors_to_messages([torch.zeros(1024)]))
    with pytest.raises(ResourceExhausted):
        TensorReceiver(messages[0], max_bytes=1000)


def test_lying_streams_are_refused():
    header, body = list(tensors_to_messages([torch.zeros(100)]))
    receiver = TensorReceiver(header)
    with pytest.raises(InvalidRequest, match="more bytes than its header"):
        receiver.feed(body + b"x")
    receiver = TensorReceiver(header)
    receiver.feed(body[:10])
    with pytest.raises(InvalidRequest, match="ended after 10 of 400 bytes"):
        receiver.result()
    with pytest.raises(InvalidRequest, match="malformed tensor stream header"):
        TensorReceiver(b"\xff\x00garbage")


def test_header_with_inconsistent_sizes_or_dtype_is_refused():
    from swarm.proto import tensor_pb2

    bad_size = tensor_pb2.TensorBundleHeader(tensors=[tensor_pb2.TensorMeta(dtype="float32", shape=[4], nbytes=3)])
    with pytest.raises(InvalidRequest, match="says 3 bytes"):
        TensorReceiver(bad_size.SerializeToString())
    bad_dtype = tensor_pb2.TensorBundleHeader(tensors=[tensor_pb2.TensorMeta(dtype="complex999", shape=[1])])
    with pytest.raises(InvalidRequest, match="unsupported tensor dtype"):
        TensorReceiver(bad_dtype.SerializeToString())
    negative = tensor_pb2.TensorBundleHeader(tensors=[tensor_pb2.TensorMeta(dtype="float32", shape=[-1, 4])])
    with pytest.raises(InvalidRequest, match="negative dimension"):
        TensorReceiver(negative.SerializeToString())


def test_echo_over_a_real_grpc_stream(make_peer):
    a, b = make_peer(), make_peer()

    async def echo(requests, ctx):
        tensors, meta = await receive_tensors(requests)
        for message in tensors_to_messages([t * 2 for t in tensors], metadata=meta):
            yield message

    a.server.add_stream("/test.T/Echo", echo)
    x = torch.randn(3, 1 << 18)  # 3 MiB: several chunks

    async def go():
        ch = b.pool.get(a.addrs[0])
        return await receive_tensors(ch.stream("/test.T/Echo", tensors_to_messages([x], metadata=[1, 2])))

    (y,), meta = b.run(go())
    assert torch.equal(y, x * 2) and meta == [1, 2]
