"""The kernel's netfilter queue (NFQUEUE) spoken over raw netlink: bind queues, read packet ids,
give verdicts, one or a whole batch at a time.

The lab's delay relay holds packets in the kernel (only their ids come up to userspace, in
`NFQNL_COPY_META` mode) and lets them go later with one batch verdict, so a packet's bytes are
never copied through Python. The message layouts are those of `linux/netfilter/nfnetlink_queue.h`;
the encoders and the parser here are pure functions, tested without sockets.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQA_CFG_F_GSO = 1 << 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NF_DROP = 0
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
CLONE_NEWNET = 0x40000000

_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("!BBH")  # family, version, res_id (the queue number, big-endian)
_NLATTR = struct.Struct("=HH")
PACKET_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET


def _attr(kind: int, payload: bytes) -> bytes:
    length = _NLATTR.size + len(payload)
    return _NLATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int = 0, flags: int = NLM_F_REQUEST) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, queue) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def bind_message(queue: int, seq: int) -> bytes:
    """Binds `queue` to this socket (acknowledged)."""
    return _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)),
                    seq, NLM_F_REQUEST | NLM_F_ACK)


def params_message(queue: int, seq: int, max_len: int) -> bytes:
    """Packet metadata only (no payload), and room for `max_len` held packets (acknowledged)."""
    attrs = _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
    attrs += _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", max_len))
    return _message(NFQNL_MSG_CONFIG, queue, attrs, seq, NLM_F_REQUEST | NLM_F_ACK)


def gso_message(queue: int, whole: bool) -> bytes:
    """Whether GSO packets (up to 64 KiB of TCP segments sent as one) are queued whole (one id,
    one verdict) or cut into segments first (each lost or kept on its own). Not acknowledged."""
    flags = struct.pack("!I", NFQA_CFG_F_GSO if whole else 0)
    return _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_FLAGS, flags) + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)))


def verdict_message(queue: int, packet_id: int, verdict: int, batch: bool = False) -> bytes:
    """A verdict on one packet, or (batch) on every packet of `queue` with an id up to `packet_id`."""
    kind = NFQNL_MSG_VERDICT_BATCH if batch else NFQNL_MSG_VERDICT
    return _message(kind, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)))


def parse_packet(data: bytes | memoryview) -> tuple[int, int] | None:
    """(queue, packet id) of a queued-packet message, None for any other message.

    The kernel puts `NFQA_PACKET_HDR` first in every packet message, so the id sits at a fixed
    offset: no attribute walk per packet.
    """
    if len(data) < 32:
        return None
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(data, 0)
    if kind != PACKET_TYPE:
        return None
    (queue,) = struct.unpack_from("!H", data, 18)
    attr_len, attr_kind = _NLATTR.unpack_from(data, 20)
    if attr_kind & 0x3FFF != NFQA_PACKET_HDR or attr_len < 8:
        return None
    (packet_id,) = struct.unpack_from("!I", data, 24)
    return queue, packet_id


def parse_error(data: bytes) -> int | None:
    """The errno of a netlink ack/error message (0 for a plain ack), None for other messages."""
    if len(data) < 20:
        return None
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(data, 0)
    if kind != NLMSG_ERROR:
        return None
    (code,) = struct.unpack_from("=i", data, 16)
    return -code


@dataclass
class QueueSocket:
    """A netlink socket bound to some queues of one network namespace."""

    sock: socket.socket
    namespace: str
    _seq: int = 0

    @classmethod
    def open(cls, namespace: str | None, rcvbuf: int = 16 << 20) -> QueueSocket:
        """Opens the socket inside `namespace` (a name under /run/netns), or in this process's own."""
        if namespace is None:
            return cls(cls._socket(rcvbuf), "")
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            try:
                sock = cls._socket(rcvbuf)
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the relay's own namespace")
        finally:
            os.close(own)
            os.close(target)
        return cls(sock, namespace)

    @staticmethod
    def _socket(rcvbuf: int) -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE (root): bursts do not overrun
        sock.bind((0, 0))
        return sock

    def _request(self, message_for: object) -> None:
        self._seq += 1
        self.sock.send(message_for(self._seq))  # type: ignore[operator]
        self.sock.settimeout(5.0)
        try:
            while True:
                code = parse_error(self.sock.recv(65536))
                if code is not None:
                    if code:
                        raise OSError(code, f"nfqueue config in {self.namespace or 'own namespace'}: "
                                            f"{os.strerror(code)}")
                    return
        finally:
            self.sock.settimeout(None)

    def bind(self, queue: int, max_len: int = 65536) -> None:
        """Takes the packets of `queue` (they wait in the kernel until a verdict)."""
        self._request(lambda seq: bind_message(queue, seq))
        self._request(lambda seq: params_message(queue, seq, max_len))

    def set_gso(self, queue: int, whole: bool) -> None:
        self.sock.send(gso_message(queue, whole))

    def verdict(self, queue: int, packet_id: int, verdict: int, batch: bool = False) -> None:
        self.sock.send(verdict_message(queue, packet_id, verdict, batch))

    def close(self) -> None:
        self.sock.close()
