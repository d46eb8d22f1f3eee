"""Load an artifact: verify it first (trust policy), then assign its mmap'd tensors to the graph."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dsinfer.artifact.errors import ArtifactError
from dsinfer.artifact.manifest import Manifest, config_from_dict
from dsinfer.artifact.programs import use_programs
from dsinfer.artifact.verify import TrustPolicy, verify_artifact
from dsinfer.artifact.weights_io import mmap_weights
from dsinfer.config import parse_dtype
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.int4_pack import BLOCKS64, int4_to_this_layout
from dsinfer.layers.quant import prepare_quantized
from dsinfer.models.loader import LoadedModel, build_model
from dsinfer.models.stages import skip_other_stage

logger = logging.getLogger(__name__)
TOKENIZER_DIR = "tokenizer"


def load_artifact(root: str | Path, policy: TrustPolicy, device: str = "cpu") -> LoadedModel:
    t0 = time.perf_counter()
    root = Path(root)
    manifest = verify_artifact(root, policy)
    # Before the backend loads kernels; native code only from a trusted signature.
    use_programs(root, manifest, torch.device(device).type, signed=policy.requires_signature)
    quant = manifest.quantization
    cfg = config_from_dict(manifest.model_config)
    dtype = parse_dtype(quant["dtype"])
    net = build_model(cfg, dtype, device)
    try:  # the scheme's registered method for this device declares the tensors' layout
        prepare_quantized(
            net,
            quant["scheme"],
            quant.get("group_size", 0),
            quant["layer_formats"],
            torch.device(device).type,
        )
    except ValueError as e:
        raise ArtifactError(f"{root}: {e}; or compile another artifact for {device}") from None
    tensors = _read_tensors(root, manifest)
    if quant["scheme"] == "int4":  # on the CPU: the conversion runs torch's CPU packing
        _int4_in_this_layout(root, tensors, quant.get("int4_layout", BLOCKS64))
    if torch.device(device).type != "cpu":
        tensors = _to_device(tensors, device)
    if parallel_state().world > 1:
        missing, unexpected = assign_rank_parts(net, tensors)
    else:
        missing, unexpected = net.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:
        raise ArtifactError(
            f"{root}: weights do not match the {cfg.architecture} graph "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]}); was it compiled by a "
            "different dsinfer version?"
        )
    net.eval()
    logger.info(
        "loaded artifact %s (%s, %s %s) in %.2fs",
        manifest.short_version,
        cfg.architecture,
        quant["scheme"],
        quant["dtype"],
        time.perf_counter() - t0,
    )
    return LoadedModel(net, cfg, root, dtype, root / TOKENIZER_DIR, manifest.short_version)


def assign_rank_parts(
    net: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Under --parallel: give every parameter this rank's part of the artifact's whole tensor
    (each module knows its cut: `local_part`); only that part is copied out of the mmap.
    Tensors another pipeline stage holds are skipped. → (missing, unexpected) names."""
    num_layers = net.config.num_layers
    used: set[str] = set()
    missing: list[str] = []
    for prefix, module in net.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            full = tensors.get(name)
            if full is None:
                missing.append(name)
                continue
            used.add(name)
            cut = getattr(module, "local_part", None)
            part = cut(pname, full) if cut is not None else full
            if part.shape != param.shape:
                raise ArtifactError(
                    f"{name}: this rank's part {tuple(part.shape)} does not match the graph's "
                    f"{tuple(param.shape)}"
                )
            param.data = part.contiguous().clone()
    unexpected = [
        n
        for n in tensors
        if n not in used
        and not n.startswith("__pad_")
        and not n.startswith("mtp.")  # the MTP layer lives on the first stage only
        and not skip_other_stage(n, num_layers)
    ]
    return missing, unexpected


def _int4_in_this_layout(root: Path, tensors: dict[str, torch.Tensor], layout: str) -> None:
    """The artifact's packed int4 tensors in the layout this process's torch packs (the same
    as the artifact's on the machines it was compiled on: nothing is copied then). Artifacts
    from before the layout was recorded were packed in 64-row blocks (AVX-512 builds)."""
    for name, t in tensors.items():
        if t.dtype == torch.uint8 and name.endswith((".qweight", ".q13", ".q2")):
            try:
                tensors[name] = int4_to_this_layout(t, layout)
            except ValueError as e:
                raise ArtifactError(f"{root}: {name}: {e}") from None


def _to_device(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The tensors on `device`; a tied tensor (one stored tensor under two names) crosses once
    and stays shared there."""
    moved: dict[int, torch.Tensor] = {}
    for t in tensors.values():
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
    return {name: moved[id(t)] for name, t in tensors.items()}


def _read_tensors(root: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for fname in manifest.weight_files:
        tensors.update(mmap_weights(root / fname))
    # A tied weight is stored once; every name that shares it gets the same tensor back.
    for alias, source in manifest.quantization.get("tied", {}).items():
        tensors[alias] = tensors[source]
    return tensors
