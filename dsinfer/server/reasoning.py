"""Splitting R1-style output into `reasoning_content` and `content`, streamed or not.

R1's chat template opens the reasoning itself (the generation prompt ends with "<think>\\n"),
so the model's output starts inside the reasoning and closes it with "</think>". Some
checkpoints and templates instead let the model write "<think>" first; both are handled. A tag
split across stream deltas is held back until it is complete, so no fragment of a tag leaks
into either field.
"""

from __future__ import annotations

from dsinfer.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"


def supports_reasoning(tokenizer: Tokenizer) -> bool:
    """R1-style: the vocabulary has both tags and the chat template writes them."""
    template = tokenizer.chat_template or ""
    has_tokens = (
        tokenizer.token_to_id(OPEN) is not None and tokenizer.token_to_id(CLOSE) is not None
    )
    return has_tokens and OPEN in template


class ReasoningParser:
    def __init__(self, prompt_text_tail: str) -> None:
        # The template already opened the reasoning block when the prompt ends in "<think>".
        self.in_reasoning = prompt_text_tail.rstrip().endswith(OPEN)
        self.saw_reasoning = self.in_reasoning
        self._started = self.in_reasoning
        self._strip_newlines = False  # the blank line after "</think>" belongs to neither
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Consume a text delta; return (reasoning_delta, content_delta)."""
        text = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while text:
            if not self._started:
                stripped = text.lstrip()
                if OPEN.startswith(stripped) and not final and len(stripped) < len(OPEN):
                    self._pending = text  # might still become "<think>"
                    break
                self._started = True
                if stripped.startswith(OPEN):
                    self.in_reasoning = self.saw_reasoning = True
                    text = stripped[len(OPEN) :]
                continue
            if not self.in_reasoning:
                if self._strip_newlines:
                    text = text.lstrip("\n")
                    self._strip_newlines = not text
                content.append(text)
                break
            idx = text.find(CLOSE)
            if idx != -1:
                reasoning.append(text[:idx])
                self.in_reasoning = False
                self._strip_newlines = True
                text = text[idx + len(CLOSE) :]
                continue
            keep = 0 if final else partial_suffix(text, CLOSE)
            reasoning.append(text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, prompt_text_tail: str) -> tuple[str | None, str]:
    """Whole-text version: (reasoning_content or None, content)."""
    parser = ReasoningParser(prompt_text_tail)
    reasoning, content = parser.feed(text, final=True)
    return (reasoning if parser.saw_reasoning else None), content
