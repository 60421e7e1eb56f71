"""Shared fixtures: the ``tiny`` checkpoint (built once per run), the loaded model (``llava``), real photographs."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every TorchServe worker the suite starts would write its CPU memory reserve (2 GiB) at start: ~1 s
# each on the development VM, over a minute in all. The reserve is tested on its own
# (tests/core/test_loading.py) and through an in-process worker (tests/core/test_service.py).
os.environ.setdefault("LLAVA_CPU_MEMORY_RESERVE_BYTES", "0")


def encode_png(array) -> bytes:
    """PNG bytes of an ``skimage.data`` array."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A ``tiny`` random-weight llava-hf checkpoint folder built by ``llava-tiny-model``'s code, with a
    1,024-token context (the default is llava-1.5's 4,096) so a conversation reaches the context's edge
    (truncation, 422s) in a few turns."""
    from llava_tools.tiny_model import write_checkpoint

    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny-llava"), seed=0, max_positions=1024)


@pytest.fixture(scope="session")
def family(tmp_path_factory) -> dict:
    """A tiny checkpoint of each architecture (llava, llava-next, llava-onevision, llava-next-video),
    written by ``llava-tiny-model`` and loaded as ``LlavaModel`` in fp32 on the CPU."""
    import torch

    from llava_sessions.model import LlavaModel
    from llava_tools.tiny_model import write_checkpoint

    runners = {}
    for arch in ("llava", "llava-next", "llava-onevision", "llava-next-video"):
        # the default tiny llava has llava-1.5's own 4,096 positions (the shared fixture's 1,024), for 3 images
        folder = write_checkpoint("tiny", tmp_path_factory.mktemp(arch), seed=0, arch=arch)
        torch.manual_seed(0)
        runners[arch] = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32")
    return runners


@pytest.fixture(scope="session")
def llava(tiny_model_dir):
    """The tiny checkpoint loaded in fp32 on the CPU, or on ``LLAVA_TEST_DEVICE`` (``make test-gpu``
    runs the core tests that compare the engine with itself on the GPU this way)."""
    import torch

    from llava_sessions.model import LlavaModel

    device = model_device()
    torch.manual_seed(0)
    return LlavaModel.from_pretrained(tiny_model_dir, device=device, dtype="float32")


def model_device() -> str:
    """Where the tests' shared models load: ``LLAVA_TEST_DEVICE`` (``make test-gpu``: ``cuda``), else
    the CPU; skips the calling test when it names a CUDA device and there is none."""
    import torch

    device = os.environ.get("LLAVA_TEST_DEVICE") or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("LLAVA_TEST_DEVICE names a CUDA device, and there is none")
    return device


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Real photographs from scikit-image, PNG-encoded."""
    from skimage import data

    return {name: encode_png(getattr(data, name)()) for name in ("astronaut", "chelsea", "coffee", "rocket")}


def shrink_png(data: bytes, side: int) -> bytes:
    """The image ``data`` scaled to at most ``side`` pixels a side (aspect kept), as PNG."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    image.thumbnail((side, side))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def small_png():
    """:func:`shrink_png`, for tests that scale a photograph (anyres token counts stay small)."""
    return shrink_png


@pytest.fixture(scope="session")
def small_photos(photos) -> dict[str, bytes]:
    """The photographs scaled to at most 320 px (anyres token counts stay within the tiny context)."""
    return {name: shrink_png(data, 320) for name, data in photos.items()}


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test, as before after it. For a test that runs the model in
    this process for long: beside the suite's other process on two cores, two spinning intra-op
    threads made the tight-budget streams test take 88 s against 7 s alone, and one thread 10.6 s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
