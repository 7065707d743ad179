"""Host cost of a few torch calls from Python on the GPU machine: the scale of the Python side of a fused call. One
process; each figure the wall time per call of 300 calls queued behind a GPU sleep, median of 7 (results in
benchmarks/results/cuda_api_cost_h200.json, beside the CUDA calls'). Run: python experiments/torch_host_cost.py"""
import statistics
import time

import torch


def per_call(fn, calls=300, reps=7, keep=False):
    """``keep``: the results stay alive until the batch is timed (no deallocation inside the loop)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(60_000_000)
        kept = []
        t0 = time.perf_counter()
        if keep:
            for _ in range(calls):
                kept.append(fn())
        else:
            for _ in range(calls):
                fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        del kept
    torch.cuda.synchronize()
    return statistics.median(samples)


def main():
    torch.cuda.init()
    x = torch.randn(1024, 4096, device="cuda").bfloat16()

    def empty():
        return torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16)

    rows = [
        ("empty lambda", lambda: None, {}),
        ("torch.empty cuda 2048x2048 bf16 (freed each call)", empty, {}),
        ("x.view(-1) (a new tensor object, freed)", lambda: x.view(-1), {}),
        ("x.shape", lambda: x.shape, {}),
        ("x.data_ptr()", lambda: x.data_ptr(), {}),
        ("torch.cuda.current_stream()", torch.cuda.current_stream, {}),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing, {}),
        ("torch.empty cuda 2048x2048 bf16 (kept)", empty, {"keep": True}),
        ("x.view(-1) (kept)", lambda: x.view(-1), {"keep": True}),
        ("x + x cuda (kept)", lambda: x + x, {"keep": True, "calls": 100}),
    ]
    for name, fn, kw in rows:
        print(f"{name}: {per_call(fn, **kw):.2f} us")


if __name__ == "__main__":
    main()
