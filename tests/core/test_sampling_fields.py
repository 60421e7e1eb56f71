"""vLLM's and OpenAI's sampling fields in the chat dialect, each tested for its effect, not only accepted
(issue 32 item 2): ``logit_bias``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``min_p``,
``include_stop_str_in_output``. The service runs in process on the tiny model (real transformers,
tokenizer and chat template); every reply is validated with the ``openai`` package's own model.
"""

from __future__ import annotations

import itertools
import json

import pytest
from openai.types.chat import ChatCompletion

from llava_sessions.service import BatchRequest, SessionService
from llava_sessions.worker import build_service

_ids = itertools.count()


@pytest.fixture(scope="module")
def svc(tiny_model_dir) -> SessionService:
    return build_service({"model_dir": str(tiny_model_dir), "device": "cpu", "device_budget_bytes": 10**9})


def ask(svc: SessionService, max_tokens: int = 10, **params) -> ChatCompletion:
    """One greedy chat turn without a session, driven to its last frame."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **params,
    }
    rid = f"s{next(_ids)}"
    out = svc.handle([BatchRequest(rid, f"ts-seq-{rid}", True, body)])[0]
    while out.stop is False:
        out = svc.handle([BatchRequest(rid, f"ts-seq-{rid}", True, None)])[0]
    assert out.status == 200, out.body
    return ChatCompletion.model_validate_json(out.body)


def ids_of(llava, text: str) -> list[int]:
    return llava.tokenizer(text, add_special_tokens=False).input_ids


def test_logit_bias_forces_and_bans_tokens(svc, llava):
    base = ask(svc)
    first = ids_of(llava, base.choices[0].message.content)[0]
    banned = ask(svc, logit_bias={str(first): -100})
    assert first not in ids_of(llava, banned.choices[0].message.content)[:1]
    forced_id = ids_of(llava, " cat")[-1]
    forced = ask(svc, max_tokens=4, logit_bias={str(forced_id): 100})
    assert ids_of(llava, forced.choices[0].message.content) == [forced_id] * 4
    assert forced.choices[0].finish_reason == "length"


def test_end_of_sequence_with_min_tokens_and_ignore_eos(svc, llava):
    eos = next(iter(llava.eos_token_ids))
    ends = ask(svc, logit_bias={str(eos): 100})
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == 1
    later = ask(svc, logit_bias={str(eos): 100}, min_tokens=3)
    assert later.choices[0].finish_reason == "stop" and later.usage.completion_tokens == 4  # 3, then EOS
    never = ask(svc, max_tokens=6, logit_bias={str(eos): 100}, ignore_eos=True)
    assert never.choices[0].finish_reason == "length" and never.usage.completion_tokens == 6


def test_stop_token_ids_end_the_answer_there(svc, llava):
    base = ask(svc)
    third = ids_of(llava, base.choices[0].message.content)[2]
    stopped = ask(svc, stop_token_ids=[third])
    assert stopped.choices[0].finish_reason == "stop"
    assert ids_of(llava, stopped.choices[0].message.content)[-1] == third
    assert len(ids_of(llava, stopped.choices[0].message.content)) <= 3


def test_min_p_of_one_keeps_only_the_most_likely_token(svc):
    greedy = ask(svc).choices[0].message.content
    for seed in (1, 2):  # sampled at temperature 1, yet only the argmax survives min_p = 1
        sampled = ask(svc, temperature=1.0, seed=seed, min_p=1.0)
        assert sampled.choices[0].message.content == greedy
    assert ask(svc, temperature=1.0, seed=1).choices[0].message.content != greedy  # sampling does differ


def test_include_stop_str_in_output_keeps_the_stop_sequence(svc):
    text = ask(svc, max_tokens=12).choices[0].message.content
    stop = text[3:5]
    assert stop.strip() and stop not in text[:3]
    left_out = ask(svc, max_tokens=12, stop=[stop]).choices[0].message.content
    kept = ask(svc, max_tokens=12, stop=[stop], include_stop_str_in_output=True).choices[0].message.content
    assert kept == left_out + stop and text.startswith(kept)


def test_the_fields_are_refused_out_of_range_and_logit_bias_names_token_ids(svc):
    cases = [({"min_p": 2}, "min_p"), ({"min_tokens": -1}, "min_tokens"), ({"logit_bias": {"cat": 5}}, "logit_bias")]
    for params, param in cases:
        body = {"messages": [{"role": "user", "content": "hi"}], **params}
        out = svc.handle([BatchRequest("bad", "ts-seq-bad", True, body)])[0]
        error = json.loads(out.body)["error"]
        assert out.status == 400 and error["param"] == param, (params, error)


def test_skip_special_tokens_false_writes_them_but_an_ending_eos_writes_nothing(svc, llava):
    eos = next(iter(llava.eos_token_ids))
    eos_text = llava.tokenizer.convert_ids_to_tokens(eos)
    kept = ask(svc, max_tokens=3, logit_bias={str(eos): 100}, ignore_eos=True, skip_special_tokens=False)
    assert kept.choices[0].message.content == eos_text * 3 and kept.choices[0].finish_reason == "length"
    skipped = ask(svc, max_tokens=3, logit_bias={str(eos): 100}, ignore_eos=True)
    assert skipped.choices[0].message.content == "" and skipped.usage.completion_tokens == 3
    # as vLLM: the EOS that ends an answer is not exposed, whatever skip_special_tokens says
    ended = ask(svc, logit_bias={str(eos): 100}, skip_special_tokens=False)
    assert ended.choices[0].message.content == "" and ended.choices[0].finish_reason == "stop"


def test_spaces_between_special_tokens_either_way_writes_what_vllm_s_fast_detokenizer_writes(svc, llava):
    """vLLM decodes a fast tokenizer's tokens (llava-hf's are fast ones) with the tokenizers library's
    own decoder, which takes no such option: either value, the same text, the tokenizer's decode."""
    eos = next(iter(llava.eos_token_ids))
    forced = {str(eos): 100}
    texts = {
        spaces: ask(
            svc,
            max_tokens=3,
            logit_bias=forced,
            ignore_eos=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=spaces,
        )
        .choices[0]
        .message.content
        for spaces in (True, False)
    }
    assert texts[True] == texts[False] == llava.tokenizer.decode([eos] * 3, skip_special_tokens=False)


