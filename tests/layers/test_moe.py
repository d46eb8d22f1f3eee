"""DeepSeekMoE against transformers' DeepseekV2Moe / DeepseekV3MoE modules on random weights."""

from __future__ import annotations

import pytest
import torch

from dsinfer.layers.moe import DeepseekMoE, MoEConfig

COMMON = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    num_hidden_layers=1,
    num_attention_heads=4,
    vocab_size=64,
)


def _ref(version: str, **kw):  # noqa: ANN202
    if version == "v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = DeepseekV3Config(**{**COMMON, **kw})
        mod = DeepseekV3MoE(cfg)
    else:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        cfg = DeepseekV2Config(**{**COMMON, **kw})
        mod = DeepseekV2Moe(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if version == "v3":  # a bias big enough to change which experts win
            mod.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.5)
    return cfg, mod.eval()


def _ours(version: str, cfg, ref) -> DeepseekMoE:  # noqa: ANN001
    ours = DeepseekMoE(
        MoEConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            num_shared_experts=cfg.n_shared_experts,
            scoring="sigmoid" if version == "v3" else "softmax",
            n_group=cfg.n_group or 1,
            topk_group=cfg.topk_group or 1,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False))
            if version == "v3"
            else False,
            routed_scaling_factor=cfg.routed_scaling_factor,
            score_correction_bias=version == "v3",
        )
    )
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        if version == "v3":
            ours.gate.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts.w13.copy_(ref.experts.gate_up_proj)
        ours.experts.w2.copy_(ref.experts.down_proj)
        se = ref.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(
            torch.cat([se.gate_proj.weight, se.up_proj.weight])
        )
        ours.shared_experts.down_proj.weight.copy_(se.down_proj.weight)
    return ours


@pytest.mark.parametrize(
    "version,kw",
    [
        ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
        ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=False)),
        ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
        ("v2", dict(topk_method="greedy", n_group=1, topk_group=1)),
    ],
)
def test_moe_matches_reference(version, kw):
    cfg, ref = _ref(version, **kw)
    ours = _ours(version, cfg, ref)
    x = torch.randn(257, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(x.unsqueeze(0))[0]
        _, _, ref_ids = ref.gate(x)
        got = ours(x)
        from dsinfer.layers.moe import route

        _, ids = route(
            torch.nn.functional.linear(x, ours.gate.weight),
            ours.cfg,
            ours.gate.e_score_correction_bias,
        )
    assert torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values)
    assert (got - want).abs().max().item() < 1e-4


def test_bad_moe_config_is_explained():
    with pytest.raises(ValueError, match="not divisible by n_group"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=6, top_k=2, n_group=4)
    with pytest.raises(ValueError, match="scoring_func"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=8, top_k=2, scoring="relu")


def _experts(dtype: torch.dtype, hidden: int = 32, inter: int = 16, num: int = 6):  # noqa: ANN202
    from dsinfer.layers.moe import RoutedExperts

    cfg = MoEConfig(hidden_size=hidden, intermediate_size=inter, num_experts=num, top_k=2)
    experts = RoutedExperts(cfg).to(dtype)
    g = torch.Generator().manual_seed(4)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ids",
    [
        [[0, 1], [2, 1], [1, 0], [5, 2], [0, 5]],  # experts 3 and 4 get no tokens
        [[4, 3]],  # one row (a decode step)
        [[5, 0], [5, 0], [5, 0]],  # every token to the same two
    ],
)
def test_grouped_experts_equal_the_per_expert_loop(dtype: torch.dtype, ids) -> None:  # noqa: ANN001
    """The graph-safe path (two grouped GEMMs, counts by scatter-add, no host read) computes
    what the loop over experts computes, bit for bit on this CPU (torch's grouped GEMM is a
    per-group GEMM here; on CUDA it is one kernel), experts without tokens included."""
    experts = _experts(dtype)
    g = torch.Generator().manual_seed(len(ids))
    x = torch.randn(len(ids), 32, generator=g).to(dtype)
    weights = torch.rand(len(ids), 2, generator=g)
    ids_t = torch.tensor(ids)
    with torch.inference_mode():
        want = experts(x, weights, ids_t)
        experts.use_grouped_mm(True)
        assert experts.graph_safe
        got = experts(x, weights, ids_t)
    assert torch.equal(got, want)


def test_fused_backend_takes_grouped_experts_only_where_the_device_holds_them_in_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """use_kernels picks the grouped GEMM on the fused backend where the device layer says the
    kernel reads nothing back (CUDA bf16, compute capability ≥ 9.0; never this CPU), and only
    for a layout the kernel takes: every expert on this rank, 16-byte rows."""
    from dsinfer.layers import moe
    from dsinfer.layers.kernels import FUSED_CPU, REFERENCE
    from dsinfer.layers.quant import experts_method

    experts = _experts(torch.bfloat16)
    experts.use_kernels(FUSED_CPU, "cpu")
    assert not experts.graph_safe  # this CPU: torch loops over the groups on the host
    monkeypatch.setattr(moe, "grouped_mm_in_graphs", lambda device, dtype: True)
    experts.use_kernels(REFERENCE, "cpu")
    assert not experts.graph_safe  # the reference backend keeps the loop (the oracle)
    experts.use_kernels(FUSED_CPU, "cpu")
    assert experts.graph_safe
    odd = _experts(torch.bfloat16, hidden=36)  # rows of 72 bytes
    odd.use_kernels(FUSED_CPU, "cpu")
    assert not odd.graph_safe
    experts.owned = range(0, 3)  # expert parallel: half the experts on this rank
    experts.use_kernels(FUSED_CPU, "cpu")
    assert not experts.graph_safe
    quantised = _experts(torch.bfloat16)
    quantised.set_method(experts_method("int8", 32))  # integer codes: no float stack
    assert quantised.method.stacked(quantised, "13") is None
    quantised.use_kernels(FUSED_CPU, "cpu")
    assert not quantised.graph_safe
