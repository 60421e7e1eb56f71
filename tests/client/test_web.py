"""The chat page (``llava-web``, ``make web``) in a real headless Chromium, over a real TorchServe.

The browser is Debian's ``chromium`` driven through ``chromium-driver`` by selenium (``.ci/run``
installs both). The page's messages to the user are checked as the user reads them: the text of
``#llava-status`` and of the chat bubbles.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from botocore.exceptions import NoCredentialsError

from llava_client import (
    APIConnectionError,
    ContextLengthExceeded,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    SessionBusy,
    SessionNotFound,
)
from llava_client.web import answer_stats, explain
from llava_tools.demo.samples import sample_clip
from server_fixtures import OutputLines, stop_process

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
IMAGE_TOKENS = 576  # the tiny model's image placeholders (336 px, patch 14)
#: The page as docs/serving.md shows it, with the controls it showed (a PNG text chunk of that name).
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "web-page.png"
SCREENSHOT_KEY = "llava-web-controls"


# ---------------------------------------------------------------------------------------- sentences
@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (Overloaded("no room", status_code=503, code="overloaded", retry_after=5), "busy"),
        (SessionBusy("busy", status_code=409, code="session_busy"), "still being generated"),
        (SessionNotFound("gone", status_code=404, code="session_not_found"), "upload the image again"),
        (InvalidRequest("not a recognised image file", status_code=400, code="image_invalid"), "cannot use this file"),
        (PayloadTooLarge("over 40000000 pixels", status_code=413, code="image_too_large"), "too large"),
        (InvalidRequest("the model has no video path", status_code=400, code="video_unsupported"), "this video"),
        (PayloadTooLarge("frames over 1920x1088", status_code=413, code="video_too_large"), "this video"),
        (ContextLengthExceeded("too long", status_code=422, code="context_length_exceeded"), "context"),
        (APIConnectionError("refused"), "cannot reach the server"),
        (RuntimeError("boom\nTraceback (most recent call last):"), "unexpected error"),
        (NoCredentialsError(), "set AWS credentials: AWS_ACCESS_KEY_ID"),  # an endpoint without credentials
    ],
)
def test_errors_become_one_sentence_without_a_trace(error, expected):
    sentence = explain(error, doing="answering")
    assert sentence.startswith("Answering failed: ") and expected in sentence
    assert "\n" not in sentence and "Traceback" not in sentence
    if isinstance(error, Overloaded):
        assert "5 s" in sentence  # the server's Retry-After is passed on


def test_the_page_for_an_endpoint_without_a_region_says_so_in_one_line(tmp_path):
    """``llava-web --endpoint NAME`` where boto3 has no region: one line naming what to set, exit 2, no
    traceback (as llava-chat says it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE")}
    env |= {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    web = Path(sys.executable).parent / "llava-web"
    done = subprocess.run(
        [str(web), "--endpoint", "llava-chat", "--port", "0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "llava-web: You must specify a region. (pass --region, or set AWS_DEFAULT_REGION)"


def test_answer_stats_line_names_ttft_reused_tokens_and_finish_reason():
    from llava_client import Answer, Usage

    answer = Answer("hi", "length", Usage(700, 600, 8), {"ttft_ms": 12.4}, client_ttft_ms=30.0)
    line = answer_stats(answer)
    assert "TTFT 12 ms" in line and "reused 600 of 700 prompt tokens" in line and "finish_reason: length" in line


# ---------------------------------------------------------------------------------------- browser
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(name: str) -> list[str]:
    found = Path(sys.executable).parent / name
    return [str(found)] if found.exists() else [shutil.which(name) or name]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's package) through its chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    assert not missing, f"install Debian's chromium and chromium-driver (.ci/run does): missing {missing}"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The chat page as a user sees it in the browser."""

    def __init__(self, driver, url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.d = driver
        self.wait = lambda timeout=60: WebDriverWait(driver, timeout, poll_frequency=0.1)
        driver.get(url)
        # the page is built component by component: wait for the last one a test reaches for too
        self.wait().until(
            lambda d: self._all("#llava-image input[type=file]") and self._all("#llava-question textarea")
        )

    def _all(self, css: str):
        from selenium.webdriver.common.by import By

        return self.d.find_elements(By.CSS_SELECTOR, css)

    def status(self) -> str:
        found = self._all("#llava-status")
        return found[0].text if found else ""

    def wait_status(self, predicate, timeout: float = 60) -> str:
        self.wait(timeout).until(lambda d: predicate(self.status()))
        return self.status()

    def upload(self, path: Path) -> str:
        self._all("#llava-image input[type=file]")[0].send_keys(str(path))
        return self.wait_status(lambda s: ("opened" in s or "failed:" in s) and not _pending(s), 90)

    def add_image(self, path: Path) -> str:
        self._all("#llava-add-image input[type=file]")[0].send_keys(str(path))
        return self.wait_status(lambda s: ("added" in s or "failed:" in s) and not _pending(s), 90)

    def ask(self, question: str, timeout: float = 90) -> str:
        box = self._all("#llava-question textarea")[0]
        box.clear()
        box.send_keys(question)
        before = self.status()
        self.d.execute_script(  # record every text the status line shows from now on
            "window.__statusTexts = [];"
            "const line = document.getElementById('llava-status');"
            "new MutationObserver(() => { window.__statusTexts.push(line.innerText); })"
            ".observe(line, {subtree: true, childList: true, characterData: true});"
        )
        self._all("#llava-send")[0].click()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            # the question's own event has shown on the line ("Answering…", Gradio's overlay, or its
            # outcome): a late re-render of the previous status, text unchanged, is not an answer, nor
            # is the line back at the previous status once the overlay left (a full run once returned
            # a second tab's "opened ..." line here; an answer carries its own timings, so it differs;
            # a warning may repeat itself)
            moved = any(text != before for text in self.d.execute_script("return window.__statusTexts"))
            outcome = status != before or "⚠" in status
            if moved and outcome and "Answering…" not in status and not _pending(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"no answer to {question!r} in {timeout} s; the status line reads {self.status()!r}")

    def controls(self) -> list[str]:
        """The page's own elements (``llava-*`` ids), each button with its label, sorted."""
        found = self.d.execute_script(
            "return Array.from(document.querySelectorAll('[id^=llava-]'))"
            ".map(e => e.tagName === 'BUTTON' ? e.id + ': ' + e.innerText.trim() : e.id)"
        )
        return sorted(set(found))

    def click(self, elem_id: str) -> None:
        self._all(f"#{elem_id}")[0].click()

    def bubbles(self) -> list[str]:
        return [b.text for b in self._all("#llava-chat .bot")]

    def record_bot_text_lengths(self) -> None:
        """Record the last answer bubble's text length at every change of the chat (a DOM observer)."""
        self.d.execute_script(
            "window.__lengths = [];"
            "const chat = document.getElementById('llava-chat');"
            "new MutationObserver(() => { const b = chat.querySelectorAll('.bot');"
            "  if (b.length) window.__lengths.push(b[b.length - 1].innerText.length); })"
            ".observe(chat, {subtree: true, childList: true, characterData: true});"
        )

    def recorded_lengths(self) -> list[int]:
        return list(self.d.execute_script("return window.__lengths"))


def _pending(status: str) -> bool:
    """Gradio's progress overlay is on the status line ("processing | 0.3s", "0.0s"), or its queue
    overlay ("queue: 1/1 | 0.0/1.0s", the event waits behind another): the event has not ended."""
    return (
        "processing" in status
        or "queue:" in status
        or any(re.fullmatch(r"[\d.]+s(\s*/\s*[\d.]+s)?", line.strip()) for line in status.splitlines())
    )


def _session_id(status: str) -> str:
    match = re.search(r"session\s+`?([\w.:-]+)`?\s+(?:opened|keeps)|as session\s+`?([\w.:-]+)`?\s*\.", status, re.I)
    assert match, status
    return match.group(1) or match.group(2)


def _session_id_of_added(status: str) -> str:
    match = re.search(r"added to session\s+`?([\w.:-]+)`?", status)
    assert match, status
    return match.group(1)


def _session_closed(server_url: str, session_id: str, timeout_s: float = 45) -> bool:
    """Whether the session is gone (a reset gets 404), polling until ``timeout_s``.

    A probe that reaches TorchServe while the page's own close of that session is in flight joins
    the session's job group just as the close ends it, and TorchServe 0.12 never answers it (the
    job is dropped with the group); the probe then times out and the next one gets its answer.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = requests.post(
                f"{server_url}/invocations", json={"type": "reset"}, headers={SESSION_HEADER: session_id}, timeout=10
            )
        except requests.Timeout:
            continue
        if r.status_code == 404:
            return True
        time.sleep(0.5)
    return False


def _start(command: list[str], env: dict, pattern: re.Pattern, timeout_s: float):
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=False
    )
    output = OutputLines(proc.stdout, proc)
    try:
        return proc, output, output.wait_for(pattern, timeout_s)
    except BaseException:
        stop_process(proc)
        raise


def _worker_pids(psutil, root_pid: int) -> list[int]:
    found = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "model_service_worker" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def _check_the_docs_screenshot(taken: Path, controls: list[str]) -> None:
    """docs/web-page.png shows the page llava-web serves: the controls recorded in it are the page's
    now. ``make screenshot`` (``WRITE_DOCS_SCREENSHOT=1``) replaces it with ``taken`` first."""
    import json

    from PIL import Image, PngImagePlugin

    shown = json.dumps(controls)
    if os.environ.get("WRITE_DOCS_SCREENSHOT") == "1":
        info = PngImagePlugin.PngInfo()
        info.add_text(SCREENSHOT_KEY, shown)
        Image.open(taken).save(SCREENSHOT, pnginfo=info, optimize=True)
    recorded = Image.open(SCREENSHOT).text.get(SCREENSHOT_KEY)  # type: ignore[attr-defined]
    assert recorded == shown, (
        f"docs/web-page.png shows another page than llava-web serves now ({recorded} against {shown}): "
        "`make screenshot` takes it again"
    )


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_make_web_page_chats_streams_reuses_the_kv_cache_and_cleans_up(browser, tmp_path, photos):
    """``make web``'s program and ``llava-web --url``, as subprocesses, used through a real browser."""
    psutil = pytest.importorskip("psutil")
    from PIL import Image

    env = {**os.environ, "TMPDIR": str(tmp_path), "GRADIO_TEMP_DIR": str(tmp_path / "gradio")}
    photo = tmp_path / "astronaut.png"
    photo.write_bytes(photos["astronaut"])
    huge = tmp_path / "huge.png"  # 48 Mpx of one colour: a small file the server refuses (40 Mpx cap)
    buf = io.BytesIO()
    Image.new("RGB", (8000, 6000), (40, 90, 160)).save(buf, "PNG")
    huge.write_bytes(buf.getvalue())

    port = _free_port()
    demo, demo_out, ready = _start(
        [sys.executable, "-m", "llava_tools.demo.web", "--port", str(port)],
        env,
        re.compile(r"webdemo: chat page at (http://\S+) \(server (http://\S+)\)"),
        300,
    )
    try:
        page_url, server_url = ready.group(1), ready.group(2)
        page = Page(browser, page_url)

        # a question before any image is explained, not sent
        box_status = page.ask("What is this?", timeout=20)
        assert "image first" in box_status, box_status

        status = page.upload(photo)
        assert "opened" in status and f"takes {IMAGE_TOKENS} tokens" in status, status
        first_id = _session_id(status)

        # the answer streams into the page: the bubble grows through several lengths
        page.record_bot_text_lengths()
        status = page.ask("Describe everything in this image, please.")
        assert "finish_reason" in status, status
        lengths = [n for n in page.recorded_lengths() if n > 0]
        final = len(page.bubbles()[-1])
        partial = sorted({n for n in lengths if n < final - len("TTFT")})
        assert len(partial) >= 3, f"the answer did not stream: lengths seen {lengths}, final {final}"
        assert "TTFT" in page.bubbles()[-1] and "reused" in page.bubbles()[-1]

        # a follow-up reuses the image prefix and the history from the session's KV cache
        status = page.ask("And what is in the background?")
        reused = int(re.search(r"reused (\d+) of (\d+) prompt tokens", status).group(1))
        assert reused > IMAGE_TOKENS, status
        assert len(page.bubbles()) == 2

        # a second image joins the session: the conversation before it stays cached
        status = page.add_image(photo)
        assert "Image 2 added" in status and _session_id_of_added(status) == first_id, status
        status = page.ask("How do the two images differ?")
        assert int(re.search(r"reused (\d+) of", status).group(1)) > IMAGE_TOKENS, status
        browser.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 10_000
        _check_the_docs_screenshot(tmp_path / "page.png", page.controls())

        # a video dropped on this image-only model is refused: the session and the chat stay as they were
        clip = tmp_path / "clip.mp4"
        clip.write_bytes(sample_clip("coffee"))
        bubbles = page.bubbles()
        page._all("#llava-video input[type=file]")[0].send_keys(str(clip))
        status = page.wait_status(lambda s: "failed:" in s and not _pending(s), 120)
        assert "Opening the video failed" in status, status
        assert re.search(rf"Session\s+`?{re.escape(first_id)}`?\s+and its conversation are kept", status), status
        assert page.bubbles() == bubbles and len(bubbles) == 3

        page.click("llava-reset")
        status = page.wait_status(lambda s: "reset" in s)
        assert _session_id(status) == first_id and page.bubbles() == []

        # an image the server refuses is explained in a sentence
        page.click("llava-new-image")
        page.wait_status(lambda s: "Upload or paste an image" in s)
        assert _session_closed(server_url, first_id)  # "New image" closed the old session
        status = page.upload(huge)
        assert "too large" in status and "Traceback" not in status, status

        # a text file named as an image (the upload accepts it): a sentence on the page, and no trace
        # in the page's console (Gradio's own decoding of the upload showed a bare "Error")
        notes = tmp_path / "notes.png"
        notes.write_text("a text file, not an image\n")
        said = len(demo_out.drain())
        page.click("llava-new-image")
        page.wait_status(lambda s: "Upload or paste an image" in s)
        status = page.upload(notes)
        assert "Opening the image failed:" in status, status
        assert "Traceback" not in demo_out.drain()[said:]

        # the worker dies: the next question says the session was restored, and answers
        page.click("llava-new-image")
        page.wait_status(lambda s: "Upload or paste an image" in s)
        status = page.upload(photo)
        assert "opened" in status, status
        page.ask("What colour is the suit?")
        workers = _worker_pids(psutil, demo.pid)
        assert workers, "no TorchServe worker found"
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # while TorchServe restarts, the page says it cannot reach the server
            status = page.ask("What colour is the suit?")
            if "finish_reason" in status or time.monotonic() > deadline:
                break
            assert "⚠" in status and "Traceback" not in status, status
            time.sleep(2)
        assert "reopened" in status, status
        restored_id = _session_id(status)

        # llava-web --url against the same server, in a second browser tab: its own session
        first_tab = browser.current_window_handle
        port2 = _free_port()
        web, web_out, _ = _start(
            [*_script("llava-web"), "--url", server_url, "--port", str(port2)],
            env,
            re.compile(r"llava-web: chat page at http://127\.0\.0\.1:\d+"),
            120,
        )
        try:
            browser.switch_to.new_window("tab")
            other = Page(browser, f"http://127.0.0.1:{port2}")
            other_id = _session_id(other.upload(photo))
            assert other_id != restored_id
            assert "finish_reason" in other.ask("What is in this image?")
            browser.switch_to.window(first_tab)  # the first tab's session is still there
            status = page.ask("Is it daytime?")
            assert int(re.search(r"reused (\d+) of", status).group(1)) > IMAGE_TOKENS, status
            web.send_signal(signal.SIGINT)  # stopping the page closes its tabs' sessions
            assert web.wait(timeout=60) == 0
            web_out.wait_for(re.compile(r"llava-web: stopped"), 10)
        finally:
            stop_process(web)
        assert _session_closed(server_url, other_id)

        # leaving the page closes its session
        browser.get("about:blank")
        assert _session_closed(server_url, restored_id), "leaving the page did not close its session"

        torchserve_pids = [p.pid for p in psutil.Process(demo.pid).children(recursive=True)]
        assert torchserve_pids
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=120) == 0
        demo_out.wait_for(re.compile(r"webdemo: stopped"), 10)
        assert not [pid for pid in torchserve_pids if psutil.pid_exists(pid) and _running(psutil, pid)]
    finally:
        stop_process(demo)


def _running(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_llava_web_says_when_its_server_is_unreachable_and_when_its_port_is_taken(tmp_path):
    """Issue 60 item 6: ``llava-web --url`` with nothing answering there warns at once (the page still
    starts: the server may come later), and a taken ``--port`` is one line naming ``--port`` (Gradio's
    own message points to its environment variables)."""
    dead = _free_port()
    env = dict(os.environ) | {"TMPDIR": str(tmp_path), "GRADIO_ANALYTICS_ENABLED": "False"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run(
            [*_script("llava-web"), "--url", f"http://127.0.0.1:{dead}", "--port", str(taken.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert busy.returncode == 1 and "choose another with --port" in busy.stderr and "GRADIO" not in busy.stderr
    assert f"warning: nothing answers at http://127.0.0.1:{dead}" in busy.stderr and "Traceback" not in busy.stderr
