"""Grouped-query attention: SDPA on grouped K/V (``enable_gqa``) against K/V expanded to the query heads.

``autopar profile`` times attention, and ``autopar run`` runs it, on grouped K/V wherever SDPA has a
fused kernel for them (:func:`planner.cost.compute.sdpa_takes_grouped_kv`: any CPU; on CUDA the flash
kernel, 16-bit from sm80 with head dims to 256). This prints, side by side in one run, forward +
backward of both ways for a few head layouts, the kernel each way gets on CUDA (which backends accept
it), and on CUDA the peak memory, so the rule can be held against the machine. Not judged: it prints
the figures the choice rests on.

    .venv/bin/python benchmarks/attention_kernels.py [--threads 1] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from planner.cost.compute import sdpa_takes_grouped_kv  # noqa: E402


def layouts(device: torch.device) -> list[tuple[int, int, int, int]]:
    """(query heads, kv heads, sequence, head dim): Llama-like groups of 4 and 8."""
    if device.type == "cuda":
        return [(32, 8, 4096, 128), (64, 8, 4096, 128), (32, 8, 8192, 128), (16, 2, 8192, 64)]
    return [(8, 2, 512, 64), (16, 4, 256, 64), (32, 8, 1024, 64)]


def timed(fn, device: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn`` after one warm-up call (CUDA: synchronised around each call)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def backends_taking(q, k, v, gqa: bool) -> str:  # noqa: ANN001
    """The CUDA SDPA backends that accept these inputs (each tried alone)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ok = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]), torch.no_grad():
                F.scaled_dot_product_attention(q[:, :, :128], k[:, :, :128], v[:, :, :128], is_causal=True,
                                               enable_gqa=gqa)
            ok.append(backend.name.split("_")[0].lower())
        except RuntimeError:
            pass
    return ",".join(ok) or "math only"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    sm = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({args.threads} threads)"
    print(f"SDPA forward + backward, causal, batch 1, on {name}, torch {torch.__version__}")
    print(f"{'dtype':<9}{'heads':>8}{'seq':>6}{'hd':>5}{'grouped ms':>12}{'expanded ms':>13}{'exp/grp':>9}"
          f"{'rule':>10}   kernels (grouped | expanded){'   peak GiB grp/exp' if device.type == 'cuda' else ''}")
    for dtype in (torch.bfloat16, torch.float32):
        for h, kv, s, d in layouts(device):
            q = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(1, kv, s, d, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(1, kv, s, d, device=device, dtype=dtype, requires_grad=True)
            rep = h // kv

            # B023: both closures are called only within this iteration, so they see its q, k, v and rep
            def grouped() -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()  # noqa: B023

            def expanded() -> None:
                F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),  # noqa: B023
                                               v.repeat_interleave(rep, 1),  # noqa: B023
                                               is_causal=True).sum().backward()

            peaks = []
            results = []
            for fn in (grouped, expanded):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    results.append(timed(fn, device, args.reps) * 1e3)
                except (RuntimeError, torch.OutOfMemoryError) as exc:  # the math fallback may not fit
                    results.append(float("nan"))
                    print(f"    {fn.__name__}: {str(exc).splitlines()[0][:100]}")
                if device.type == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
            rule = "grouped" if sdpa_takes_grouped_kv(device.type, dtype != torch.float32, sm, d) else "expand"
            kernels = ""
            if device.type == "cuda":
                ke, kv_ = k.detach().repeat_interleave(rep, 1), v.detach().repeat_interleave(rep, 1)
                kernels = f"{backends_taking(q.detach(), k.detach(), v.detach(), True)} | " \
                          f"{backends_taking(q.detach(), ke, kv_, False)}"
            mem = f"   {peaks[0]:.2f}/{peaks[1]:.2f}" if peaks else ""
            print(f"{str(dtype).split('.')[1]:<9}{f'{h}/{kv}':>8}{s:>6}{d:>5}{results[0]:>12.2f}{results[1]:>13.2f}"
                  f"{results[1] / results[0]:>9.2f}{rule:>10}   {kernels or '-'}{mem}")


if __name__ == "__main__":
    main()
