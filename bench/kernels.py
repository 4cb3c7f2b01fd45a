"""Kernel benchmark: each eviction kernel against its torch reference, as a markdown table.

    python bench/kernels.py            # CUDA: bf16, Hq 32, H 8, D 128, B in {1, 8, 32}, T in {4k, 16k, 32k}
    python bench/kernels.py --quick    # fewer shapes (on CPU: the reference path only, small fp32 shapes)

On CUDA every kernel runs both ways (Triton launcher and reference) timed with `triton.testing.do_bench`, and
the Triton result is checked against the reference ("check": = exact, ~ within tolerance). On CPU only the
references run (the Triton interpreter is a test tool, not a backend), timed with `time.perf_counter`.

GB/s counts the bytes a kernel must move at least once (inputs read plus outputs written), so it is comparable
with the plain copy bandwidth measured for each shape on its K tensor (``torch.empty_like(k).copy_(k)``, read +
write, the "copy K" row); "% copy" is the ratio. The decode attention kernel reads K twice by design, so it
cannot exceed about 2/3 of copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# the repo root must come before this script's folder, or `import kernels` would import this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference as ref  # noqa: E402


def timer(device: str):
    """``time(fn) -> ms``: do_bench on CUDA, median of perf_counter runs on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50)

    def cpu_time(fn):  # the minimum: least disturbed by other processes on a shared CPU
        fn()
        runs, start = [], time.perf_counter()
        while len(runs) < 3 or (len(runs) < 20 and time.perf_counter() - start < 0.2):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return 1e3 * min(runs)

    return cpu_time


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check(actual, expected, exact: bool, atol: float = 1e-2, rtol: float = 1e-2) -> str:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    if exact:
        return "=" if all(torch.equal(a, e) for a, e in zip(actual, expected)) else "MISMATCH"
    ok = all(torch.allclose(a.float(), e.float(), atol=atol, rtol=rtol) for a, e in zip(actual, expected))
    return "~" if ok else "MISMATCH"


def cases(B: int, T: int, Hq: int, H: int, D: int, dtype, device: str, use_triton: bool):
    """(name, reference call, triton call or None, bytes moved, exact?) for one shape; the first is the copy."""
    g = torch.Generator(device=device).manual_seed(B * 100003 + T)
    q = torch.randn(B, Hq, 1, D, generator=g, device=device).to(dtype)
    k = torch.randn(B, H, T, D, generator=g, device=device).to(dtype)
    v = torch.randn(B, H, T, D, generator=g, device=device).to(dtype)
    kpos = torch.arange(T, device=device).expand(B, H, T).contiguous()
    qpos = torch.full((B,), T - 1, device=device)
    scores = torch.rand(B, H, T, generator=g, device=device)
    keep = T // 2
    index = ref.select_keep_reference(scores, kpos, keep, 4, 64)
    probs_bytes = B * H * T * 4
    kept_bytes = B * H * keep * D * k.element_size()
    triton_ok = use_triton
    yield "copy K", lambda: torch.empty_like(k).copy_(k), None, 2 * nbytes(k), True
    if triton_ok:
        from kernels.block_score import block_scores
        from kernels.compact import gather_tokens
        from kernels.decode_attn import decode_attention
        from kernels.select import select_keep

    yield ("decode_attention", lambda: ref.decode_attention_reference(q, k, v, kpos, qpos),
           (lambda: decode_attention(q, k, v, kpos, qpos)) if triton_ok else None,
           nbytes(q, k, v, kpos, q) + probs_bytes, False)  # fmt: skip
    for bs in (1, 16):
        yield (f"select_keep bs={bs}", lambda bs=bs: ref.select_keep_reference(scores, kpos, keep, 4, 64, bs),
               (lambda bs=bs: select_keep(scores, kpos, keep, 4, 64, bs)) if triton_ok else None,
               nbytes(scores, kpos, index), True)  # fmt: skip
    yield ("gather_tokens K", lambda: ref.gather_tokens_reference(k, index, -2),
           (lambda: gather_tokens(k, index, -2)) if triton_ok else None,
           nbytes(index) + 2 * kept_bytes, True)  # fmt: skip
    yield ("block_scores bs=16", lambda: ref.block_scores_reference(k, v, 16),
           (lambda: block_scores(k, v, 16)) if triton_ok else None, nbytes(k, v), False)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (more get descheduled on a busy machine)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    if device == "cuda":
        dtype, Hq, H, D = torch.bfloat16, 32, 8, 128
        batches, contexts = ([1, 32], [4096, 32768]) if args.quick else ([1, 8, 32], [4096, 16384, 32768])
    else:
        dtype, Hq, H, D = torch.float32, 8, 2, 64
        batches, contexts = ([1, 4], [512, 2048]) if args.quick else ([1, 4, 8], [512, 2048, 4096])
    time_ms = timer(device)
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; {dtype}, Hq={Hq}, H={H}, D={D}; keep = T/2, n_sink = 4, n_recent = 64\n")
    print("| kernel | B | T | impl | ms | GB/s | % copy | check |")
    print("|---|---|---|---|---|---|---|---|")
    for B in batches:
        for T in contexts:
            copy_gbs = None
            for kernel, reference, triton_fn, moved, exact in cases(B, T, Hq, H, D, dtype, device, device == "cuda"):
                impls = [("reference", reference)] + ([("triton", triton_fn)] if triton_fn is not None else [])
                for impl, fn in impls:
                    ms = time_ms(fn)
                    gbs = moved / ms / 1e6
                    copy_gbs = copy_gbs or gbs
                    verdict = check(fn(), reference(), exact) if impl == "triton" else ""
                    impl = "torch" if kernel == "copy K" else impl
                    print(f"| {kernel} | {B} | {T} | {impl} | {ms:.3f} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f} "
                          f"| {verdict} |")  # fmt: skip
                if device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
