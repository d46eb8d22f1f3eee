"""EngineArgs: every engine option written once — its default, its help, its command-line flag.

`dsinfer generate|serve` get their engine flags from `add_engine_flags` (one per field, plus
the parallel grid's), `LLM(...)` its keyword arguments from the same fields
(`EngineArgs(**kwargs)`), and both build the one EngineConfig (`engine_config(args, model)` /
`EngineArgs.engine_config()`). A new option is a new field here and nothing else. The server
takes the parsed options from here too, never from the CLI module.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsinfer.config import (
    INT8_ACTIVATIONS,
    QUANTISED_SCHEMES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    parse_memory,
)
from dsinfer.distributed.parallel_state import check_grid

DEFAULT_MODEL = "smollm2"  # the embedded model (models/loader.EMBEDDED_MODELS)


def _opt(help_: str, flag: str | None = None, **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata: the CLI flag (default: --field-name), its help and argparse extras.
    `negate="--no-x"` makes a default-True boolean a store_false flag; `cli=False` keeps a
    field off the command line (LLM(...) only)."""
    return {"help": help_, "flag": flag, "argparse": argparse_kwargs}


@dataclass
class EngineArgs:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_opt("HF directory, .gguf file, compiled artifact, or the embedded 'smollm2'",
                      cli=False),
    )  # fmt: skip
    dtype: str = field(
        default="auto",
        metadata=_opt(
            "activations and KV cache; auto follows the checkpoint (bf16/fp16 → bf16; a Q4/Q8 "
            "GGUF → bf16); float16 is served as bfloat16 (same range, fast on CPUs)",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    )
    device: str = field(default="cpu", metadata=_opt("cpu | cuda | npu | auto"))
    backend: str = field(
        default="auto",
        metadata=_opt(
            "kernels: fused (CPU fast path), reference (eager torch, the exactness oracle), "
            "auto (fused where it runs)",
            choices=("auto", "reference", "fused"),
        ),
    )
    step_program: bool = field(
        default=True,
        metadata=_opt("fused backend: run decode-only steps as one captured C++ program "
                      "(--no-step-program: layer by layer from Python)",
                      negate="--no-step-program"),
    )  # fmt: skip
    huge_pages: bool = field(
        default=True,
        metadata=_opt("CPU: the weights and the KV pool in transparent huge pages where the "
                      "OS offers them: decode streams the weights faster (--no-huge-pages: "
                      "ordinary 4 KiB pages)",
                      negate="--no-huge-pages"),
    )  # fmt: skip
    int8_activations: str = field(
        default="auto",
        metadata=_opt("fused CPU backend: int4 layers whose activations are rounded to int8 per "
                      "group of 32, as llama.cpp does (1.4-1.55x the exact kernel's rate with "
                      "many rows on AVX2 CPUs, ~2.3x on AVX-512 VNNI ones; +0.3% perplexity or "
                      "less: docs/backends.md): auto, all wherever the kernel runs (AVX2 + FMA) "
                      "and none elsewhere; all; out_proj, the blocks' output projections; none "
                      "(exact to 2^-16). "
                      "all / out_proj also take the int8 layers (a Q4_K_M file's 5-8-bit ones) "
                      "on AVX-512 CPUs: ~1.8x their int16 kernel's rate at 16 rows",
                      choices=INT8_ACTIVATIONS),
    )  # fmt: skip
    quantization: str = field(
        default="auto",
        metadata=_opt(
            "weights quantised at load; auto: a Q4_0/Q4_1/Q8_0 GGUF keeps int4/int8 (bf16 "
            "activations) unless --dtype float32",
            choices=("auto", "none", *QUANTISED_SCHEMES),
        ),
    )
    kv_cache_memory: str | int = field(
        default="auto",
        metadata=_opt("KV pool budget, preallocated at start-up, e.g. 512MiB; auto: two "
                      "sequences at the context length, 256 MiB to 4 GiB"),
    )  # fmt: skip
    num_blocks: int | None = field(
        default=None,
        metadata=_opt("KV blocks (overrides the budget)", flag="--num-kv-blocks", type=int),
    )
    block_size: int = field(default=16, metadata=_opt("tokens per KV block", type=int))
    enable_prefix_caching: bool = field(
        default=True, metadata=_opt("reuse KV blocks of shared prompt prefixes",
                                    negate="--no-prefix-caching"),
    )  # fmt: skip
    max_num_seqs: int = field(default=64, metadata=_opt("requests in a batch at most", type=int))
    max_num_batched_tokens: int = field(
        default=512,  # SchedulerConfig's reason
        metadata=_opt("tokens in one step at most (long prompts are prefilled in chunks)",
                      type=int),
    )  # fmt: skip
    max_model_len: int | None = field(
        default=None, metadata=_opt("context length (default: the model's)", type=int)
    )
    seed: int = field(default=0, metadata=_opt("seed of the engine's sampling streams", type=int))
    tokenizer: str | None = field(
        default=None, metadata=_opt("tokenizer source if not the model's own")
    )
    chat_template: str | None = field(
        default=None,
        metadata=_opt("a Jinja chat template (a file, or the text) replacing the tokenizer's",
                      metavar="FILE|TEMPLATE"),
    )  # fmt: skip
    device_profile: str | None = field(
        default=None,
        metadata=_opt("peaks that MBU/MFU are measured against (a built-in profile or a "
                      "`dsinfer probe` JSON); default: this CPU, measured at start-up",
                      metavar="NAME|JSON"),
    )  # fmt: skip
    random_weights: bool = field(
        default=False,
        metadata=_opt("build from config.json with seeded random weights (speed/memory only)",
                      action="store_true"),
    )  # fmt: skip
    random_quant: str = field(
        default="none",
        metadata=_opt("with --random-weights: quantised layouts (configs too large for float "
                      "weights)", choices=("none", *QUANTISED_SCHEMES)),
    )  # fmt: skip
    trusted_keys: tuple[str, ...] | list[str] = field(
        default=(),
        metadata=_opt("public key an artifact's signature must verify with (repeatable; also "
                      "DSINFER_TRUSTED_KEYS)", flag="--trusted-key", action="append",
                      metavar="PUB"),
    )  # fmt: skip
    allow_unsigned: bool = field(
        default=False,
        metadata=_opt("opt out of the trust policy: load unsigned artifacts and raw checkpoints",
                      action="store_true"),
    )  # fmt: skip
    mtp: bool = field(
        default=True,
        metadata=_opt("use a DeepSeek-V3 checkpoint's MTP layer for speculative decoding "
                      "(--no-mtp: off)", negate="--no-mtp"),
    )  # fmt: skip
    mtp_drafts: int = field(
        default=1,
        metadata=_opt("draft tokens a step from the MTP layer: 1, or a chain of up to 8 (the "
                      "layer fed its own output; each verified exactly)", type=int, metavar="N"),
    )  # fmt: skip
    ngram_speculation: int = field(
        default=0,
        metadata=_opt("prompt-lookup speculative decoding: draft up to K tokens a step from "
                      "where the request's last 2-3 tokens occurred before in its prompt or "
                      "output, verified by the model (greedy or sampled; exact; 0: off)",
                      type=int, metavar="K"),
    )  # fmt: skip
    # The grid: on the command line through --parallel (and vLLM's -tp/-pp), see
    # add_engine_flags below.
    tensor_parallel: int = field(default=1, metadata=_opt("tensor-parallel ranks", cli=False))
    pipeline_parallel: int = field(default=1, metadata=_opt("pipeline stages", cli=False))
    expert_parallel: int = field(default=1, metadata=_opt("expert-parallel ranks", cli=False))
    nnodes: int = field(default=1, metadata=_opt("machines the ranks spread over", type=int))
    node_rank: int = field(default=0, metadata=_opt("this machine's index (0 serves)", type=int))
    master_addr: str = field(default="127.0.0.1", metadata=_opt("node 0's address"))
    master_port: int | None = field(
        default=None, metadata=_opt("node 0's rendezvous port (several nodes)", type=int)
    )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            step_program=self.step_program,
            huge_pages=self.huge_pages,
            int8_activations=self.int8_activations,
            quantization=self.quantization,
            seed=self.seed,
            tokenizer=self.tokenizer,
            chat_template=self.chat_template,
            device_profile=self.device_profile,
            random_weights=self.random_weights,
            random_quant=self.random_quant,
            trusted_keys=tuple(str(k) for k in self.trusted_keys),
            allow_unsigned=self.allow_unsigned,
            mtp=self.mtp,
            mtp_drafts=self.mtp_drafts,
            ngram_speculation=self.ngram_speculation,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            expert_parallel=self.expert_parallel,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=(
                    None if self.kv_cache_memory == "auto" else parse_memory(self.kv_cache_memory)
                ),
                num_blocks=self.num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
        )

    # -- the command line ----------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field (fields marked cli=False excepted)."""
        for f in dataclasses.fields(EngineArgs):
            meta = f.metadata
            # argparse reads help as a %-format; the text is plain (LLM's docstring shows it too)
            help_ = meta["help"].replace("%", "%%")
            extra = dict(meta["argparse"])
            if extra.pop("cli", True) is False:
                continue
            negate = extra.pop("negate", None)
            if negate is not None:  # a default-True switch, turned off by --no-x
                parser.add_argument(negate, dest=f.name, action="store_false", help=help_)
                continue
            if extra.get("action") == "append":
                extra["default"] = []
            else:
                extra.setdefault("default", f.default)
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            parser.add_argument(flag, dest=f.name, help=help_, **extra)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, model: str, **overrides: Any) -> EngineArgs:
        """The fields the parsed command line holds, for `model`."""
        values = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        return cls(**{**values, "model": model, **overrides})


