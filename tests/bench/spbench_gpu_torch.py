#!/usr/bin/env python3
"""The torch reference for spbench-gpu: the same Ulysses seq->head all-to-all of a
bf16 [1, S/P, H, D] tensor on P ranks simulated on one GPU, done as PyTorch code
does it, timed with CUDA events (medians of --iters after 5 warm-up iterations):

  torch_a2a  what DeepSpeed-Ulysses-style code runs around the exchange: each
             rank's input reshaped to [P, B, S/P, H/P, D] by permute + contiguous,
             then the exchange as device copies of each rank's chunk into the
             receiver's [P, B, S/P, H/P, D] buffer (for B = 1 the final layout)
  torch_cat  the least torch can do: each rank's output as one torch.cat of the
             P inputs' head slices (one gather copy per rank)
  copy       a device-to-device copy of the same output bytes (the copy bound)

Run it beside spbench-gpu on the same GPU; GB/s counts read + written output bytes.
"""
import argparse

import torch


def median_us(fn, iters):
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    n = len(times)
    return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="16384,131072")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, D = args.heads, args.dim
    print(f"# {torch.cuda.get_device_name(0)}; torch {torch.__version__}; bf16 BSHD [1, S/P, {H}, {D}]; "
          f"medians of {args.iters} iterations")
    print(f"{'P':>2} {'S':>7} {'torch_a2a_us':>12} {'torch_cat_us':>12} {'copy_us':>9} {'a2a_GB/s':>9} "
          f"{'cat_GB/s':>9} {'copy_GB/s':>9}")
    for S in (int(s) for s in args.seq.split(",")):
        for P in (int(p) for p in args.ranks.split(",")):
            L, B = H // P, 1
            x = [torch.randn(B, S // P, H, D, device=dev).to(torch.bfloat16) for _ in range(P)]
            recv = [torch.empty(P, B, S // P, L, D, device=dev, dtype=torch.bfloat16) for _ in range(P)]
            out = [torch.empty(B, S, L, D, device=dev, dtype=torch.bfloat16) for _ in range(P)]
            src = [torch.empty_like(o) for o in out]

            def torch_a2a():
                sends = [xq.reshape(B, S // P, P, L, D).permute(2, 0, 1, 3, 4).contiguous() for xq in x]
                for r in range(P):
                    for q in range(P):
                        recv[r][q].copy_(sends[q][r])

            def torch_cat():
                for r in range(P):
                    torch.cat([xq[:, :, r * L:(r + 1) * L] for xq in x], dim=1, out=out[r])

            def copy():
                for r in range(P):
                    out[r].copy_(src[r])

            ta, tc, tm = median_us(torch_a2a, args.iters), median_us(torch_cat, args.iters), median_us(copy, args.iters)
            moved = 2.0 * P * out[0].numel() * 2
            print(f"{P:>2} {S:>7} {ta:>12.1f} {tc:>12.1f} {tm:>9.1f} {moved / ta / 1e3:>9.0f} {moved / tc / 1e3:>9.0f} "
                  f"{moved / tm / 1e3:>9.0f}", flush=True)
            del x, recv, out, src
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
