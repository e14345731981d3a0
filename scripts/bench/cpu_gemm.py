"""A generator's linear layers on CPU: vLLM's oneDNN kernel against torch's ``F.linear``, per call and per version.

vLLM on CPU packs each linear layer's weight into a oneDNN kernel when the weights load and drops the weight;
a generator loads a new version every learner step, so the direct reload (``generators/vllm_engine.py:
reload_in_place``) either makes every kernel again or, for layers up to ``PLAIN_GEMM_MAX_WEIGHTS``, keeps the
weight and runs ``F.linear`` on it. This prints, on one thread as a generator runs, for the demo model's layer
shapes and SmolLM2-135M's, at batch rows M: a call of each, the first call of a new kernel (oneDNN makes its
primitive for each M it meets), and the making of a kernel:

    .venv/bin/python scripts/bench/cpu_gemm.py
    RESULT onednn_over_linear_N384_K128_M32 <x>   # > 1: F.linear is faster at that shape
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(384, 128), (768, 128), (128, 384), (320, 128), (960, 576), (1536, 576), (3072, 576)]  # (N, K)


def per_call(fn, calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64", help="batch rows M")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a generator's engine thread
    from vllm import _custom_ops as ops

    for n, k in SHAPES:
        weight = torch.randn(n, k)
        make = per_call(lambda w=weight: ops.create_onednn_mm(w.t(), 32), 100)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            handler = ops.create_onednn_mm(weight.t(), 32)
            start = time.perf_counter()
            ops.onednn_mm(handler, x, None)
            first = time.perf_counter() - start
            onednn = per_call(lambda h=handler, x=x: ops.onednn_mm(h, x, None), args.calls)
            linear = per_call(lambda x=x, w=weight: F.linear(x, w), args.calls)
            print(
                f"N={n:5d} K={k:4d} M={m:3d}: oneDNN {onednn * 1e6:7.1f} us (its first call {first * 1e6:6.0f}, "
                f"making the kernel {make * 1e6:5.0f}), F.linear {linear * 1e6:7.1f} us",
                flush=True,
            )
            print(f"RESULT onednn_over_linear_N{n}_K{k}_M{m} {onednn / linear:.3f}")


if __name__ == "__main__":
    main()
