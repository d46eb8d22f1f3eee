"""A GGUF cut to its first decoder layers, every tensor kept in its own quantisation (raw
bytes), the metadata (tokenizer, chat template, shapes) kept but for the layer count.

    python benchmarks/truncate_gguf.py SRC DST --layers 8

Why: a lent GPU machine gets at most 64 MiB of files from here, and the embedded SmolLM2's
GGUF is 94 MiB (29 MiB of it the Q8_0 embedding, 2.1 MiB a layer). Its first 8 layers, real
weights, let the gpu test of the GGUF path (tests/worker/test_decode_graphs_gpu.py) run there
(benchmarks/cuda_prepare.sh writes .cuda/smollm2-8-layers.gguf). Written to a temporary file,
then renamed.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import gguf

_LAYER = re.compile(r"^blk\.(\d+)\.")


def truncate(src: Path, dst: Path, layers: int) -> int:
    """Write src's first `layers` decoder layers to dst; the number of tensors written."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    have = int(reader.fields[count_key].contents())
    if not 0 < layers <= have:
        raise SystemExit(f"{src} has {have} layers: ask for 1 to {have}")
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)  # writes general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own counts, and what the writer adds
        value = layers if name == count_key else field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    kept = 0
    for t in reader.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) >= layers:
            continue
        # t.data: a quantised tensor's rows as bytes, which the writer turns back into its
        # element shape from the type.
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    kept = truncate(args.src, args.dst, args.layers)
    size = args.dst.stat().st_size / 2**20
    print(f"{args.dst}: {args.layers} layers, {kept} tensors, {size:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
