"""check_source / check_content: load_bytes's and load_content's refusals by policy, reading nothing.

The console's "Check" (/console/api/check) runs these: its verdict must be the real route's for every
reference the policy decides (scheme, media_dirs, remote media, the model's modalities), and it must
never open a file, fetch a URL or decode pixels.
"""

from __future__ import annotations

import base64
import os

import pytest

from edgellm.media import sources as sources_module
from edgellm.media.errors import MediaError, MediaTooLarge
from edgellm.media.limits import MediaLimits, MediaSources
from edgellm.media.loading import check_content, load_content
from edgellm.media.parts import parse_content
from edgellm.media.sources import check_source, load_bytes
from edgellm.media.types import MediaCaps

LIMITS = MediaLimits(max_bytes=1024, max_items=2)
VISION = MediaCaps(vision=True, image_size=32, projector_type="mlp")


@pytest.fixture
def tree(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(b"not even an image")  # a check does not decode
    (media / "big.png").write_bytes(b"x" * 2048)
    (media / "sub").mkdir()
    (tmp_path / "secret.png").write_bytes(b"secret")
    return tmp_path, MediaSources(media_dirs=(str(media),))


def same_refusal(ref: str, sources: MediaSources, **kw) -> str:
    """The check and the load refuse `ref` with the same error; returns its message."""
    with pytest.raises((MediaError, MediaTooLarge)) as loaded:
        load_bytes(ref, sources, LIMITS, param="p", **kw)
    with pytest.raises(type(loaded.value)) as checked:
        check_source(ref, sources, LIMITS, param="p", **kw)
    assert checked.value.message == loaded.value.message and checked.value.param == "p"
    return checked.value.message


def test_policy_refusals_are_the_real_ones(tree):
    root, sources = tree
    media = root / "media"
    assert "remote media URLs are disabled" in same_refusal("http://127.0.0.1:9/x.png", sources)
    assert "remote media URLs are disabled" in same_refusal("https://example.com/x.png", sources)
    assert "outside the configured media_dirs" in same_refusal(str(root / "secret.png"), sources)
    assert "outside the configured media_dirs" in same_refusal(f"file://{root}/secret.png", sources)
    assert "outside the configured media_dirs" in same_refusal(f"{media}/../secret.png", sources)
    assert "local media files are disabled" in same_refusal(str(media / "a.png"), MediaSources())
    assert "relative path" in same_refusal("a.png", sources)
    assert "unsupported URL scheme" in same_refusal("ftp://x/y.png", sources)
    assert "no such file" in same_refusal(str(media / "missing.png"), sources)
    assert "is a directory" in same_refusal(str(media / "sub"), sources)
    assert "the limit is 1024 bytes" in same_refusal(str(media / "big.png"), sources)
    assert "invalid base64" in same_refusal("data:image/png;base64,!!!!", sources)


def test_accepted_references_are_not_read(tree, monkeypatch):
    root, sources = tree
    media = root / "media"

    def no_reading(*args, **kwargs):
        raise AssertionError("a check must not read or fetch")

    monkeypatch.setattr(sources_module, "_read_capped", no_reading)
    monkeypatch.setattr(sources_module, "_fetch_remote", no_reading)
    check_source(str(media / "a.png"), sources, LIMITS)
    check_source("a.png", sources, LIMITS, base_dir=str(media))
    check_source("https://example.com/x.png", MediaSources(allow_remote=True), LIMITS)
    os.mkfifo(media / "fifo")  # opening a FIFO could block: a check only looks at it
    with pytest.raises(MediaError, match="not a regular file"):
        check_source(str(media / "fifo"), sources, LIMITS)


def user(*parts: dict) -> list[dict]:
    stored, _, _ = parse_content("messages[0]", list(parts), "user")
    return [{"role": "user", "content": stored}]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_check_content_refuses_what_load_content_refuses(tree):
    root, sources = tree
    cases = [
        (user(image("http://example.com/a.png")), VISION, "remote media URLs are disabled"),
        (user(image(str(root / "secret.png"))), VISION, "outside the configured media_dirs"),
        (user(image(str(root / "media" / "a.png"))), MediaCaps(), "this model takes no images"),
        (user(*[image(str(root / "media" / "a.png"))] * 3), VISION, "the limit is 2"),
    ]
    for messages, caps, fragment in cases:
        with pytest.raises(MediaError) as loaded:
            load_content(messages, caps, sources, LIMITS)
        with pytest.raises(MediaError) as checked:
            check_content(messages, caps, sources, LIMITS)
        assert fragment in checked.value.message and checked.value.message == loaded.value.message
    # A part's error names the client's part index, as the load does.
    messages = user({"type": "text", "text": "see"}, image(str(root / "secret.png")))
    with pytest.raises(MediaError) as checked:
        check_content(messages, VISION, sources, LIMITS)
    assert checked.value.param == "messages[0].content[1]"


def test_check_content_passes_what_the_policy_allows(tree):
    root, sources = tree
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG not decoded").decode()
    messages = user({"type": "text", "text": "two"}, image(str(root / "media" / "a.png")), image(png))
    check_content(messages, VISION, sources, LIMITS)
    check_content(messages, None, sources, LIMITS)  # the engine has not reported its projector yet
    check_content([{"role": "user", "content": "text only"}], MediaCaps(), sources, LIMITS)
