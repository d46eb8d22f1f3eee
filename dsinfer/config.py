"""Frozen configuration records shared by the control plane and the data plane."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

# The weight-only quantisation schemes (their methods are registered in layers/quant.py).
QUANTISED_SCHEMES = ("int8", "int4")
# --int8-activations: which int4 layers round their activations to int8 (layers/backend.py).
INT8_ACTIVATIONS = ("auto", "none", "out_proj", "all")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    # vLLM users write float16: served as bfloat16 (see parse_dtype).
    "float16": torch.bfloat16,
    "fp16": torch.bfloat16,
    "half": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype, checkpoint_dtype: str | None = None) -> torch.dtype:
    """Resolve a user dtype name; "auto" follows the checkpoint (bf16/fp16 → bf16, else fp32).

    float16 is mapped to bfloat16 because CPUs have no fast fp16 GEMM and bf16 keeps fp16's range.
    """
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported dtype {name}; use float32 or bfloat16")
        return name
    if name == "auto":
        if checkpoint_dtype in ("bfloat16", "float16"):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(
            f"unsupported dtype {name!r}; choose one of auto, float32, bfloat16 (float16 is "
            "served as bfloat16)"
        )
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is default | linear | llama3."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (DeepSeek-V2/V3): ramp bounds and the attention-scale (mscale) correction.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent
    plus one rope key per token and layer."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: queries are projected directly (V2-Lite)

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class SparseAttentionConfig:
    """DeepSeek Sparse Attention (V3.2): a lightning indexer scores every cached token for each
    query and MLA attends to the `index_topk` best only. The cache keeps one indexer key of
    `index_head_dim` per token and layer beside the latent."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int


@dataclass(frozen=True, slots=True)
class ExpertsConfig:
    """DeepSeekMoE routing and expert shapes (the model's hyper-parameters; layers/moe.py
    builds its layer config from them)."""

    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    score_correction_bias: bool

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.n_routed_experts > 0
            and index >= self.first_k_dense_replace
            and index % self.moe_layer_freq == 0
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer, source-format agnostic."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    hidden_act: str = "silu"
    checkpoint_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # DeepSeek's hyper-parameters are stored in `extra` (as artifacts serialise them) and read
    # through these typed views: one rule for "is this MLA / MoE", no string keys elsewhere.
    @property
    def mla(self) -> MLAConfig | None:
        if "kv_lora_rank" not in self.extra:
            return None
        return MLAConfig(**{f.name: self.extra[f.name] for f in dataclasses.fields(MLAConfig)})

    @property
    def sparse_attention(self) -> SparseAttentionConfig | None:
        if "index_topk" not in self.extra:
            return None
        fields = dataclasses.fields(SparseAttentionConfig)
        return SparseAttentionConfig(**{f.name: self.extra[f.name] for f in fields})

    @property
    def moe(self) -> ExpertsConfig | None:
        if not self.extra.get("n_routed_experts"):
            return None
        return ExpertsConfig(
            **{f.name: self.extra[f.name] for f in dataclasses.fields(ExpertsConfig)}
        )

    @property
    def num_nextn_predict_layers(self) -> int:
        """MTP layers the checkpoint was trained with (DeepSeek-V3)."""
        return int(self.extra.get("num_nextn_predict_layers", 0))

    @property
    def num_mtp_layers(self) -> int:
        """Multi-token-prediction layers in use (DeepSeek-V3 checkpoints that carry them)."""
        return int(self.extra.get("mtp_layers", 0))

    @property
    def num_cache_layers(self) -> int:
        """Layers with a KV cache: the decoder layers plus any MTP layer."""
        return self.num_layers + self.num_mtp_layers

    def with_mtp(self, layers: int) -> ModelConfig:
        return dataclasses.replace(self, extra={**self.extra, "mtp_layers": layers})

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies across all cached layers."""
        elem = torch.tensor([], dtype=dtype).element_size()
        if self.mla is not None:  # one latent plus one rope key per token and layer
            dsa = self.sparse_attention  # ... and the indexer's key (V3.2)
            width = self.mla.latent_width + (dsa.index_head_dim if dsa is not None else 0)
            return self.num_cache_layers * width * elem
        return 2 * self.num_cache_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV pool sizing: `num_blocks` wins over the memory budget when given; a budget of
    None sizes the pool for the model (worker/kv_cache.py, `auto_kv_budget`)."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Bounds of one engine step."""

    max_num_seqs: int = 64
    # 512: a prefill chunk's GEMMs are as efficient as at 1,024 on CPU, and its transients
    # half as large (16 streams on SmolLM2: peak RSS 842 → 812 MiB, the same tok/s, measured).
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None


