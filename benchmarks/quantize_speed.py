"""Throughput of block quantization (``lightning_zero/sharding/quantize.py``) on this machine's CPU.

Times ``quantize`` and ``dequantize`` of one flat tensor (default: 25M fp32 elements, one thread, payload and output
allocated once, as a collective's pooled buffers are), best and median of ``--repeats``, for int8 and int4 at the
default block size, and prints GB/s of the unquantized tensor (its bytes in ``--dtype`` over the time), so that
quantize and dequantize compare with the bandwidth of the link they save bytes on. ``dequantize+add`` is qgZ's
dequantize-and-accumulate into an fp32 sum.

``--sweep`` also runs every block size of ``--block-sizes`` on the flat gradient and weights of a small GPT
(random tokens, one backward): the relative error (``|x - y|_2 / |x|_2``), the largest error over the bound
``absmax / (2 qmax)``, the payload's size over fp32's, and the round-trip time on the big tensor.

    python benchmarks/quantize_speed.py                      # ~20 s
    python benchmarks/quantize_speed.py --sweep              # + the block-size table, ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_zero.models.gpt import GPTConfig
from lightning_zero.sharding.quantize import DEFAULT_BLOCK_SIZE, BlockFormat, dequantize, quantize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _times(fn, repeats: int) -> tuple[float, float]:
    """Best and median wall time of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples), statistics.median(samples)


def throughput(values: torch.Tensor, fmt: BlockFormat, repeats: int) -> dict[str, tuple[float, float]]:
    """Best and median seconds of quantize, dequantize, dequantize+add and the round trip."""
    layout = fmt.layout(values.numel())
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    restored = torch.empty_like(values)
    total = torch.zeros(values.numel(), dtype=torch.float32)
    quantize(values, fmt, out=payload)
    return {
        "quantize": _times(lambda: quantize(values, fmt, out=payload), repeats),
        "dequantize": _times(lambda: dequantize(payload, fmt, values.numel(), out=restored), repeats),
        "dequantize+add": _times(
            lambda: dequantize(payload, fmt, values.numel(), out=total, accumulate=True), repeats
        ),
        "round trip": _times(
            lambda: (quantize(values, fmt, out=payload), dequantize(payload, fmt, values.numel(), out=restored)),
            repeats,
        ),
    }


def gpt_tensors() -> dict[str, torch.Tensor]:
    """The flat fp32 weights and gradient of a small GPT after one backward on random tokens."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, n_layer=4, n_head=4, d_model=256, seq_len=128)
    model = config.build()
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    params = list(model.parameters())
    return {
        "gradient": torch.cat([p.grad.reshape(-1) for p in params]),
        "weights": torch.cat([p.detach().reshape(-1) for p in params]),
    }


def error_stats(values: torch.Tensor, fmt: BlockFormat) -> tuple[float, float]:
    """Relative L2 error of the round trip, and the largest element error over its block's absmax/(2 qmax)."""
    restored = dequantize(quantize(values, fmt).payload, fmt, values.numel())
    error = (values.double() - restored.double()).abs()
    padded = torch.nn.functional.pad(values, (0, -values.numel() % fmt.block_size))
    absmax = padded.view(-1, fmt.block_size).abs().amax(-1).double()
    ideal = (absmax / (2 * fmt.qmax)).repeat_interleave(fmt.block_size)[: values.numel()]
    nonzero = ideal > 0
    worst = (error[nonzero] / ideal[nonzero]).max().item()
    return (error.norm() / values.double().norm()).item(), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also compare block sizes (error, size, time)")
    parser.add_argument("--block-sizes", default="256,1024,2048,4096,8192,16384")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    values = torch.randn(args.numel).to(DTYPES[args.dtype])
    gigabytes = values.numel() * values.element_size() / 1e9
    print(f"{args.numel:,} {args.dtype} elements ({gigabytes * 1e3:.0f} MB), {args.threads} thread(s), "
          f"block {DEFAULT_BLOCK_SIZE}, best (median) of {args.repeats}")
    print(f"| format | payload / {args.dtype} | operation | ms | GB/s of {args.dtype} |")
    print("|---|---|---|---|---|")
    for bits in (8, 4):
        fmt = BlockFormat(bits)
        ratio = fmt.layout(args.numel).ratio(values.dtype)
        for name, (best, median) in throughput(values, fmt, args.repeats).items():
            print(f"| int{bits} | {ratio:.4f} | {name} | {best * 1e3:.1f} ({median * 1e3:.1f}) | "
                  f"{gigabytes / best:.2f} ({gigabytes / median:.2f}) |")
    if args.sweep:
        sweep(values, [int(b) for b in args.block_sizes.split(",")], args.repeats)


def sweep(values: torch.Tensor, block_sizes: list[int], repeats: int) -> None:
    tensors = gpt_tensors()
    sizes = ", ".join(f"{name} {t.numel():,}" for name, t in tensors.items())
    print(f"\nBlock sizes on a small GPT's flat tensors ({sizes} elements); round trip on the {values.numel():,}")
    print("| format | block | payload / fp32 | gradient rel. error | gradient max err / bound | weights rel. error | "
          "round trip ms |")
    print("|---|---|---|---|---|---|---|")
    for bits in (8, 4):
        for block in block_sizes:
            fmt = BlockFormat(bits, block)
            grad_rel, grad_worst = error_stats(tensors["gradient"], fmt)
            weight_rel, _ = error_stats(tensors["weights"], fmt)
            best, _ = throughput(values, fmt, repeats)["round trip"]
            ratio = fmt.layout(values.numel()).ratio(torch.float32)
            print(f"| int{bits} | {block} | {ratio:.4f} | {grad_rel:.4f} | {grad_worst:.3f} | {weight_rel:.4f} | "
                  f"{best * 1e3:.1f} |")


if __name__ == "__main__":
    main()
