"""Offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from dsinfer.device.host_threads import release_openmp_pool
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine_args import DEFAULT_MODEL, EngineArgs, engine_arg_names
from dsinfer.progress import progress
from dsinfer.sampling import SamplingParams, split_samples

PromptType = str | dict[str, Any]


class LLM:
    """Load a model (a path, a GGUF file, a compiled artifact or the embedded name "smollm2")
    and run batches offline. Keyword arguments are EngineArgs' fields (dsinfer/engine_args.py,
    the same options `dsinfer serve` takes as flags); listed below with their defaults."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - engine_arg_names())
        if unknown:
            raise ValueError(
                f"LLM() got unknown argument(s) {', '.join(unknown)}; the engine's options are "
                f"{', '.join(sorted(engine_arg_names() - {'model'}))}"
            )
        config = EngineArgs(model=model, **kwargs).engine_config()
        try:
            self.engine = LLMEngine(config)
        finally:
            # The thread that loaded may not be the one that generates (a web app's worker
            # threads): each keeps an OpenMP pool while it holds one, and with more pools
            # than CPUs every parallel region pays a futex wake-up (device/host_threads.py).
            release_openmp_pool()
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; results in input order.

        A prompt is a string or {"prompt_token_ids": [...]}. With n > 1, the n samples come
        back as `.outputs[0..n-1]`; sample i uses seed + i when a seed is set.
        `sampling_params=` is vLLM's name for `params`; `use_tqdm` shows a progress bar of
        finished prompts (on a terminal).
        """
        if sampling_params is not None:
            if params is not None:
                raise ValueError("pass params or sampling_params, not both")
            params = sampling_params
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        groups: list[list[str]] = []
        for prompt, p in zip(prompts, plist, strict=True):
            groups.append([self._add(prompt, sub) for sub in split_samples(p)])
        finals: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups) if use_tqdm else 0
        try:
            with progress("generating", total, log=False) as advance:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            finals[out.request_id] = out
                            advance(1)
        finally:
            release_openmp_pool()  # as after loading: the next call may come from another thread
        results = []
        for ids in groups:
            first = finals[ids[0]]
            outs = []
            for i, rid in enumerate(ids):
                c = finals[rid].outputs[0]
                c.index = i
                outs.append(c)
            first.outputs = outs
            results.append(first)
        return results

    def close(self) -> None:
        """Stop the engine's worker processes (tensor/pipeline parallel); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.engine.add_request(list(prompt["prompt_token_ids"]), params)
            if "prompt" in prompt:
                return self.engine.add_request(str(prompt["prompt"]), params)
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        return self.engine.add_request(prompt, params)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        *,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c)} for c in convs]
        return self.generate(prompts, params, sampling_params=sampling_params, use_tqdm=use_tqdm)


def _document_options() -> None:
    """LLM's docstring lists every engine option with its default and help, from EngineArgs."""
    lines = [f"    {f.name} ({f.default!r}): {f.metadata['help']}" for f in fields(EngineArgs)]
    LLM.__doc__ = f"{LLM.__doc__}\n\n" + "\n".join(lines)


_document_options()
