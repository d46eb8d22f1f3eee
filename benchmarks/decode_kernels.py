"""The decode step's attention and sampling alone, at SmolLM2's shapes.

    python benchmarks/decode_kernels.py [--batches 1,16] [--contexts 192,512,4000]

- Attention: `rope_decode_attention` per layer call, over 30 layers' paged caches with the
  sequences' blocks interleaved in the pool, as a server's are (the caches are larger than L3,
  so every call reads from memory). Prints µs a layer and the cache bytes read per second.
- Sampling: one `Sampler` call on 16 rows of Zipf-shaped logits over 49,152 tokens, with the C++
  ops (`softmax_top_candidates`, `sample_full_rows`) and with the torch ops that stand in for
  them elsewhere, in the same process.

Each figure is the best of 7 rounds: these machines are noisy (±20%).
"""

from __future__ import annotations

import argparse

import torch

from dsinfer.bench.stats import best_seconds
from dsinfer.layers.kernels.cpu_build import load_cpu_ops
from dsinfer.sampling import SamplingParams
from dsinfer.worker import token_draw
from dsinfer.worker.sampler import Sampler, SamplerState

HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 9, 3, 64, 30, 49152


def attention(batch: int, context: int, block_size: int = 16) -> str:
    g = torch.Generator().manual_seed(0)
    per_seq = context // block_size + 1
    blocks = batch * per_seq
    shape = (blocks, KV_HEADS, block_size, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for _ in range(LAYERS)
    ]
    # Sequence b holds blocks b, b + batch, b + 2 batch, ...: interleaved, as sequences that
    # decode together allocate them.
    tables = torch.tensor([[j * batch + b for j in range(per_seq)] for b in range(batch)])
    lens = torch.full((batch,), context)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).bfloat16()
    cos = torch.randn(context + 1, HEAD_DIM, generator=g)
    sin = torch.randn(context + 1, HEAD_DIM, generator=g)
    op = torch.ops.dsinfer.rope_decode_attention

    def all_layers() -> None:
        for k, v in caches:
            op(qkv, cos, sin, k, v, tables, lens, HEADS, KV_HEADS, HEAD_DIM**-0.5)

    per_layer = best_seconds(all_layers, calls=10, rounds=7) / LAYERS
    read = batch * context * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16
    return f"| {batch} | {context} | {1e6 * per_layer:.0f} | {read / per_layer / 1e9:.1f} |"


def sampling(kw: dict) -> str:
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32)
    logits = torch.stack(
        [(-3.3 * ranks.log())[torch.randperm(VOCAB, generator=g)] for _ in range(16)]
    )
    states = [
        SamplerState(SamplingParams(**kw), [], torch.Generator().manual_seed(i)) for i in range(16)
    ]
    sampler = Sampler()
    times = {}
    cpu_ops = token_draw._cpu_ops
    for path in ("C++ ops", "torch ops"):
        if path == "torch ops":
            token_draw._cpu_ops = lambda logits, op: False  # type: ignore[assignment]
        try:
            times[path] = best_seconds(lambda: sampler(logits.clone(), states), calls=20, rounds=7)
        finally:
            token_draw._cpu_ops = cpu_ops  # type: ignore[assignment]
    params = ", ".join(f"{k}={v}" for k, v in kw.items())
    return f"| {params} | {1e3 * times['C++ ops']:.2f} | {1e3 * times['torch ops']:.2f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="192,512,4000")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if why := load_cpu_ops():
        raise SystemExit(f"the fused CPU kernels are not available here: {why}")
    # Sampling first: the torch ops' 3 MB temporaries cost page faults in a fresh process
    # (glibc maps them), and much less once large blocks have been freed (glibc then raises
    # its mapping threshold and keeps them in the heap), as after the attention runs below.
    # The C++ ops allocate nothing of that size either way.
    print(f"sampling, 16 rows × {VOCAB} (one Sampler call)")
    print("| parameters | C++ ops ms | torch ops ms |\n|---|---|---|")
    for kw in (
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.95),
        dict(temperature=1.0, top_k=40),
    ):
        print(sampling(kw))
    print(f"\nattention, bf16 cache, {HEADS} heads / {KV_HEADS} KV heads × {HEAD_DIM}")
    print("| batch | context | µs a layer | cache GB/s |\n|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        for c in (int(x) for x in args.contexts.split(",")):
            print(attention(b, c))


if __name__ == "__main__":
    main()
