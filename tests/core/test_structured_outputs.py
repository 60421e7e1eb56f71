"""Structured outputs (issue 32 item 3): OpenAI's ``response_format`` and vLLM's ``structured_outputs``
constrain decoding with llguidance, per row inside the batched decode.

The service runs in process on the tiny model (real transformers, tokenizer and chat template; its
random weights make the free answer gibberish, so a valid reply is the grammar's doing); every reply
is validated with the ``openai`` package's own models. Then through ``llava-serve`` with the openai
package's ``parse`` and a pydantic model, as a user extracting fields from an image would.
"""

from __future__ import annotations

import base64
import itertools
import json
import re

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from llava_sessions.service import BatchRequest, SessionService
from llava_sessions.worker import build_service

_ids = itertools.count()

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["animal", "count", "colors"],
    "additionalProperties": False,
}
AS_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}}}


@pytest.fixture(scope="module")
def svc(tiny_model_dir) -> SessionService:
    """A service whose steps are not cut by time: while answers decode, a new prompt prefills whole
    in the step it is admitted (under CPU load the 150 ms default spread the four prompts of the
    batch test over more steps than the one-token choice answer lives, so no pass held all four)."""
    settings = {"max_step_ms_while_decoding": 60_000, "step_max_ms": 600_000}
    return build_service({"model_dir": str(tiny_model_dir), "device": "cpu", "device_budget_bytes": 10**9, **settings})


def _body(question: str = "Describe the cat.", max_tokens: int = 160, **params) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0, **params}


def run(svc: SessionService, *bodies: dict) -> list[tuple[int, bytes]]:
    """``bodies`` as sessionless requests admitted in one call (their answers decode as one batch),
    each driven to its last frame: ``(status, the frames' bytes joined)`` per body."""
    rids = [f"so{next(_ids)}" for _ in bodies]
    rows = [BatchRequest(rid, f"ts-seq-{rid}", True, body) for rid, body in zip(rids, bodies, strict=True)]
    out = {r.request_id: [o] for r, o in zip(rows, svc.handle(rows), strict=True)}
    while live := [rid for rid in rids if out[rid][-1].stop is False]:
        frames = svc.handle([BatchRequest(rid, f"ts-seq-{rid}", True, None) for rid in live])
        for rid, frame in zip(live, frames, strict=True):
            out[rid].append(frame)
    return [(out[rid][0].status, b"".join(f.body for f in out[rid])) for rid in rids]


def ask(svc: SessionService, *bodies: dict) -> list[ChatCompletion]:
    replies = run(svc, *bodies)
    assert all(status == 200 for status, _ in replies), replies
    return [ChatCompletion.model_validate_json(body) for _, body in replies]


def test_a_json_schema_answer_is_json_matching_the_schema(svc):
    free, fitted = ask(svc, _body(), _body(**AS_SCHEMA))
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # the random model alone writes no JSON
    data = json.loads(fitted.choices[0].message.content)
    assert fitted.choices[0].finish_reason == "stop"
    assert set(data) == {"animal", "count", "colors"} and len(data["animal"]) <= 12
    assert isinstance(data["count"], int) and 0 <= data["count"] <= 99
    assert set(data["colors"]) <= {"red", "green", "blue"} and len(data["colors"]) <= 3


def test_json_object_regex_and_choice(svc, llava):
    # the random model would write one endless key; a bias towards closing it lets the object end
    closing = {str(llava.tokenizer(c, add_special_tokens=False).input_ids[-1]): 30 for c in ('"', "}")}
    as_object, as_regex, as_choice, vllm_json = ask(
        svc,
        _body(response_format={"type": "json_object"}, logit_bias=closing),
        _body(structured_outputs={"regex": "[a-z]{3,8}-[0-9]{2}"}),
        _body(structured_outputs={"choice": ["cat", "dog", "a bird (small)"]}),
        _body(structured_outputs={"json": json.dumps(SCHEMA)}),
    )
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    assert re.fullmatch("[a-z]{3,8}-[0-9]{2}", as_regex.choices[0].message.content)
    assert as_choice.choices[0].message.content in ("cat", "dog", "a bird (small)")
    assert set(json.loads(vllm_json.choices[0].message.content)) == {"animal", "count", "colors"}
    assert all(r.choices[0].finish_reason == "stop" for r in (as_object, as_regex, as_choice, vllm_json))


