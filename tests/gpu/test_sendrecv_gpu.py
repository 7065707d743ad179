"""The host-staged stand-in for NCCL's send/recv (flux_layers/runtime/multinode/sendrecv.py) on TP ranks sharing one GPU
(FLUX_LAYERS_TEST_SHARED_GPU=1, FLUX_LAYERS_TEST_TP): NCCL's stream semantics, with one hardware queue
(CUDA_DEVICE_MAX_CONNECTIONS=1) as with eight. Sends read their tensors where the current stream stands, not when
the host calls; the host does not wait for the GPU; the current stream's later work sees what was received; an
exchange that forwards what the previous one received, issued with no host synchronization in between, forwards
the received data; back-to-back exchanges of several sizes and dtypes, issued from two streams by turns, each land
in place; the bytes accounted are the bytes given. Its device piece alone: a stream wait on the mapped host word.
The NCCL transports through the stand-in: tests/gpu/test_nccl_transport_gpu.py."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from flux_layers.devtools.launch import run_distributed, shared_gpu, tp_under_test
from tests.gpu.gpu_support import needs_gpus

TP = tp_under_test()
pytestmark = [pytest.mark.gpu, needs_gpus(TP),
              pytest.mark.skipif(not shared_gpu(), reason="the stand-in serves ranks sharing one GPU; with a GPU per "
                                 "rank the group is NCCL's (tests/gpu/test_nccl_transport_gpu.py)")]
SLEEP_CYCLES = int(2e9)  # about a second of GPU time: the host's part must be over long before


def _value(rank: int, step: int) -> float:
    return float(1000 * step + rank)


def _mapped_host_word():
    """The stand-in's pinned host word (int32, 0) and that word seen in place as a CUDA tensor."""
    from flux_layers import _library
    from flux_layers.runtime.multinode.sendrecv import _MappedWord
    _library.require_library()
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    on_device = torch.as_tensor(_MappedWord(word), device="cuda")
    assert on_device.is_cuda and on_device.data_ptr() == word.data_ptr(), (on_device.device, on_device.data_ptr())
    return word, on_device


def _returns_only_after_the_host_stores(word, enqueue, what: str) -> None:
    """``enqueue()`` on a side stream waits for word >= 3: it must not pass while the word holds 2, and must pass
    once another thread stores 3 (as the stand-in's thread does)."""
    import threading
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        enqueue()
    passed = torch.cuda.Event()
    passed.record(stream)
    word[0] = 2  # below the value waited for
    time.sleep(0.3)
    assert not passed.query(), f"the {what} returned before the host stored the value it waits for"
    threading.Thread(target=lambda: word.fill_(3)).start()
    deadline = time.monotonic() + 10
    while not passed.query():
        assert time.monotonic() < deadline, f"the {what} did not see the host's store within 10 s"
        time.sleep(1e-3)


def _host_word(rank, world_size):
    """A stream wait on the mapped host word returns once the host stores the value."""
    word, on_device = _mapped_host_word()
    out = torch.zeros(1, device="cuda")

    def wait_then_write():
        torch.ops.flux_layers.wait_flag.default(on_device, 0, 3)
        out.fill_(1.0)

    _returns_only_after_the_host_stores(word, wait_then_write, "stream wait")
    assert out.item() == 1.0


def test_stream_wait_on_the_host_word_returns_on_a_host_store():
    run_distributed(_host_word, 1, timeout_s=60)


def _stream_semantics(rank, tp):
    from flux_layers.runtime.multinode import sendrecv
    stand_in = sendrecv.for_group(dist.group.WORLD)
    assert isinstance(stand_in, sendrecv.HostStagedSendRecv), type(stand_in)
    right, left = (rank + 1) % tp, (rank - 1) % tp
    warm = torch.zeros(8, device="cuda")
    stand_in.exchange([(warm, right)], [(warm.clone(), left)])  # the stand-in's stream, staging memory
    torch.cuda.synchronize()

    # The send's data is written on the stream after a long sleep; the host returns before the GPU gets there.
    x = torch.full((1000, 33), -1.0, device="cuda")
    y = torch.full_like(x, float("nan"))
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(_value(rank, 1))
    began = time.monotonic()
    stand_in.exchange([(x, right)], [(y, left)])
    # The next hop forwards what arrived, with no host synchronization between the two exchanges.
    z = torch.full_like(x, float("nan"))
    stand_in.exchange([(y, right)], [(z, left)])
    host_s = time.monotonic() - began
    seen = z.clone()  # the current stream's later work: after the receive
    after = torch.cuda.Event()
    after.record()
    assert not after.query(), f"rank {rank}: the GPU finished before the host returned (the host waited)"
    assert host_s < 0.5, f"rank {rank}: two exchanges took {host_s:.3f} s on the host"
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, _value(left, 1))), f"rank {rank}: received {y.flatten()[:4]}"
    assert torch.equal(seen, torch.full_like(x, _value((rank - 2) % tp, 1))), \
        f"rank {rank}: forwarded {seen.flatten()[:4]}, not what arrived"

    # Back to back from two streams by turns: every size, dtype and peer in place, each read where its stream stood.
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    before = dict(stand_in.received_bytes)
    expected_bytes = 0
    results = []
    for step in range(24):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[step % 3]
        rows = (1, 129, 2048, 0)[step % 4]
        peer = 1 + step % (tp - 1)  # every offset
        dst, src = (rank + peer) % tp, (rank - peer) % tp
        with torch.cuda.stream(streams[step % 2]):
            torch.cuda._sleep(int(2e6))
            mine = torch.full((rows, 64), _value(rank, step), device="cuda").to(dtype)
            theirs = torch.full((rows, 64), float("nan"), device="cuda").to(dtype)
            stand_in.exchange([(mine, dst)], [(theirs, src)])
            results.append((theirs.clone(), src, step, dtype))
            expected_bytes += theirs.numel() * theirs.element_size()
    torch.cuda.synchronize()
    for got, src, step, dtype in results:
        want = torch.full_like(got, _value(src, step)).to(dtype)
        assert torch.equal(got, want), f"rank {rank} step {step}: {got.flatten()[:2]} from rank {src}"
    received = sum(stand_in.received_bytes.values()) - sum(before.values())
    assert received == expected_bytes, f"rank {rank}: {received} bytes received, {expected_bytes} given"
    assert stand_in.failure is None


@pytest.mark.parametrize("connections", ["8", "1"])
def test_stand_in_keeps_nccls_stream_semantics(connections, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    run_distributed(_stream_semantics, TP, backend="nccl")
