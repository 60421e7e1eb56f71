"""Image fetches in the public port's proxy (issue 31 item 1): a failed fetch gets its typed 4xx even
while other answers generate, and a resent conversation fetches its image once.

The relay itself against a real image host on 127.0.0.1 (no model), then the whole way: a real
``LocalServer`` (proxy, TorchServe, the handler, the tiny model), the openai package as a client.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests

from llava_sessions.config import Settings
from llava_sessions.wire.inbound import VideoSource
from llava_tools.serve.image_relay import ImageRelay
from server_fixtures import ImageHost, start_local_server

LOCAL = {"allow_http": True, "allow_private_networks": True, "fetch_total_timeout_s": 1.0}
#: Tokens of the story that keeps the worker busy while three slow fetches time out (1 s each). With 1,000
#: (the 1,024-position checkpoint's room) the chat request got no 400 in 1 of 7 full runs on a fast VM,
#: where 1,000 tokens at one a call take about as long as the three fetches; whether the story had ended,
#: the asserts on ``ended`` now say.
STORY_TOKENS = 3000


def _relay(**settings) -> ImageRelay:
    return ImageRelay(Settings.from_sources({**LOCAL, **settings}, {}))


def _chat(url: str, salt: str | None = None) -> bytes:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    return json.dumps(body).encode()


@pytest.fixture()
def host(photos):
    with ImageHost(photos["rocket"]) as image_host:
        yield image_host


def test_the_relay_fetches_what_a_body_names_and_answers_the_worker_by_ticket(host, photos):
    relay = _relay()
    url = host.url("/a.png")
    native = json.dumps({"type": "open_session", "image": {"url": url}}).encode()
    ticket = relay.prefetch(native, None)
    assert ticket is not None and host.hits == ["/a.png"]
    assert relay.answer(ticket, url) == (200, photos["rocket"])
    status, error = relay.answer(ticket, host.url("/other.png"))  # a source the proxy did not fetch
    assert status == 404 and error["error"]["code"] == "unknown_image_ticket"
    relay.release(ticket)
    assert relay.answer(ticket, url)[0] == 404
    assert relay.kept_bytes == len(photos["rocket"])


def test_the_relay_leaves_bodies_without_image_urls_to_the_worker_and_validates_nothing(host):
    relay = _relay()
    assert relay.prefetch(json.dumps({"type": "generate", "prompt": "https://example.com"}).encode(), None) is None
    data_uri = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert relay.prefetch(data_uri, None) is None
    assert relay.prefetch(b"not json " + host.url().encode(), None) is None and host.hits == []
    # the light pass reads where images are named and validates nothing else: a body the dialect will
    # refuse (an unknown field) costs the proxy at most its fetch, and the worker answers the 400
    refused = json.dumps({"type": "open_session", "image": {"url": host.url("/r.png")}, "nonsense": 1}).encode()
    assert relay.prefetch(refused, None) is not None and host.hits == ["/r.png"]


def test_the_light_pass_finds_each_dialects_image_sources_and_the_salt():
    """:func:`image_sources` reads a chat body's ``image_url`` and ``video_url`` parts (https and s3, not
    data URIs), a native open's image or video and its history's, an added image or video, the AWS
    sample's path, and the salt of the
    body or the custom attributes; it builds no grammar and checks no sampling field."""
    from llava_tools.serve.image_relay import image_sources

    def names(body: dict, attributes: str | None = None) -> tuple[str | None, list[str]]:
        salt, sources = image_sources(json.dumps(body).encode(), attributes, 10**6)
        return salt, sorted(sources)

    part = {"type": "image_url", "image_url": {"url": "https://h.example/a.png"}}
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [part, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
            },
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "s3://b-1/k.png"}}]},
        ],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
        "temperature": 99,
        "cache_salt": "t-1",
    }
    assert names(chat) == ("t-1", ["https://h.example/a.png", "s3://b-1/k.png"])
    opened = {
        "type": "open_session",
        "image": {"s3_uri": "s3://b-1/o.png"},
        "history": [{"prompt": "p", "answer": "a", "images": [{"url": "https://h.example/h.png"}]}],
    }
    assert names(opened, "cache_salt=t-2") == ("t-2", ["https://h.example/h.png", "s3://b-1/o.png"])
    assert names({"type": "add_image", "image": {"url": "https://h.example/n.png"}}) == (
        None,
        ["https://h.example/n.png"],
    )
    assert names({"type": "start_session", "path": "s3://b-1/p.png"}) == (None, ["s3://b-1/p.png"])
    assert names({"type": "open_session", "image": {"url": 5}}) == (None, [])  # not a source: the worker says so
    # videos: a chat video_url part, a native open's video and its history's videos, an added video;
    # each a VideoSource, fetched under the videos' byte cap
    video = {"type": "video_url", "video_url": {"url": "https://h.example/v.mp4"}, "num_frames": 4}
    salt, sources = image_sources(
        json.dumps({"messages": [{"role": "user", "content": [video]}]}).encode(), None, 10**6
    )
    assert list(sources) == ["https://h.example/v.mp4"] and isinstance(sources["https://h.example/v.mp4"], VideoSource)
    on_video = {
        "type": "open_session",
        "video": {"url": "https://h.example/o.mp4"},
        "history": [{"prompt": "p", "answer": "a", "videos": [{"s3_uri": "s3://b-1/h.mp4"}]}],
    }
    assert names(on_video) == (None, ["https://h.example/o.mp4", "s3://b-1/h.mp4"])
    assert names({"type": "add_video", "video": {"url": "https://h.example/a.mp4"}}) == (
        None,
        ["https://h.example/a.mp4"],
    )


def test_a_failed_fetch_is_answered_with_its_typed_error_and_not_kept(host):
    relay = _relay()
    for url, code in (
        (host.url("/gone.png", status=404), "image_fetch_failed"),
        (host.url(delay=3), "image_fetch_timeout"),
    ):
        ticket = relay.prefetch(_chat(url), None)
        assert ticket is not None  # the host's 3 s delay outlasts the 1 s deadline: the code says which fired
        status, error = relay.answer(ticket, url)
        assert (status, error["error"]["code"]) == (400, code)
        assert "127.0.0.1" in error["error"]["message"] and "status=" not in error["error"]["message"]
    assert relay.kept_bytes == 0


class _Clock:
    """A clock the test moves (the relay's TTL reads it, not the machine's time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_resent_conversation_fetches_once_per_salt_within_the_ttl(host):
    clock = _Clock()
    relay = ImageRelay(Settings.from_sources({**LOCAL, "image_memory_ttl_s": 0.5}, {}), clock=clock)
    url = host.url("/cat.png")
    for salt in (None, None, "tenant-a", "tenant-a"):
        relay.release(relay.prefetch(_chat(url, salt), None) or "")
    assert host.hits == ["/cat.png", "/cat.png"]  # once unsalted, once for tenant-a
    attributes = "cache_salt=tenant-b"  # SageMaker's CustomAttributes header gives a salt too
    relay.prefetch(_chat(url), attributes)
    relay.prefetch(_chat(url), attributes)
    assert len(host.hits) == 3
    clock.now += 0.25
    relay.prefetch(_chat(url), None)
    assert len(host.hits) == 3  # within the TTL: kept
    clock.now += 0.25  # exact in binary: 0.5 s after the fetch
    relay.prefetch(_chat(url), None)
    assert len(host.hits) == 4  # at the TTL: fetched again


def test_kept_images_stay_within_their_byte_budget(photos, host):
    size = len(photos["rocket"])
    relay = _relay(image_memory_bytes=2 * size)
    for name in ("a", "b", "c"):
        relay.prefetch(_chat(host.url(f"/{name}.png")), None)
    assert relay.kept_bytes == 2 * size
    relay.prefetch(_chat(host.url("/a.png")), None)  # the least recently used went first
    assert host.hits == ["/a.png", "/b.png", "/c.png", "/a.png"]
    assert _relay(image_memory_bytes=0).kept_bytes == 0


def test_requests_naming_one_image_at_once_share_one_fetch(host):
    relay = _relay()
    url = host.url(delay=0.4)
    tickets: list[str | None] = []
    threads = [threading.Thread(target=lambda: tickets.append(relay.prefetch(_chat(url), None))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(host.hits) == 1 and all(relay.answer(t or "", url)[0] == 200 for t in tickets)


def test_the_worker_takes_the_fronts_fetch_by_ticket_and_fetches_itself_without_one(host, photos):
    """The worker's side (``ImageFetcher``) against a real proxy: a ticketed source comes from the proxy (no second fetch from the host), its failure as the same typed error; a source the proxy
    does not know is fetched by the worker itself."""
    from concurrent import futures

    from llava_sessions.errors import ServiceError
    from llava_sessions.images.fetch import fetch_image_bytes
    from llava_sessions.wire.fetches import FetchPending, ImageFetcher
    from llava_sessions.wire.inbound import ImageSource
    from llava_tools.serve.front import OpenAIFront

    relay = _relay()
    front = OpenAIFront(("127.0.0.1", 0), ("127.0.0.1", 9), "m", images=relay).start()
    try:
        fetcher = ImageFetcher(fetch_image_bytes, 2, relay=f"http://127.0.0.1:{front.port}")
        good, bad = host.url("/good.png"), host.url("/bad.png", status=403)
        ticket = relay.prefetch(_chat(good), None) or ""
        bad_ticket = relay.prefetch(_chat(bad), None) or ""

        def fetch(url: str, ticket: str | None) -> bytes:
            fetches: dict = {}
            with pytest.raises(FetchPending) as pending, fetcher.admitting(fetches, ticket):
                fetcher(ImageSource(url=url), relay.settings)
            futures.wait([pending.value.future])
            with fetcher.admitting(fetches, ticket):
                return fetcher(ImageSource(url=url), relay.settings)

        assert fetch(good, ticket) == photos["rocket"] and host.hits == ["/good.png", "/bad.png"]
        with pytest.raises(ServiceError) as failed:
            fetch(bad, bad_ticket)
        assert failed.value.code.value == "image_fetch_failed" and host.hits == ["/good.png", "/bad.png"]
        assert fetch(good, "no-such-ticket") == photos["rocket"] and host.hits[-1] == "/good.png"
        assert len(host.hits) == 3  # the unknown ticket: fetched by the worker itself
    finally:
        front.stop()


# ---- the whole way: proxy, TorchServe, handler ---------------------------------------------------


@pytest.mark.integration
def test_a_late_fetch_failure_is_a_typed_4xx_while_other_answers_stream(tmp_path, photos, request):
    """A stream runs (so the worker is busy); a request whose image host is slower than the fetch
    deadline gets HTTP 400 ``image_fetch_timeout`` through the proxy, as the openai package raises
    it, while straight to TorchServe (no proxy: the worker fetches) its reply began before the
    failure: 200 with the error as its body (asked first, and the stream is checked to be still
    running when it is answered). The stream keeps flowing throughout (it sends chunks while each
    slow fetch is pending), and the image the proxy fetched reaches the worker without a second fetch."""
    import openai

    from llava_tools.tiny_model import write_checkpoint

    overrides = {**LOCAL, "step_max_tokens": 1, "image_fetch_wait_ms": 100, "max_new_tokens_cap": STORY_TOKENS}
    model_dir = write_checkpoint("tiny", tmp_path / "tiny-4096", seed=0)  # 4,096 positions: a story to outlast
    server = start_local_server(model_dir, addfinalizer=request.addfinalizer, overrides=overrides)
    host = ImageHost(photos["rocket"])
    request.addfinalizer(host.close)
    num_chunks = [0]
    chunks, stop, ended = threading.Event(), threading.Event(), threading.Event()

    def stream() -> None:
        # STORY_TOKENS, one per handle() call: several times the three slow fetches' 1 s deadlines; the
        # test closes it when done
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": STORY_TOKENS}
        body |= {"ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as reply:
                assert reply.status_code == 200, reply.text
                for _ in reply.iter_lines():
                    num_chunks[0] += 1
                    chunks.set()
                    if stop.is_set():
                        break
        finally:
            ended.set()

    def while_streaming(send):  # the reply, and the stream's chunks that arrived while it was pending
        before = num_chunks[0]
        reply = send()
        return reply, num_chunks[0] - before

    runner = threading.Thread(target=stream)
    runner.start()
    request.addfinalizer(stop.set)
    assert chunks.wait(30)
    slow = host.url("/slow.png", delay=3)
    native = {"type": "open_session", "image": {"url": slow}}
    # first, while the stream surely runs (else its first frame would wait for the fetch): no proxy
    direct, during = while_streaming(
        lambda: requests.post(server.torchserve_url + "/invocations", json=native, timeout=30)
    )
    assert not ended.is_set(), "the stream ended before the worker's own slow fetch was answered"
    assert direct.status_code == 200 and direct.json()["error"]["code"] == "image_fetch_timeout"
    assert during > 0, "the stream sent nothing while the worker's own fetch was pending"
    via_front, during = while_streaming(lambda: requests.post(server.url + "/invocations", json=native, timeout=30))
    assert not ended.is_set(), "the stream ended before the proxy's slow fetch was answered"
    assert via_front.status_code == 400 and via_front.json()["error"]["code"] == "image_fetch_timeout"
    assert during > 0, "the stream sent nothing while the proxy's fetch was pending"
    client = openai.OpenAI(base_url=server.openai_base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": slow}}]}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=2, stream=True)
    assert raised.value.code == "image_fetch_timeout"
    assert not ended.is_set(), "the stream ended before the chat request's slow fetch was answered"
    stop.set()
    runner.join(120)
    hits_before = len(host.hits)
    good = {"type": "open_session", "image": {"url": host.url("/ok.png")}}
    opened = requests.post(server.url + "/invocations", json=good, timeout=30)
    assert opened.status_code == 200 and opened.json()["session_id"]
    assert host.hits[hits_before:] == ["/ok.png"]  # fetched by the proxy only
