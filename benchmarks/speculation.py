"""Speculative decoding against plain decoding, in one process, on the embedded SmolLM2 as
`make serve` configures it: prompt lookup (`--ngram-speculation K`) or predicted outputs
(SamplingParams.prediction, OpenAI's `prediction`).

    python benchmarks/speculation.py [--drafter lookup|prediction] [--k 4] [--rounds 2]
                                     [--max-tokens 200] [--temperature 0.7 --top-p 0.95]

Workloads (greedy unless --temperature, chat template):
- copy: repeat a paragraph word for word (tests/data/long_text.txt's opening);
- extract: a record's fields as JSON (the output copies names, dates and amounts);
- story: free-form text, which seldom repeats its prompt (the cost side);
- 16 stories at once: under load the drafter stands back (no drafts past 16 rows a step).
With `--drafter prediction` the paragraph is each request's prediction: right for copy, wrong
for the others (what a wrong prediction costs).

Prints decode tokens a second (first token to last) with and without drafts, the ratio, the
share of drafts kept, and whether the tokens were the same (sampled: each request's seed comes
from its engine's seed stream, the same in both engines, so the tokens should be the same too).
The two engines alternate within each round: these machines drift by 25% over minutes.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer import LLM, SamplingParams

TEXT = (Path(__file__).resolve().parents[1] / "tests" / "data" / "long_text.txt").read_text()
RECORD = (
    "Transaction record 88213-B. Card holder: Margaret Okonkwo-Leblanc, account 4471 0093 "
    "2281 5510, billing address 14 Rue des Tanneurs, 69002 Lyon. On 2026-11-28 at 23:41 the "
    "card paid EUR 1,249.90 to Brightwater Electronics Ltd (merchant id BWE-77120, London); "
    "at 23:44 it paid EUR 1,249.90 again to the same merchant, and at 23:52 EUR 18.50 to "
    "Café Lumière, Lyon. The holder's usual spending is under EUR 200 a day."
)
PARAGRAPH = TEXT[:700]
WORKLOADS = {
    "copy": "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH,
    "extract": "Extract every transaction from this record as a JSON list of objects with "
    "the fields merchant, date, time and amount, copying the values exactly:\n\n" + RECORD,
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def decode_rate(llm: LLM, prompt: str, n: int, params: SamplingParams) -> tuple[float, list, float]:
    """(decode tok/s over the batch, the token ids, drafts kept / drafted)."""
    convs = [[{"role": "user", "content": prompt}]] * n
    outs = llm.chat(convs, params)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    kept = sum(o.metrics.num_accepted_draft_tokens for o in outs)
    return (
        (tokens - n) / (last - first),
        [o.outputs[0].token_ids for o in outs],
        kept / max(drafted, 1),
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--drafter", choices=("lookup", "prediction"), default="lookup")
    p.add_argument("--k", type=int, default=4, help="prompt lookup's draft tokens a step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args()
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    torch.set_num_threads(2)
    # No prefix cache: a repeated prompt would otherwise be prefilled differently in later runs.
    plain = LLM("smollm2", enable_prefix_caching=False)
    lookup = args.drafter == "lookup"
    drafted = LLM("smollm2", enable_prefix_caching=False, ngram_speculation=args.k if lookup else 0)
    with_drafts = params if lookup else replace(params, prediction=PARAGRAPH)
    cases = [(name, prompt, 1) for name, prompt in WORKLOADS.items()] + [
        ("16 stories", WORKLOADS["story"], 16)
    ]
    for llm in (plain, drafted):  # warm-up
        decode_rate(llm, WORKLOADS["story"], 1, SamplingParams(temperature=0, max_tokens=8))
    label = f"K={args.k}" if lookup else "predicted"
    print(f"| workload | plain tok/s | {label} tok/s | ratio | drafts kept | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, prompt, n in cases:
        ratios, rates = [], []
        for r in range(args.rounds):
            sides = [(plain, params), (drafted, with_drafts)]
            if r % 2:
                sides.reverse()
            got = {id(llm): decode_rate(llm, prompt, n, ps) for llm, ps in sides}
            a, b = got[id(plain)], got[id(drafted)]
            ratios.append(b[0] / a[0])
            rates.append((a[0], b[0], b[2], a[1] == b[1]))
        a_rate = statistics.median(x[0] for x in rates)
        b_rate = statistics.median(x[1] for x in rates)
        print(
            f"| {name} | {a_rate:.0f} | {b_rate:.0f} | {statistics.median(ratios):.2f}× "
            f"| {rates[-1][2]:.0%} | {all(x[3] for x in rates)} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
