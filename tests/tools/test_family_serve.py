"""The LLaVA family served end to end: llava-next behind a real TorchServe through ``llava_client``
and ``llava-chat`` (added images, recovery of a several-image session), llava-onevision through
``make demo MODEL_DIR=`` (``python -m llava_tools.demo --model-dir``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import requests

from llava_client import ImageLimitExceeded, SessionClient
from server_fixtures import start_local_server

pytestmark = pytest.mark.integration

GREEDY = {"max_new_tokens": 6}


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    from llava_tools.tiny_model import write_checkpoint

    return write_checkpoint("tiny", tmp_path_factory.mktemp("next"), seed=0, arch="llava-next")


@pytest.fixture(scope="module")
def server(request, next_dir):
    return start_local_server(next_dir, addfinalizer=request.addfinalizer, overrides={"max_images_per_session": 3})


def test_llava_next_sessions_add_images_and_recover_exactly(server, small_photos, tmp_path):
    a, b, c = (small_photos[n] for n in ("chelsea", "coffee", "rocket"))
    client = SessionClient.from_url(server.url, timeout=(5.0, 120.0))
    with client, client.open_session(a) as session, client.open_session(a) as twin:
        assert session.image_tokens > 576  # anyres: a base tile and more
        for s in (session, twin):
            s.ask("What is in this image?", **GREEDY)
            added = s.add_image(b)
            assert added.images == 2 and added.cached_tokens >= added.prefix_tokens - added.image_tokens - 32
            s.ask("Compare the two images.", **GREEDY)
            s.add_image(c)  # pending: added after the last turn
        assert session.num_images == 3
        with pytest.raises(ImageLimitExceeded):
            session.add_image(a)
        old = session.id
        closed = requests.post(
            server.url + "/invocations",
            data=json.dumps({"type": "close_session"}),
            headers={"X-Amzn-SageMaker-Session-Id": old},
            timeout=30,
        )
        assert closed.status_code == 200  # dropped behind the client's back
        answer = session.ask("And the third one?", **GREEDY)
        assert session.recoveries == 1 and session.id != old
        expected = twin.ask("And the third one?", **GREEDY)
        assert answer.text == expected.text and answer.usage.prompt_tokens == expected.usage.prompt_tokens

    path = tmp_path / "b.png"
    path.write_bytes(b)
    first = tmp_path / "a.png"
    first.write_bytes(a)
    done = subprocess.run(
        [sys.executable, "-m", "llava_client.cli", "--url", server.url, "--image", str(first), "--max-new-tokens", "4"],
        input=f"What is in this image?\n/add {path}\nCompare them.\n/add\n/quit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"\[image 2 added: \d+ image tokens\]", done.stderr) and "usage: /add" in done.stderr


def test_make_demo_runs_on_a_llava_onevision_checkpoint(tmp_path):
    from llava_tools.tiny_model import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "ov", seed=0, arch="llava-onevision")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "llava_tools.demo", "--model-dir", str(folder), "--max-new-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    tokens = re.search(r"(\d+) image tokens", done.stdout)
    assert tokens and int(tokens.group(1)) > 729  # anyres_max_9: the base tile and more
    assert "Q3 (independent" in done.stdout
