"""Structured outputs: an answer constrained to a JSON schema, any JSON object, a regular expression or
one of a list of choices, with llguidance (github.com/guidance-ai/llguidance).

Why llguidance rather than xgrammar (both are what vLLM uses): its wheel has no dependencies (xgrammar's
pulls in triton and a torch requirement of its own), it builds its token automaton lazily, so a new
schema costs no compile step before the first token (benchmarks/results/structured-outputs.md), and it takes JSON schemas, regular expressions and Lark grammars alike.

Two halves:

- torch-free, used by the dialects when a request is read: :func:`json_grammar`, :func:`regex_grammar`,
  :func:`choice_grammar` build a grammar (llguidance's JSON text) and :func:`check_grammar` refuses a
  bad one with a 400 that says why;
- :class:`Grammars` (one per tokenizer, its llguidance tokenizer built on first use) makes the
  :class:`GrammarMatcher` a :class:`~llava_sessions.sampling.sampler.Sampler` masks one answer's logits
  with, row by row inside the batched decode.

JSON is written compact (``whitespace_flexible`` off, as vLLM's ``disable_any_whitespace``): a model
free to put whitespace anywhere can spend its whole answer on it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from ..errors import ErrorCode, ServiceError

if TYPE_CHECKING:
    import torch

__all__ = ["GrammarMatcher", "Grammars", "check_grammar", "choice_grammar", "json_grammar", "regex_grammar"]

#: Characters a Rust regex (llguidance's syntax) treats as syntax: escaped in a choice.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def json_grammar(schema: dict[str, Any] | None, param: str) -> str:
    """The grammar of JSON matching ``schema`` (a JSON Schema object), or of any JSON object (None).

    Raises:
        ServiceError: invalid_parameter naming ``param``: the schema is not one llguidance can hold.
    """
    if schema is None:
        schema = {"type": "object"}
    try:
        # compact JSON: see the module docstring
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except (ValueError, TypeError) as exc:
        raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{param}: {exc}", param=param) from None
    return check_grammar(grammar, param)


def regex_grammar(pattern: str, param: str) -> str:
    """The grammar of text matching ``pattern`` (Rust regex syntax, anchored at both ends).

    Raises:
        ServiceError: invalid_parameter naming ``param``: the pattern does not compile.
    """
    return check_grammar(llguidance.LLMatcher.grammar_from_regex(pattern), param)


def choice_grammar(choices: list[str], param: str) -> str:
    """The grammar of exactly one of ``choices`` (each taken literally).

    Raises:
        ServiceError: invalid_parameter naming ``param``: no choices.
    """
    if not choices:
        raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{param}: give at least one choice", param=param)
    escaped = ("".join("\\" + c if c in _REGEX_META else c for c in choice) for choice in choices)
    return regex_grammar("(" + "|".join(escaped) + ")", param)


def check_grammar(grammar: str, param: str) -> str:
    """``grammar`` when llguidance accepts it.

    Raises:
        ServiceError: invalid_parameter naming ``param``, with llguidance's reason.
    """
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        reason = " ".join(error.split())[:300]
        raise ServiceError(ErrorCode.INVALID_PARAMETER, f"{param}: {reason}", param=param)
    return grammar


class GrammarMatcher:
    """One answer's place in its grammar: which tokens may come next, and the tokens taken so far.

    Args:
        matcher: llguidance's matcher of the answer's grammar.
        vocab: the tokenizer's vocabulary size (a model's logits may be longer: padding rows, never
            allowed).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The tokens that may come next: ``[vocab]`` bool on ``device`` (padding ids beyond the
        tokenizer's vocabulary are not in it: index only ``[:vocab]``)."""
        import torch

        per_token = self._matcher.compute_logit_bias()  # one byte per token: 0 refused, 200 allowed
        return torch.frombuffer(bytearray(per_token), dtype=torch.uint8)[: self._vocab].bool().to(device)

    def consume(self, token: int) -> None:
        """Take ``token`` (one :meth:`allowed` gave).

        Raises:
            RuntimeError: llguidance refused it (a token outside the mask: a bug).
        """
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"structured output: the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token: the answer ends here (``stop``)."""
        return bool(self._matcher.is_stopped())


class Grammars:
    """Matchers for one tokenizer (its llguidance tokenizer built on the first use, then shared).

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        eos_token_ids: the model's end-of-sequence ids (the generation config's, which may differ
            from the tokenizer's own).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._ll: llguidance.LLTokenizer | None = None

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the start of ``grammar`` (one :func:`check_grammar` accepted).

        Raises:
            ServiceError: invalid_parameter: llguidance cannot start it on this tokenizer.
        """
        if self._ll is None:
            from llguidance.hf import from_tokenizer

            self._ll = from_tokenizer(self._tokenizer, eos_token=self._eos or None)
        matcher = llguidance.LLMatcher(self._ll, grammar, log_level=1)
        if matcher.is_error():
            message = f"structured output: {matcher.get_error()}"[:300]
            raise ServiceError(ErrorCode.INVALID_PARAMETER, message)
        return GrammarMatcher(matcher, self._ll.vocab_size)
