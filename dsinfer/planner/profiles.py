"""Device profiles are data: memory, bandwidth, matmul throughput per dtype, links.

Built-in profiles (h200, a100, ascend-910b) ship as JSON beside this file with the datasheet
figures they come from; `dsinfer probe` writes one for the machine it runs on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds per message


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    flops: dict[str, float]  # dtype → peak FLOP/s
    intra_node: Link
    inter_node: Link
    devices_per_node: int = 8
    efficiency: dict[str, float] = field(default_factory=dict)  # achievable share of peaks
    shared_host: bool = False  # all "devices" share one memory system (CPU processes)
    device_bandwidth: float | None = None  # what one device alone reaches (one CPU thread)
    # What each of two devices reaches while both stream at once (shared hosts, probed).
    concurrent_bandwidth: float | None = None
    # Host time per step that does not scale with the weights (dispatch, bookkeeping): per
    # decoder layer and per routed expert run. Probed on CPU; 0 where graphs hide it.
    layer_overhead: float = 0.0
    expert_overhead: float = 0.0
    sources: tuple[str, ...] = ()

    def eff(self, kind: str) -> float:
        return self.efficiency.get(kind, 0.6)

    def flops_for(self, dtype: str) -> float:
        return self.flops.get(dtype) or self.flops.get("bfloat16") or max(self.flops.values())


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def profile_from_dict(data: dict[str, Any]) -> DeviceProfile:
    return DeviceProfile(
        name=data["name"],
        memory_bytes=int(data["memory_bytes"]),
        memory_bandwidth=float(data["memory_bandwidth"]),
        flops={k: float(v) for k, v in data["flops"].items()},
        intra_node=Link(
            float(data["intra_node"]["bandwidth"]), float(data["intra_node"]["latency"])
        ),
        inter_node=Link(
            float(data["inter_node"]["bandwidth"]), float(data["inter_node"]["latency"])
        ),
        devices_per_node=int(data.get("devices_per_node", 8)),
        efficiency={k: float(v) for k, v in data.get("efficiency", {}).items()},
        shared_host=bool(data.get("shared_host", False)),
        device_bandwidth=data.get("device_bandwidth"),
        concurrent_bandwidth=data.get("concurrent_bandwidth"),
        layer_overhead=float(data.get("layer_overhead", 0.0)),
        expert_overhead=float(data.get("expert_overhead", 0.0)),
        sources=tuple(data.get("sources", ())),
    )


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile's name or a JSON file (from `dsinfer probe`)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = BUILTIN_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"unknown device profile {name_or_path!r}: use one of {', '.join(builtin_names())} "
            "or a JSON file written by `dsinfer probe`"
        )
    try:
        return profile_from_dict(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a device profile ({e})") from None
