"""LLaVA-NeXT's and OneVision's vision tower per tile count (issue 59 item 4): what a GPU captures.

Nothing is captured on this CPU. What runs here is the path the graphs replay, eagerly: each image's
tiles through the tower up to its feature layer and the projector alone, then the model's own
``pack_image_features``. Its features equal the model's own ``get_image_features`` on the stacked
batch, for images of several sizes (so several tile counts), and in OneVision's several-image mode.
``tests/gpu/test_on_gpu.py`` checks the replay on a GPU.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from llava_sessions.model.gpu.tile_graphs import TileGraphs, tile_counts
from llava_sessions.model.gpu.vision_graph import image_features

ARCHS = ("llava-next", "llava-onevision")


def pictures(photos) -> list[Image.Image]:
    """Three photographs at sizes that take different grids: square, wide, tall."""
    sizes = {"astronaut": None, "coffee": (300, 120), "chelsea": (90, 400)}
    out = []
    for name, size in sizes.items():
        picture = Image.open(io.BytesIO(photos[name])).convert("RGB")
        out.append(picture if size is None else picture.resize(size))
    return out


def test_tile_counts_are_each_pinpoint_grid_and_its_base_tile(family) -> None:
    next_config = family["llava-next"].config  # llava-v1.6's five pinpoints at 336 px
    assert tile_counts(next_config) == [1, 3, 4, 5]
    counts = tile_counts(family["llava-onevision"].config)  # OneVision's grids of 1 to 6 tiles a side
    assert counts[:4] == [1, 2, 3, 4] and counts[-1] == 37 and len(counts) == 19


@pytest.mark.parametrize("arch", ARCHS)
def test_each_images_tiles_alone_then_packed_equal_the_models_own_features(family, photos, arch) -> None:
    """One image, three images of three sizes and two: every image's features equal those of
    ``get_image_features`` on the stacked batch (fp32); in OneVision's several-image mode each image is its
    base tile alone. A captured graph is never used here, so nothing replayed."""
    llava = family[arch]
    graphs = TileGraphs(llava.model, llava.architecture, llava.device, llava.dtype)
    assert graphs.onevision == (arch == "llava-onevision")
    images = pictures(photos)
    modes = (False, True) if graphs.onevision else (False,)
    for batch in ([images[0]], images, images[1:]):
        for several in modes:
            stacked = [batch + batch[:1] if len(batch) == 1 else batch] if several else batch
            out = llava.processor.image_processor(images=stacked, return_tensors="pt")
            kwargs = {"image_sizes": out["image_sizes"][: len(batch)]}
            if several:
                kwargs["batch_num_images"] = torch.tensor([max(2, len(batch))])
            pixels = out["pixel_values"][: len(batch)]
            assert graphs.matches(pixels, kwargs) and not graphs.matches(pixels[:, 0], {})
            with torch.inference_mode():
                want = image_features(llava.model, pixels, **kwargs)
                got = graphs.run(pixels, **kwargs)
            assert len(got) == len(want) == len(batch)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6), (len(batch), several)
    assert (
        graphs.num_replays == 0
        and TileGraphs.capture(llava.model, llava.architecture, llava.device, llava.dtype) is None
    )


def test_encode_images_takes_the_tile_path_when_given_one(family, photos) -> None:
    """``LlavaModel.encode_images`` sends a tiled model's pixels through the :class:`TileGraphs` it is
    given (a GPU's runner passes its own; here it runs eagerly) and gets the features it gets without."""
    llava = family["llava-next"]
    images = pictures(photos)
    want = llava.encode_images(images)
    tower = TileGraphs(llava.model, llava.architecture, llava.device, llava.dtype)
    calls = []
    original = tower._tiles
    tower._tiles = lambda pixels: calls.append(pixels.shape[0]) or original(pixels)  # type: ignore[method-assign]
    got = llava.encode_images(images, tower=tower)
    assert len(calls) == len(images) and set(calls) <= {1, 3, 4, 5}
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True))
