"""Where a replayed decode graph parts from the eager step: every module's output, replayed
against eager, on the same inputs and KV pool (a diagnostic for a lent GPU machine).

Forward hooks clone each module's output into a dict. While the graph is recorded the clones
are recorded too, so after a replay the dict holds the replayed values; the eager step then
runs on the same metadata and its clones are compared, module by module, in execution order.

    python benchmarks/graph_probe.py [--device cuda] [--dtype float32] [--model DIR]"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer import LLM  # noqa: E402
from dsinfer.worker.input_batch import build_model_input  # noqa: E402
from dsinfer.worker.step_io import ScheduledSeq  # noqa: E402


def _first(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny Llama)")
    p.add_argument("--tiny-v2", action="store_true", help="a tiny DeepSeek-V2 (MLA, experts)")
    p.add_argument("--tokens", type=int, default=7)
    p.add_argument("--sync", action="store_true", help="synchronize after every step")
    p.add_argument("--hooks", action="store_true", help="compare every module's output")
    p.add_argument("--grad-mode", action="store_true", help="outside inference_mode (the tests')")
    args = p.parse_args()
    model_dir = args.model
    if model_dir is None and args.tiny_v2:
        import transformers

        from tests.helpers import DEEPSEEK_CASES, DEEPSEEK_COMMON, write_tiny_tokenizer

        torch.manual_seed(4)
        kw = {**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v2-lite-shape"][1]}
        model_dir = tempfile.mkdtemp()
        transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kw)).save_pretrained(
            model_dir
        )
        write_tiny_tokenizer(Path(model_dir))
    if model_dir is None:
        from tests.helpers import tiny_llama_dir

        model_dir = str(tiny_llama_dir(Path(tempfile.mkdtemp()), num_layers=3, max_positions=256))
    options = {}
    if args.device == "cpu":  # a dry run: eager "graphs" (device/graphs.EagerGraph)
        from dsinfer.worker.model_runner import ModelRunner

        ModelRunner._graphs_wanted = lambda self, step_program, decode_graphs: True
        options["step_program"] = False
    llm = LLM(
        model_dir,
        device=args.device,
        backend="fused",
        dtype=args.dtype,
        num_blocks=64,
        block_size=16,
        **options,
    )
    engine, runner = llm.engine, llm.engine.executor.runner
    graphs = runner.graphs
    assert graphs is not None, "no decode graphs"
    seen: dict[str, torch.Tensor] = {}
    order: list[str] = []

    def hook(name: str):  # noqa: ANN202
        def record(_m, _i, out) -> None:  # noqa: ANN001
            t = _first(out)
            if t is not None:
                if name not in seen:
                    order.append(name)
                seen[name] = t.detach().clone()

        return record

    for name, module in runner.model.named_modules() if args.hooks else ():
        if name:
            module.register_forward_hook(hook(name))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.model_config.vocab_size, (args.tokens,), generator=g).tolist()
    bs = engine.block_size
    blocks = engine.pool.allocate(-(-len(ids) // bs))
    worst = 0.0
    with contextlib.nullcontext() if args.grad_mode else torch.inference_mode():
        for pos, tok in enumerate(ids):
            seq = ScheduledSeq("probe", [tok], pos, blocks, do_sample=False)
            inp = build_model_input([seq], bs, runner.device)
            replayed = graphs.run(inp.input_ids, inp.positions, inp.meta).clone()
            if args.sync and runner.device.type == "cuda":
                torch.cuda.synchronize()
            got = {k: v.clone() for k, v in seen.items()}
            eager = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta)
            if args.sync and runner.device.type == "cuda":
                torch.cuda.synchronize()
            err = (replayed.float() - eager.float()).abs().max().item()
            worst = max(worst, err)
            parted = []
            for name in order:
                a, b = got.get(name), seen.get(name)
                if a is None or b is None or a.shape != b.shape:
                    continue
                d = (a.float() - b.float()).abs().max().item()
                if d > 1e-5:
                    parted.append(f"{name} {d:.3g}")
            print(f"pos {pos}: hidden max |replay - eager| = {err:.3g}")
            for line in parted[:8]:
                print("    parted:", line)
    engine.pool.free(blocks)
    print(f"worst {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
