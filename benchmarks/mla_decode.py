"""MLA's absorbed decode attention alone, reference (torch) vs fused (the C++ latent kernel), at
DeepSeek-V2-Lite / V3 head shapes: time per layer call for a batch of decode rows attending
over a paged latent cache of a given context length.

    python benchmarks/mla_decode.py [--heads 16] [--contexts 512,2048] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from dsinfer.layers.attention import AttentionMetadata, attention_class
from dsinfer.layers.backend import resolve_backend

BS = 16


def _meta(batch: int, ctx: int, num_blocks: int) -> AttentionMetadata:
    per = -(-ctx // BS)
    tables = torch.randperm(num_blocks)[: batch * per].view(batch, per)
    lens = torch.full((batch,), ctx)
    mask = torch.arange(per * BS).unsqueeze(0) >= lens.unsqueeze(1)
    return AttentionMetadata(
        slot_blocks=tables[:, (ctx - 1) // BS],
        slot_offsets=(lens - 1) % BS,
        num_decode=batch,
        decode_block_tables=tables,
        decode_mask=mask.view(batch, 1, 1, -1),
        prefills=(),
        decode_seq_lens=lens,
    )


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=16)  # V2-Lite: 16; V3: 128 (/ TP)
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    assert resolve_backend("fused", torch.device("cpu")).name == "fused"
    h, nope, rope, v_dim, lora = args.heads, 128, 64, 128, 512
    scale = (nope + rope) ** -0.5
    dtype = getattr(torch, args.dtype)
    kv_b = torch.randn(h * (nope + v_dim), lora, dtype=dtype) * 0.05
    print(
        f"heads {h}, latent {lora} + rope {rope}, cache {args.dtype}, {torch.get_num_threads()} threads"
    )
    print("| batch | context | reference ms | fused ms | speed-up |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            num_blocks = batch * -(-ctx // BS) + 1
            cache = torch.randn(num_blocks, BS, lora + rope).to(dtype)
            meta = _meta(batch, ctx, num_blocks)
            q_nope = torch.randn(batch, h, nope, dtype=dtype)
            q_pe = torch.randn(batch, h, rope, dtype=dtype)
            latent = torch.randn(batch, lora + rope, dtype=dtype)
            times = {}
            outs = {}
            for backend in ("reference", "fused"):
                attn = attention_class(backend, "cpu", "mla")(h, nope, rope, v_dim, lora, scale)
                call = functools.partial(attn.forward, q_nope, q_pe, latent, cache, kv_b, meta)

                with torch.inference_mode():
                    outs[backend] = call()
                    times[backend] = _time(call, args.repeats)
            err = (outs["fused"].float() - outs["reference"].float()).abs().max().item()
            assert err < 5e-2, err
            ref, fused = times["reference"] * 1e3, times["fused"] * 1e3
            print(f"| {batch} | {ctx} | {ref:.2f} | {fused:.2f} | {ref / fused:.2f}× |")


if __name__ == "__main__":
    main()