# ---- max_tokens: up to the context, none = until the context ends (issue 32 item 2) ---------------


@pytest.fixture(scope="module")
def capped(tiny_model_dir) -> SessionService:
    """A worker whose native cap is 32 new tokens (the chat dialect's answers are bounded by the context)."""
    settings = {"model_dir": str(tiny_model_dir), "device": "cpu", "device_budget_bytes": 10**9}
    return build_service({**settings, "max_new_tokens_cap": 32, "default_max_new_tokens": 16})


def test_max_tokens_goes_past_the_native_cap_up_to_what_the_context_leaves(capped, llava):
    long = ask(capped, max_tokens=48, ignore_eos=True)
    assert long.usage.completion_tokens == 48 and long.choices[0].finish_reason == "length"
    context = llava.max_positions
    body = {"messages": [{"role": "user", "content": "Tell me a story about a cat."}], "max_tokens": context}
    out = capped.handle([BatchRequest("too-long", "ts-seq-too-long", True, body)])[0]
    error = json.loads(out.body)["error"]
    assert (out.status, error["code"]) == (400, "context_length_exceeded") and str(context) in error["message"]
    native = {"type": "generate", "prompt": "hi", "parameters": {"max_new_tokens": 48}}
    refused = capped.handle([BatchRequest("native", "ts-seq-native", True, native)])[0]
    assert refused.status == 400 and "max_new_tokens" in json.loads(refused.body)["error"]["message"]


def test_no_max_tokens_runs_until_the_context_ends(capped, llava):
    """As vLLM and OpenAI: no limit but the context (the server's default is a native request's)."""
    body = {"messages": [{"role": "user", "content": "Tell me a story about a cat."}], "temperature": 0}
    rid = "no-limit"
    out = capped.handle([BatchRequest(rid, f"ts-seq-{rid}", True, {**body, "ignore_eos": True})])[0]
    while out.stop is False:
        out = capped.handle([BatchRequest(rid, f"ts-seq-{rid}", True, None)])[0]
    reply = ChatCompletion.model_validate_json(out.body)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == llava.max_positions


# ---- OpenAI's penalties, top_k, repetition_penalty, seed, max_completion_tokens through the chat dialect


def test_presence_and_frequency_penalties_follow_openai_s_formula():
    """On fixed logits: a token's logit is lowered by count x frequency_penalty + (count > 0) x
    presence_penalty, count being how often this answer generated it (OpenAI's API reference)."""
    import torch

    from llava_sessions.sampling.params import SamplingParams
    from llava_sessions.sampling.sampler import Sampler

    logits = torch.tensor([3.0, 2.0, 0.5, 0.0])  # token 0 leads token 1 by 1.0

    def greedy(**penalties) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=0, **penalties), torch.device("cpu"), [1, 2])
        return [sampler.next_token(logits.clone())[0] for _ in range(5)]

    assert greedy() == [0, 0, 0, 0, 0]
    assert greedy(presence_penalty=1.5) == [0, 1, 0, 0, 0]  # each loses 1.5 once, whatever its count
    assert greedy(frequency_penalty=0.6) == [0, 0, 1, 0, 1]  # 3 - 0.6k against 2 - 0.6j
    assert greedy(presence_penalty=-2.0) == [0, 0, 0, 0, 0]  # negative: repetition encouraged


def test_the_penalties_top_k_and_repetition_penalty_reach_the_chat_answer(svc):
    base = ask(svc, max_tokens=24, logprobs=True)

    def tokens(reply: ChatCompletion) -> list[str]:
        return [t.token for t in reply.choices[0].logprobs.content]

    def most_repeated(reply: ChatCompletion) -> int:
        seen = tokens(reply)
        return max(seen.count(t) for t in seen)

    assert most_repeated(base) > 1  # the random model repeats itself: something for a penalty to remove
    for field in ("frequency_penalty", "presence_penalty"):
        penalized = ask(svc, max_tokens=24, logprobs=True, **{field: 2.0})
        assert tokens(penalized) != tokens(base) and most_repeated(penalized) < most_repeated(base), field
    # CTRL's penalty (divides a seen token's positive logit, multiplies a negative one) at 100
    unrepeated = ask(svc, max_tokens=24, logprobs=True, repetition_penalty=100.0)
    assert tokens(unrepeated) != tokens(base) and most_repeated(unrepeated) < most_repeated(base)
    greedy = base.choices[0].message.content
    for seed in (1, 2):  # sampled at temperature 1, yet top_k = 1 keeps only the argmax
        assert ask(svc, max_tokens=24, temperature=1.0, seed=seed, top_k=1).choices[0].message.content == greedy


def test_a_seed_repeats_a_sampled_answer_and_max_completion_tokens_bounds_it(svc):
    first, again, other = (ask(svc, max_tokens=16, temperature=1.0, seed=s) for s in (7, 7, 8))
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content
    bounded = ask(svc, max_tokens=16, max_completion_tokens=5, ignore_eos=True)  # the newer name wins
    assert bounded.usage.completion_tokens == 5 and bounded.choices[0].finish_reason == "length"
