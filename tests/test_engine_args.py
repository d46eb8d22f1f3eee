"""One source of engine options: the CLI flags and LLM's keyword arguments both come from
EngineArgs, and its defaults are the engine's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dsinfer.cli import build_parser
from dsinfer.config import EngineConfig
from dsinfer.engine_args import DEFAULT_MODEL, EngineArgs, engine_config


def test_defaults_agree_with_the_engine_config():
    assert EngineArgs().engine_config() == EngineConfig(model=DEFAULT_MODEL)


def test_every_cli_field_has_a_flag_and_round_trips():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = {a.dest for a in parser._actions}
    cli_fields = {
        f.name for f in dataclasses.fields(EngineArgs) if f.metadata["argparse"].get("cli", True)
    }
    assert cli_fields <= flags
    args = build_parser().parse_args(
        ["serve", "m", "--dtype", "bfloat16", "--num-kv-blocks", "7", "--no-prefix-caching",
         "--no-mtp", "--trusted-key", "a.pub", "--trusted-key", "b.pub", "-tp", "1",
         "--max-num-seqs", "3", "--chat-template", "t.jinja"]
    )  # fmt: skip
    cfg = engine_config(args, "m")
    assert (cfg.dtype, cfg.cache.num_blocks, cfg.cache.enable_prefix_caching, cfg.mtp) == (
        "bfloat16", 7, False, False,
    )  # fmt: skip
    assert cfg.trusted_keys == ("a.pub", "b.pub") and cfg.scheduler.max_num_seqs == 3
    assert cfg.chat_template == "t.jinja" and cfg.tensor_parallel == 1
    defaults = engine_config(build_parser().parse_args(["serve"]), DEFAULT_MODEL)
    assert defaults == EngineArgs().engine_config()  # no flag: the same engine as LLM()


def test_llm_names_what_it_does_not_know():
    from dsinfer import LLM

    with pytest.raises(ValueError, match="unknown argument.*kv_cache_mem;.*kv_cache_memory"):
        LLM("smollm2", kv_cache_mem="1GiB")
    assert "kv_cache_memory ('auto'): KV pool budget" in LLM.__doc__


def test_every_command_prints_its_help(capsys):
    """argparse formats help strings with %: a bare "%" in one (a "+0.3%" once) turned
    `dsinfer serve --help` into a traceback."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert sub.format_help(), name
        with pytest.raises(SystemExit) as done:
            parser.parse_args([name, "--help"])
        assert done.value.code == 0, name
    out = capsys.readouterr().out
    assert "--int8-activations" in out
    # The help text is plain text: argparse's escaping is add_cli_args' business, not the text's.
    assert "+0.3% perplexity" in " ".join(out.split())
    from dsinfer import LLM

    assert "+0.3% perplexity" in LLM.__doc__ and "%%" not in LLM.__doc__
