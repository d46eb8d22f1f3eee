"""`dsinfer compile`: checkpoint → quantised, fused, hashed (and signed) artifact directory.

The runtime layout is the model's own `state_dict`: q/k/v and gate/up are already fused by the
model's Linear layers at load, so compiling is load → quantise → save. Everything is written to
a hidden sibling directory that is renamed onto OUT only when complete, so an interrupted
compile never leaves anything at OUT that looks like an artifact.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import Manifest, config_to_dict, file_entry, write_manifest
from dsinfer.artifact.programs import write_programs
from dsinfer.artifact.reader import TOKENIZER_DIR
from dsinfer.artifact.signing import sign_dir
from dsinfer.artifact.weights_io import save_weights
from dsinfer.config import QUANTISED_SCHEMES, parse_dtype
from dsinfer.layers.int4_pack import int4_pack_layout
from dsinfer.layers.quant import INT4_GROUP_SIZES, SCHEMES, layer_formats
from dsinfer.models.gguf_file import native_scheme, open_gguf
from dsinfer.models.loader import LoadedModel, load_model, resolve_model_path
from dsinfer.progress import progress
from dsinfer.tokenizer import load_tokenizer
from dsinfer.version import __version__

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompileOptions:
    quant: str = "none"
    group_size: int = 32
    dtype: str = "auto"  # float parts; default: checkpoint's for none, bf16 otherwise
    sign_key: Path | None = None
    force: bool = False


def check_options(opts: CompileOptions) -> None:
    if opts.quant not in SCHEMES:
        raise ArtifactError(f"unknown --quant {opts.quant!r}; choose one of {', '.join(SCHEMES)}")
    if opts.quant == "int4" and opts.group_size not in INT4_GROUP_SIZES:
        raise ArtifactError(
            f"--group-size {opts.group_size} is not supported for int4; choose one of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )


def float_dtype(opts: CompileOptions) -> str | torch.dtype:
    """The dtype of what stays float: as asked; by default the checkpoint's ("auto") when
    nothing is quantised, else bf16 (the packed int8/int4 CPU kernels are vectorised for it)."""
    if opts.dtype != "auto" or opts.quant == "none":
        return opts.dtype
    return torch.bfloat16


def _dedup_tied(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with each shared tensor stored once; returns (tensors, alias → stored name)."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[int, int], str] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t
    return tensors, tied


def _write_contents(
    tmp: Path, src: str, loaded: LoadedModel, opts: CompileOptions, dtype: torch.dtype
) -> Manifest:
    exceptions: dict[str, str] = {}
    if opts.quant in QUANTISED_SCHEMES:
        # Quantised as it loaded (a 4-bit GGUF's blocks as they are, the rest layer by layer
        # from the fp32 weights): the formats are read back from the model, and the scales and
        # every float tensor left take `dtype`.
        exceptions = layer_formats(loaded.model, opts.quant)
        for p in loaded.model.parameters():
            if p.is_floating_point() and not getattr(p, "keep_fp32", False):
                p.data = p.data.to(dtype)
    tensors, tied = _dedup_tied(loaded.model)
    weight_files = save_weights(tensors, tmp)
    tokenizer_files = [
        f"{TOKENIZER_DIR}/{f}" for f in load_tokenizer(loaded.path).save(tmp / TOKENIZER_DIR)
    ]
    quantization = {
        "scheme": opts.quant,
        "group_size": opts.group_size if opts.quant == "int4" else 0,
        "dtype": str(dtype).removeprefix("torch."),
        # How torch packed the int4 bytes here (it packs by CPU capability): a process whose
        # torch packs otherwise converts them at load, or refuses them.
        **({"int4_layout": int4_pack_layout()} if opts.quant == "int4" else {}),
        "layer_formats": exceptions,  # layers not in `scheme`: int8 or float
        "tied": tied,
        "source": Path(src).name,
    }
    programs = write_programs(tmp)  # the built kernels and decode-step program, when there are
    program_files = [p["path"] for p in programs]
    files = [file_entry(tmp, rel) for rel in sorted(weight_files + tokenizer_files + program_files)]
    manifest = Manifest(
        dsinfer_version=__version__,
        model_config=config_to_dict(loaded.config),
        quantization=quantization,
        tokenizer_files=tokenizer_files,
        weight_files=weight_files,
        files=files,
        programs=programs,
    ).sealed()
    write_manifest(tmp, manifest)
    return manifest


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with open(Path(dirpath, name), "rb") as f:
                os.fsync(f.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(out: Path) -> None:
    """Leftovers of compiles that were killed (their process is gone)."""
    for leftover in out.parent.glob(f".{out.name}.partial-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            logger.info("removing %s, left by an interrupted compile", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():  # --force: the old artifact goes only once the new one is complete
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)


def _q4_gguf_to_int4(src: str, opts: CompileOptions) -> bool:
    """Whether `src` is a GGUF of 4-bit projections (Q4_0 / Q4_1 / Q4_K) compiled to int4 in
    groups of 32: the loader then packs its blocks as they are (models/gguf_int4.py), where our
    min/max quantiser would move the blocks whose codes miss 0 or 15 to another grid (a Q4_0
    block's, usually), and the rest is loaded in the dtype `dsinfer serve` loads it in, so the
    artifact computes exactly what serving the file with --quantization int4 computes."""
    path = resolve_model_path(src)
    if not (path.is_file() and opts.quant == "int4" and opts.group_size == 32):
        return False
    return native_scheme(open_gguf(path)) == "int4"


def compile_artifact(src: str, out: Path, opts: CompileOptions) -> Manifest:
    """Compile `src` (HF directory, GGUF file or embedded name) into the artifact `out`."""
    check_options(opts)
    out = out.expanduser().resolve()
    if out.exists() and not opts.force:
        raise ArtifactError(f"{out} exists; choose another -o or pass --force to replace it")
    t0 = time.perf_counter()
    if opts.quant == "int4" and opts.group_size > 32 and resolve_model_path(src).is_file():
        # GGUF's 4/5-bit types quantise in groups of 32; wider groups cannot reproduce their
        # grid (SmolLM2 Q4_1 → int4/64: perplexity +48%, measured).
        logger.warning("the GGUF source is quantised in groups of 32; --group-size 32 keeps it")
    quantised = opts.quant in QUANTISED_SCHEMES
    # Quantised weights come from the fp32 weights, layer by layer as they load (never the
    # whole fp32 model: a checkpoint larger than memory compiles); a 4-bit GGUF's blocks are
    # packed as they are, the rest of it quantised from the values `dsinfer serve` quantises.
    load_dtype = (
        torch.float32 if quantised and not _q4_gguf_to_int4(src, opts) else float_dtype(opts)
    )
    with progress(f"compiling {src}", 4) as stage:  # load + quantise, write, sign, sync
        loaded = load_model(
            src,
            load_dtype,
            quantization=opts.quant if quantised else "none",
            group_size=opts.group_size,
            for_artifact=True,
        )
        stage(1)
        dtype = parse_dtype(float_dtype(opts)) if quantised else loaded.dtype
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            manifest = _write_contents(tmp, src, loaded, opts, dtype)
            stage(1)
            if opts.sign_key is not None:
                sign_dir(tmp, opts.sign_key)
            stage(1)
            _fsync_tree(tmp)
            stage(1)
            _replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info(
        "compiled %s → %s (%s) version %s in %.1fs",
        src,
        out,
        opts.quant,
        manifest.short_version,
        time.perf_counter() - t0,
    )
    return manifest
