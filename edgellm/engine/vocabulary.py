"""A loaded llama.cpp model's tokenizer: tokens of text, pieces of tokens, the special tokens, its metadata.

`Vocabulary` is the base of every model the engine loads (engine/model.py's generation model,
engine/draft_model.py, engine/embedder.py): each sets `model`, `vocab` and `n_vocab`, then reads text
through these. Apart from the model so that the draft and embedding models share it without the chat
template (engine/chat_prompt.py) or the generation context.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L

from edgellm.errors import EngineError, InvalidRequest


class Vocabulary:
    """A loaded llama.cpp model's tokenizer and metadata (the generation model, a dedicated embedding
    model): `model`, `vocab` and `n_vocab` are set by the subclass before these are used."""

    model: ctypes.c_void_p
    vocab: ctypes.c_void_p
    n_vocab: int

    def _init_vocab(self) -> None:
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._pieces: dict[int, bytes] = {}

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(65536)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def with_bos(self, tokens: list[int]) -> list[int]:
        """The tokens after the model's BOS, when its vocabulary asks for one and they do not start with it."""
        bos = L.llama_vocab_bos(self.vocab)
        if L.llama_vocab_get_add_bos(self.vocab) and bos >= 0 and tokens[:1] != [bos]:
            return [bos, *tokens]
        return tokens

    def with_special(self, tokens: list[int]) -> list[int]:
        """The tokens with the BOS (and EOS) the vocabulary adds to a sequence, where it asks for them."""
        tokens = self.with_bos(tokens)
        eos = L.llama_vocab_eos(self.vocab)
        if L.llama_vocab_get_add_eos(self.vocab) and eos >= 0 and tokens[-1:] != [eos]:
            tokens = [*tokens, eos]
        return tokens

    def input_tokens(self, text: str) -> list[int]:
        """A text input (an embedding input): tokenized as text, control-token text included, with the
        vocabulary's BOS/EOS."""
        return self.with_special(self.tokenize(text, special=False))

    def checked_ids(self, tokens: Any, param: str) -> list[int]:
        """Token ids a client sent: integers in the vocabulary, else a 400 naming `param`."""
        if not isinstance(tokens, list):
            raise InvalidRequest(f"{param} must be an array of token ids", param=param)
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab:
                raise InvalidRequest(
                    f"{param}: token id {t!r} is outside the vocabulary [0, {self.n_vocab - 1}]"[:300], param=param
                )
        return list(tokens)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The model's fill-in-the-middle prefix, suffix and middle tokens; None where it has none."""
        ids = tuple(int(getattr(L, f"llama_vocab_fim_{k}")(self.vocab)) for k in ("pre", "suf", "mid"))
        return ids if all(t >= 0 for t in ids) else None

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the prompt contains a lone surrogate (invalid UTF-16); send valid text") from None
        cap = len(data) + 16
        arr = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, False, special)
        if n < 0:
            cap = -n
            arr = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, False, special)
        if n < 0:
            raise EngineError(f"tokenization failed ({n})")
        return list(arr[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (cached; control tokens are empty unless special=True).

        Thread-safe: the prepare threads call it (a prompt's tail, a structural tag's trigger mask) while
        the step loop does. So each call that misses the cache has a buffer of its own: ctypes releases
        the GIL around llama_token_to_piece, and one shared buffer could hand a token another's bytes."""
        if not special and token in self._pieces:
            return self._pieces[token]
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        out = bytes(buf.raw[:n]) if n > 0 else b""
        if not special:
            self._pieces[token] = out
        return out

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))