def context_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The context length an engine serves: the one asked for, at most the model's."""
    return min(model.max_position_embeddings, max_model_len or model.max_position_embeddings)


MAX_MTP_DRAFTS = 8


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    # Kernel backend: auto (fused where it runs, else reference) | reference | fused.
    backend: str = "auto"
    # The fused backend runs decode-only steps as one captured program (layers/step_program.py).
    step_program: bool = True
    # CPU: the weights and the KV pool in transparent huge pages (device/host_memory.py).
    huge_pages: bool = True
    # Which int4 layers meet activations rounded to int8 per group of 32 (llama.cpp's
    # arithmetic): auto (all wherever the fused CPU kernel runs, none elsewhere) | none |
    # out_proj (the blocks' output projections) | all. Within the quality gate on SmolLM2
    # (+0.27% prompt perplexity, -0.09% decode: docs/backends.md).
    int8_activations: str = "auto"
    # Weights quantised at load: auto (a Q4/Q8 GGUF keeps int4/int8 unless dtype is float32)
    # | none | int8 | int4. Artifacts are quantised at compile instead.
    quantization: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    tokenizer: str | None = None  # default: the model's own files
    # A Jinja chat template (its text, or a file holding it) replacing the tokenizer's.
    chat_template: str | None = None
    # The peaks utilisation is measured against: a built-in profile name or a `dsinfer probe`
    # JSON; None measures this CPU at start-up (or takes the device type's built-in profile).
    device_profile: str | None = None
    random_weights: bool = False  # build from config.json with seeded random weights
    random_quant: str = "none"  # with random_weights: int8 | int4 layouts (large configs)
    # Trust policy for artifacts: public keys their signature must verify with (plus
    # DSINFER_TRUSTED_KEYS); allow_unsigned is the explicit opt-out.
    trusted_keys: tuple[str, ...] = ()
    allow_unsigned: bool = False
    # Self-speculative decoding with a DeepSeek-V3 checkpoint's MTP layer, when it has one.
    mtp: bool = True
    # Draft tokens a step from the MTP layer: 1, or a chain of up to 8 (the layer fed its own
    # output and draft, one position on); the scheduler holds mtp_drafts - 1 KV slots ahead.
    mtp_drafts: int = 1
    # Prompt-lookup speculative decoding: up to this many draft tokens a step, taken from
    # where the request's last tokens occurred before (0: off; it takes precedence over MTP).
    ngram_speculation: int = 0
    tensor_parallel: int = 1  # processes each layer is split over (gloo on CPU)
    pipeline_parallel: int = 1  # stages the layers are split into (one process each)
    expert_parallel: int = 1  # processes the routed experts are placed over (MoE models)
    # Multi-node rendezvous (torchrun's names): the ranks are spread evenly over `nnodes`
    # machines; node 0 runs rank 0 (the scheduler, the server) at master_addr:master_port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # one node: a free local port

    def __post_init__(self) -> None:
        if not 1 <= self.mtp_drafts <= MAX_MTP_DRAFTS:
            raise ValueError(
                f"mtp_drafts: draft tokens a step from the MTP layer must be 1 to "
                f"{MAX_MTP_DRAFTS}, got {self.mtp_drafts}"
            )
        if self.ngram_speculation < 0:
            raise ValueError(
                f"ngram_speculation: draft tokens a step must be >= 0, got {self.ngram_speculation}"
            )


def parse_memory(text: str | int) -> int:
    """Parse "512MiB", "2GiB", "1.5GB" or a plain byte count."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    units = {
        "gib": 1024**3,
        "mib": 1024**2,
        "kib": 1024,
        "gb": 10**9,
        "mb": 10**6,
        "kb": 10**3,
        "g": 1024**3,
        "m": 1024**2,
        "k": 1024,
        "b": 1,
    }
    for suffix, mult in units.items():
        if s.endswith(suffix):
            try:
                return int(float(s[: -len(suffix)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"cannot parse memory size {text!r}; write e.g. 512MiB or 2GiB") from None
