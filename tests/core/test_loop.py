"""The sync bridge to the peer's event loop."""

import asyncio
import threading

import pytest

from swarm.core.loop import LoopThread


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


def test_run_returns_the_result_on_the_loop_thread(loop_thread):
    async def where():
        return threading.current_thread().name

    assert loop_thread.run(where()) == "swarm-loop"


def test_run_propagates_exceptions(loop_thread):
    async def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        loop_thread.run(fail())


def test_run_times_out_and_cancels(loop_thread):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    with pytest.raises(TimeoutError):
        loop_thread.run(forever(), timeout=0.05)
    assert cancelled.wait(5)


def test_blocking_call_from_inside_the_loop_is_refused(loop_thread):
    async def nested():
        async def inner():
            return 1

        with pytest.raises(RuntimeError, match="use the a\\* form"):
            loop_thread.run(inner())
        return await loop_thread.wrap(inner())

    assert loop_thread.run(nested()) == 1


def test_wrap_is_awaitable_from_another_event_loop(loop_thread):
    async def on_peer_loop():
        await asyncio.sleep(0)
        return threading.current_thread().name

    async def jupyter_cell():
        return await loop_thread.wrap(on_peer_loop())

    assert asyncio.run(jupyter_cell()) == "swarm-loop"


def test_stop_cancels_pending_tasks():
    lt = LoopThread()
    cancelled = threading.Event()

    async def background():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    lt.submit(background())
    lt.stop()
    assert cancelled.is_set()
    with pytest.raises(RuntimeError, match="shut down"):
        lt.submit(background())


def test_stop_closes_the_async_generators_left_suspended():
    # grpc.aio reads a stream's responses through an async generator; one left suspended when
    # its reader task was cancelled holds the call, and a live call keeps grpc.aio's poller
    # thread running into the interpreter's exit (where a demo trainer aborted once with
    # "terminate called without an active exception").
    lt = LoopThread()
    closed = threading.Event()

    async def responses():
        try:
            yield 1
            await asyncio.Event().wait()
            yield 2
        finally:
            closed.set()

    async def reader():
        stream = responses()
        await stream.__anext__()
        return stream  # suspended after its first item; nobody closes it

    kept = lt.run(reader())
    lt.stop()
    assert closed.is_set()
    del kept
