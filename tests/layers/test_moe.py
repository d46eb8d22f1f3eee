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
