"""llava-1.5's preprocessing on the model's device (``model/gpu/pixels.py``, the ``image_preprocessing`` setting):
its pixel values against transformers' CLIP image processor (Pillow) on real photographs, the families
it leaves to the processor, and the setting through the worker's service. On the CPU here; the GPU suite
runs the comparison on a GPU (``tests/gpu/test_on_gpu.py``)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from llava_sessions.model import LlavaModel
from llava_sessions.model.gpu.pixels import MAX_LEVEL_DIFFERENCE, DevicePixels, resized_size
from llava_sessions.service import BatchRequest
from llava_sessions.worker import build_service
from llava_tools.tiny_model import write_checkpoint

#: Largest |feature difference| between the two paths, relative to the largest |feature| (the tiny model
#: in fp32): a one-level difference in a few pixel values, carried through the vision tower and projector
#: (6.4e-4 measured here on the coffee photograph).
FEATURE_TOLERANCE = 0.01

#: scikit-image photographs of several shapes: square, portrait, landscape, larger than 336 and not.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "hubble_deep_field")


def photo(name: str) -> Image.Image:
    from skimage import data

    return Image.fromarray(getattr(data, name)()).convert("RGB")


def level_differences(llava: LlavaModel, image: Image.Image, device: str = "cpu") -> torch.Tensor:
    """|device pixels - processor pixels| of ``image``, in 8-bit levels (before rescaling)."""
    processor = llava.processor.image_processor
    pixels = DevicePixels.for_processor(processor, torch.device(device), torch.float32)
    assert pixels is not None
    want = processor(images=[image], return_tensors="pt")["pixel_values"]
    got = pixels([image]).cpu()
    assert got.shape == want.shape == (1, 3, 336, 336)
    std = torch.tensor(processor.image_std)[None, :, None, None]
    return (got - want).abs() * std / processor.rescale_factor


def test_the_shortest_edge_and_the_long_side_truncated_as_transformers_sizes_them():
    assert resized_size(512, 512, 336) == (336, 336)
    assert resized_size(600, 400, 336) == (504, 336)  # portrait: the width is the shortest edge
    assert resized_size(427, 640, 336) == (336, 503)  # 336 * 640 / 427 = 503.6, truncated
    assert resized_size(100, 150, 336) == (336, 504)  # smaller than the crop: enlarged


@pytest.mark.parametrize("name", PHOTOS)
def test_device_pixels_are_the_processors_within_one_level(llava, name):
    """Each photograph: every value within :data:`MAX_LEVEL_DIFFERENCE` (one 8-bit level) of the
    processor's, and at most 0.5% of them apart at all (Pillow's fixed-point filter weights)."""
    diff = level_differences(llava, photo(name))
    assert diff.max().item() <= MAX_LEVEL_DIFFERENCE + 1e-3
    assert (diff > 0.5).float().mean().item() < 0.005


def test_a_small_grey_image_and_an_array_take_the_same_steps(llava):
    """An image smaller than the crop (enlarged), a greyscale one (converted to RGB) and the same image
    given as an ``[H, W, 3]`` uint8 array; a wrong array is a ValueError (the engine's ``image_invalid``)."""
    grey = photo("camera").convert("L").resize((90, 130))
    assert level_differences(llava, grey).max().item() <= MAX_LEVEL_DIFFERENCE + 1e-3
    pixels = DevicePixels.for_processor(llava.processor.image_processor, torch.device("cpu"), torch.float32)
    assert pixels is not None
    rgb = photo("chelsea")
    assert torch.equal(pixels([rgb]), pixels([np.asarray(rgb)]))
    with pytest.raises(ValueError, match="uint8"):
        pixels([np.zeros((4, 4, 3), dtype=np.float32)])


def test_a_crop_the_resize_may_not_cover_keeps_the_processor(llava):
    """A shortest edge under the crop (the processor pads such an image): left to the processor."""
    import copy

    processor = copy.deepcopy(llava.processor.image_processor)
    assert DevicePixels.for_processor(processor, torch.device("cpu"), torch.float32) is not None
    processor.size = {"shortest_edge": 224}
    assert DevicePixels.for_processor(processor, torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("arch", ["llava-next", "llava-onevision"])
def test_tiled_families_keep_their_processor(tmp_path, arch):
    """LLaVA-NeXT's and OneVision's processors tile (or square) an image: nothing to do on the device."""
    model = LlavaModel.from_pretrained(write_checkpoint("tiny", tmp_path / arch, seed=0, arch=arch), device="cpu")
    assert DevicePixels.for_processor(model.processor.image_processor, torch.device("cpu"), torch.float32) is None


def test_the_setting_moves_the_steps_to_the_device_and_a_session_answers(tiny_model_dir, llava):
    """``image_preprocessing: device`` through the worker's service: the runner hands the model its
    preprocessing on the device,
    an image opens a session and a question is answered; its features are the host path's within the
    tiny model's rounding of a one-level difference."""
    service = build_service(
        {
            "model_dir": str(tiny_model_dir),
            "device": "cpu",
            "device_budget_bytes": 10**9,
            "image_preprocessing": "device",
            "step_max_ms": 600_000,  # out of reach: under the suite's load an answer would span calls
            "step_max_tokens": 8,  # the 5-token answer in one call
        }
    )
    model, pixels = service.engine.model, service.engine.runner.device_pixels
    assert isinstance(pixels, DevicePixels)
    buffer = io.BytesIO()
    photo("coffee").save(buffer, format="PNG")
    image = {"base64": base64.b64encode(buffer.getvalue()).decode()}
    opened = service.handle([BatchRequest("o", "s", True, {"type": "open_session", "image": image})])[0]
    assert opened.status == 200, opened.body
    ask = {"type": "generate", "prompt": "What is it?", "parameters": {"max_new_tokens": 5}}
    answer = service.handle([BatchRequest("g", "s", False, ask)])[0]
    assert answer.status == 200 and answer.stop is None, answer.body
    on_device = model.encode_images([photo("coffee")], pixels=pixels)[0]
    on_host = model.encode_images([photo("coffee")])[0]
    assert on_device.shape == on_host.shape
    relative = ((on_device - on_host).abs().max() / on_host.abs().max()).item()
    assert relative < FEATURE_TOLERANCE, relative
    assert not hasattr(llava, "device_pixels")  # the model holds no preprocessing of its own
