"""Stored content parts -> engine messages and decoded media (media/parts + media/loading), no model."""

from __future__ import annotations

import base64

import cv2
import numpy as np
import pytest

from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import MAX_IMAGE_SIDE, load_content
from edgellm.media.parts import parse_content
from edgellm.media.types import MediaCaps

VISION = MediaCaps(vision=True, image_size=32, projector_type="mlp")


def data_url(pixels: np.ndarray) -> str:
    ok, buf = cv2.imencode(".png", pixels)
    assert ok
    return "data:image/png;base64," + base64.b64encode(buf.tobytes()).decode()


def user(*parts: dict) -> list[dict]:
    stored, _, _ = parse_content("messages[0]", list(parts), "user")
    return [{"role": "user", "content": stored}]


def test_errors_name_the_clients_part_index_even_after_adjacent_text_parts():
    messages = user(
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    )
    with pytest.raises(MediaError) as info:
        load_content(messages, VISION, MediaSources(), MediaLimits())
    assert info.value.param == "messages[0].content[2]"


def test_adjacent_text_parts_read_as_lines_and_media_get_indices():
    image = {"type": "image_url", "image_url": {"url": data_url(np.zeros((8, 8, 3), np.uint8))}}
    messages, media = load_content(
        user({"type": "text", "text": "a"}, {"type": "text", "text": "b"}, image), VISION, MediaSources(), MediaLimits()
    )
    assert messages[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "\nb"},
        {"type": "media", "index": 0},
    ]
    assert len(media) == 1 and (media[0].width, media[0].height) == (8, 8)


def test_large_images_are_scaled_down_but_not_with_do_resize_false():
    big = np.zeros((2500, 3000, 3), np.uint8)
    big[:, :, 1] = np.arange(3000, dtype=np.uint32) % 256  # compresses well: under max_media_bytes as PNG
    _, media = load_content(
        user({"type": "image_url", "image_url": {"url": data_url(big)}}), VISION, MediaSources(), MediaLimits()
    )
    assert (media[0].width, media[0].height) == (MAX_IMAGE_SIDE, round(2500 * MAX_IMAGE_SIDE / 3000))
    exact = np.zeros((32, 32, 3), np.uint8)
    _, media = load_content(
        user({"type": "image", "image": data_url(exact), "do_resize": False}), VISION, MediaSources(), MediaLimits()
    )
    assert (media[0].width, media[0].height) == (32, 32)


def test_the_decoded_media_of_one_request_are_capped():
    frame = {"type": "image_url", "image_url": {"url": data_url(np.zeros((2048, 2048, 3), np.uint8))}}
    with pytest.raises(MediaTooLarge, match="MiB"):
        load_content(user(*[frame] * 3), VISION, MediaSources(), MediaLimits())  # 3 x 12 MiB > 32 MiB


def test_too_many_items_are_refused_before_any_is_decoded():
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}  # would fail to decode
    with pytest.raises(MediaError, match="the limit is 2"):
        load_content(user(bad, bad, bad), VISION, MediaSources(), MediaLimits(max_items=2))


def test_a_model_without_the_modality_is_named():
    image = {"type": "image_url", "image_url": {"url": data_url(np.zeros((8, 8, 3), np.uint8))}}
    with pytest.raises(MediaError, match="no images.*mmproj_path"):
        load_content(user(image), MediaCaps(), MediaSources(), MediaLimits())
