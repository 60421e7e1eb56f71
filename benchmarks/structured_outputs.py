"""Structured outputs' cost: decode tokens/s of a constrained answer against the same answer free.

In process (the chat dialect's service, no TorchServe), greedy, side by side in one run, rounds
interleaved:

1. **One answer**: the same question, ``--new-tokens`` tokens, free and constrained to a JSON schema
   (a string field long enough that neither answer ends before the limit: both run every token).
   Decode tokens/s = (tokens - 1) / (time from the first token to the last) per the answer's own
   timings; ratio constrained / free (goal: at least 0.8x).
2. **A batch of 8**: eight answers admitted at once, all free, then half constrained; aggregate
   tokens/s (every answer's tokens / wall time) and the ratio.
3. **The mask alone on a 32k vocabulary**: the bench model's tokenizer has 791 tokens, llava-1.5's
   32,002; the time llguidance takes to compute one token's mask, walking a JSON schema with
   random choices, on a byte-level BPE tokenizer of ``--mask-vocab`` tokens trained here on Python's
   standard library sources (no hub access needed).

Usage::

    python benchmarks/structured_outputs.py [--model bench | --model-dir DIR] [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from llava_sessions.service import BatchRequest, SessionService
from llava_sessions.worker import build_service

_ids = itertools.count()
SCHEMA = {
    "type": "object",
    "properties": {"caption": {"type": "string", "maxLength": 4000}, "count": {"type": "integer"}},
    "required": ["caption", "count"],
}
QUESTIONS = ("Describe the scene.", "What is on the table?", "Tell me a story.", "Name the colors.")


def _body(question: str, new_tokens: int, constrained: bool) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": new_tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}
    return body


def run(svc: SessionService, bodies: list[dict]) -> tuple[float, int]:
    """Admit ``bodies`` at once (sessionless, no session) and drive them to their ends: (wall s, tokens)."""
    rids = [f"b{next(_ids)}" for _ in bodies]
    t0 = time.perf_counter()
    rows = [BatchRequest(r, f"ts-seq-{r}", True, b) for r, b in zip(rids, bodies, strict=True)]
    last = dict(zip(rids, svc.handle(rows), strict=True))
    while live := [r for r in rids if last[r].stop is False]:
        for r, out in zip(live, svc.handle([BatchRequest(r, f"ts-seq-{r}", True, None) for r in live]), strict=True):
            last[r] = out
    wall = time.perf_counter() - t0
    tokens = sum(json.loads(last[r].body)["usage"]["completion_tokens"] for r in rids)
    return wall, tokens


def decode_rate(svc: SessionService, body: dict) -> float:
    """One answer's decode tokens/s: the tokens after the first over the time between them."""
    wall, tokens = run(svc, [body])
    first, _ = run(svc, [dict(body, max_tokens=1)])  # its prefill and first token alone
    return (tokens - 1) / max(1e-9, wall - first)


def mask_cost_us(vocab: int, steps: int = 400) -> float:
    """Median microseconds llguidance takes for one token's mask, walking :data:`SCHEMA` with random
    allowed tokens, on a byte-level BPE of ``vocab`` tokens trained on the standard library."""
    import llguidance
    from llguidance.hf import from_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = (Path(f).read_text(encoding="utf-8", errors="ignore") for f in files)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    ll = from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    rng = random.Random(0)
    times: list[float] = []
    matcher = llguidance.LLMatcher(ll, grammar)
    for _ in range(steps):
        t = time.perf_counter()
        mask = matcher.compute_logit_bias()
        times.append(time.perf_counter() - t)
        allowed = [i for i, b in enumerate(mask) if b]
        matcher.consume_token(rng.choice(allowed))
        if matcher.is_stopped():
            matcher = llguidance.LLMatcher(ll, grammar)
    print(f"  (mask vocabulary: {ll.vocab_size} tokens)")
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", help="llava-tiny-model size to build (default bench)")
    parser.add_argument("--model-dir", default=None, help="an existing checkpoint instead")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mask-vocab", type=int, default=32000, help="0 skips the mask-alone measure")
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from llava_tools.tiny_model import write_checkpoint

        model_dir = str(write_checkpoint(args.model, tempfile.mkdtemp(prefix=f"llava-{args.model}-"), seed=0))
    svc = build_service({"model_dir": model_dir, "device": "cpu", "max_new_tokens_cap": 4096})
    n = args.new_tokens
    run(svc, [_body(q, 8, c) for q in QUESTIONS for c in (False, True)])  # warm-up
    one: dict[str, list[float]] = {"free": [], "constrained": []}
    eight: dict[str, list[float]] = {"8 free": [], "8 half constrained": []}
    for _ in range(args.rounds):
        for kind in one:
            one[kind].append(decode_rate(svc, _body(QUESTIONS[0], n, kind == "constrained")))
        for kind in eight:
            bodies = [_body(QUESTIONS[i % 4], n, kind != "8 free" and i % 2 == 1) for i in range(8)]
            wall, tokens = run(svc, bodies)
            eight[kind].append(tokens / wall)
    med = {k: statistics.median(v) for k, v in {**one, **eight}.items()}
    report = {k: [round(x, 1) for x in v] for k, v in {**one, **eight}.items()}
    print(json.dumps({"new_tokens": n, "rounds": args.rounds, "tokens_per_s": report}, indent=2))
    print(
        f"one answer, decode tokens/s: free {med['free']:.1f}, constrained {med['constrained']:.1f} "
        f"({med['constrained'] / med['free']:.2f}x; goal >= 0.8x)"
    )
    print(
        f"8 answers, aggregate tokens/s: all free {med['8 free']:.1f}, half constrained "
        f"{med['8 half constrained']:.1f} ({med['8 half constrained'] / med['8 free']:.2f}x)"
    )
    if args.mask_vocab:
        print(f"mask alone, median per token: {mask_cost_us(args.mask_vocab):.0f} us")


if __name__ == "__main__":
    main()
