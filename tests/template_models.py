"""The bundled model under another chat template: test fixtures for the tool-call and thinking formats.

`gguf-new-metadata --chat-template-file` (the gguf package's own tool) copies the bundled GGUF with its
`tokenizer.chat_template` replaced by one of tests/fixtures/templates/*.jinja: the same weights, so the
same small model, writing in the family's syntax because the grammar makes it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edgellm.runtime.model_sizing import bundled_model_path

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


def model_with_template(name: str, out_dir: Path) -> Path:
    """A copy of the bundled model whose chat template is TEMPLATES/<name>.jinja (made once per out_dir)."""
    out = Path(out_dir) / f"smollm2-{name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        script = "from gguf.scripts.gguf_new_metadata import main; main()"
        template = TEMPLATES / f"{name}.jinja"
        cmd = [
            sys.executable,
            "-c",
            script,
            "--chat-template-file",
            str(template),
            bundled_model_path(),
            str(out),
            "--force",
        ]
        subprocess.run(cmd, check=True, capture_output=True, input=b"y\n", timeout=120)
    return out


def _copy_of_the_bundled_model(out: Path, new: dict | None = None, remove: tuple[str, ...] = ()) -> Path:
    """`out`, a copy of the bundled model with metadata `new` (key -> (GGUF type, value)) set and keys
    `remove` dropped, made with the gguf package's own copier (once: an existing file is kept)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        reader = gguf.GGUFReader(bundled_model_path(), "r")
        arch = reader.get_field("general.architecture").contents()
        writer = gguf.GGUFWriter(str(out), arch=arch, endianess=reader.endianess)
        details = {k.replace("{arch}", arch): MetadataDetails(t, v) for k, (t, v) in (new or {}).items()}
        copy_with_new_metadata(reader, writer, details, list(remove))
    return out


def model_without_template(out_dir: Path) -> Path:
    """A copy of the bundled model without `tokenizer.chat_template` (a base model's GGUF): served as ChatML,
    with a warning at start and in /status."""
    import gguf

    return _copy_of_the_bundled_model(
        Path(out_dir) / "smollm2-no-template.gguf", remove=(gguf.Keys.Tokenizer.CHAT_TEMPLATE,)
    )


def model_with_pooling(pooling: int, out_dir: Path) -> Path:
    """A copy of the bundled model that declares `llama.pooling_type` (llama.cpp's enum: 1 mean, 2 cls,
    3 last): a stand-in for a dedicated embedding model."""
    import gguf

    new = {"{arch}.pooling_type": (gguf.GGUFValueType.UINT32, pooling)}
    return _copy_of_the_bundled_model(Path(out_dir) / f"smollm2-pooling{pooling}.gguf", new)


def model_with_fim(out_dir: Path, ids: tuple[int, int, int] = (1, 2, 3)) -> Path:
    """A copy of the bundled model whose vocabulary names fill-in-the-middle prefix, suffix and middle
    tokens (`tokenizer.ggml.fim_{pre,suf,mid}_token_id`, here existing control tokens): /v1/completions'
    `suffix` on a model that has them."""
    import gguf

    keys = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id")
    new = {k: (gguf.GGUFValueType.UINT32, v) for k, v in zip(keys, ids, strict=True)}
    return _copy_of_the_bundled_model(Path(out_dir) / "smollm2-fim.gguf", new)