def engine_arg_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


# -- the command line: the engine's flags and the grid's ------------------------------------
def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags (one per EngineArgs field), then the grid's: --parallel and vLLM's
    -tp/-pp spellings of it."""
    EngineArgs.add_cli_args(p)
    p.add_argument(
        "--parallel",
        default=None,
        metavar="auto|tp=N,pp=M,ep=K",
        help="tensor × pipeline (× expert) parallel over processes (torch.distributed), e.g. "
        "tp=2, pp=2, tp=2,pp=2, tp=4,ep=4; auto: plan for this machine",
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's spelling of --parallel tp=N",
    )
    p.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's spelling of --parallel pp=N",
    )


def parse_parallel(spec: str | None) -> tuple[int, int, int]:
    """`tp=N,pp=M,ep=K` (any of them, any order) → (tp, pp, ep); `auto` → (0, 0, 0), planned
    later against the model."""
    if spec is None:
        return 1, 1, 1
    if spec == "auto":
        return 0, 0, 0  # resolved against the model by resolve_parallel
    sizes = {"tp": 1, "pp": 1, "ep": 1}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--parallel {spec!r}: write auto or tp=N,pp=M,ep=K (any of them)")
        sizes[key] = int(value)
    check_grid(sizes["tp"], sizes["pp"], sizes["ep"])
    return sizes["tp"], sizes["pp"], sizes["ep"]


def resolve_parallel(spec: str | None, model: str) -> tuple[int, int, int]:
    tp, pp, ep = parse_parallel(spec)
    if tp == 0:
        from dsinfer.planner.auto import choose_parallel

        return choose_parallel(model)
    return tp, pp, ep


def parallel_spec(args: argparse.Namespace) -> str | None:
    """--parallel, or vLLM's --tensor-parallel-size / --pipeline-parallel-size."""
    sizes = [
        f"{key}={n}"
        for key, n in (("tp", args.tensor_parallel_size), ("pp", args.pipeline_parallel_size))
        if n is not None
    ]
    if sizes and args.parallel is not None:
        raise ValueError(
            "give the grid once: --parallel, or --tensor-parallel-size/--pipeline-parallel-size"
        )
    return ",".join(sizes) if sizes else args.parallel


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    args.parallel = parallel_spec(args)
    args.tensor_parallel_size = args.pipeline_parallel_size = None  # folded into --parallel
    if args.parallel == "auto" and args.nnodes > 1:
        # Each node would probe and plan on its own and could pick another grid: the group
        # would never form. Every node must be given the same grid.
        raise ValueError(
            "--parallel auto plans for one machine: with --nnodes > 1 give every node the "
            "same grid (e.g. --parallel tp=4,pp=2)"
        )
    tp, pp, ep = resolve_parallel(args.parallel, model)
    return EngineArgs.from_cli(
        args, model, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep
    ).engine_config()
