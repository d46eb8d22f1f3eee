"""--random-weights: real shapes from config.json alone, seeded, with a separate tokenizer."""

from __future__ import annotations

import json
import shutil

import torch

from dsinfer import LLM, SamplingParams
from tests.helpers import tiny_llama_dir


def test_random_weights_are_seeded_and_generate(tmp_path):
    real = tiny_llama_dir(tmp_path / "real")
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    shutil.copy(real / "config.json", cfg_only / "config.json")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def build(seed: int) -> LLM:
        return LLM(
            str(cfg_only / "config.json"),
            random_weights=True,
            tokenizer=str(real),
            seed=seed,
            num_blocks=16,
            block_size=4,
        )

    a, b, c = build(1), build(1), build(2)
    wa = a.engine.executor.runner.model.state_dict()
    wb = b.engine.executor.runner.model.state_dict()
    wc = c.engine.executor.runner.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert (
        a.generate("w5 w6", params)[0].outputs[0].token_ids
        == b.generate("w5 w6", params)[0].outputs[0].token_ids
    )
    cfg = json.loads((real / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    want = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert a.engine.kv_bytes_per_token == want