def test_an_answer_cut_by_max_tokens_ends_with_length(svc):
    (cut,) = ask(svc, _body(max_tokens=4, **AS_SCHEMA))
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    text = cut.choices[0].message.content  # the schema's first key comes first: a prefix of it
    assert text and (text.startswith('{"animal":"') or '{"animal":"'.startswith(text))


def test_constrained_and_free_rows_in_one_batch_are_token_identical_to_each_alone(svc, monkeypatch):
    """Greedy, fp32: each answer alone, then all four admitted in one call (their decode steps
    batched, two rows constrained and two free: the decode batch's passes are watched, and one
    decodes all four rows)."""
    bodies = [
        _body("Describe the cat.", **AS_SCHEMA, logprobs=True),
        _body("What is on the table?", max_tokens=12, logprobs=True),
        _body("Is it a dog?", structured_outputs={"choice": ["yes", "no"]}, logprobs=True),
        _body("Tell me a story.", max_tokens=20, logprobs=True),
    ]
    alone = [ask(svc, body)[0] for body in bodies]
    batch, widths = svc.engine.batch, []
    for name in ("forward", "forward_with_chunk"):  # the real passes, watched: how many rows each decodes
        real = getattr(batch, name)
        monkeypatch.setattr(
            batch, name, lambda gens, *a, _real=real, **k: widths.append(len(gens)) or _real(gens, *a, **k)
        )
    together = ask(svc, *bodies)
    assert max(widths) == 4  # all four decoded as rows of one pass, constrained and free together

    def tokens(reply: ChatCompletion) -> list[str]:
        return [t.token for t in reply.choices[0].logprobs.content]

    assert [tokens(r) for r in together] == [tokens(r) for r in alone]
    assert [r.choices[0].message.content for r in together] == [r.choices[0].message.content for r in alone]


def test_a_streamed_constrained_answer_is_the_same_json(svc):
    (whole,) = ask(svc, _body(**AS_SCHEMA))
    ((status, events),) = run(svc, _body(**AS_SCHEMA, stream=True))
    assert status == 200
    chunks = [
        ChatCompletionChunk.model_validate_json(line.removeprefix(b"data: "))
        for line in events.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and json.loads(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
            "nonsense",
        ),
        ({"structured_outputs": {"regex": "["}}, "structured_outputs.regex", "unclosed"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "grammar is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json", "JSON schema"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "not both",
        ),
        ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ],
)
def test_a_structured_output_that_cannot_be_held_is_a_400_naming_its_field(svc, params, param, words):
    ((status, body),) = run(svc, _body(**params))
    error = json.loads(body)["error"]
    assert (status, error["code"], error["param"]) == (400, "invalid_parameter", param)
    assert words in error["message"]


@pytest.mark.integration
def test_the_openai_package_parses_an_image_s_fields_into_a_pydantic_model(request, tiny_model_dir, photos):
    """The package's ``chat.completions.parse`` sends a strict ``json_schema`` built from a pydantic
    model and parses the reply back into it: against ``llava-serve``, on an image."""
    import openai
    from pydantic import BaseModel, Field

    from server_fixtures import start_local_server

    class Photo(BaseModel):
        subject: str = Field(max_length=20)
        people: int = Field(ge=0, le=9)
        outdoors: bool

    server = start_local_server(
        tiny_model_dir, addfinalizer=request.addfinalizer, overrides={"served_model_name": ["llava"]}
    )
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    image = "data:image/png;base64," + base64.b64encode(photos["astronaut"]).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe the photo."}]
    completion = client.chat.completions.parse(
        model="llava",
        messages=[{"role": "user", "content": content}],
        response_format=Photo,
        temperature=0,
        max_tokens=200,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Photo) and completion.choices[0].finish_reason == "stop"
    assert 0 <= parsed.people <= 9 and len(parsed.subject) <= 20
