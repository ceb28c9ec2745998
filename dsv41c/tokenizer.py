"""Tokenizer: a thin wrapper around a HF `tokenizers.Tokenizer`.

Two sources: a `tokenizer.json` file (the released DeepSeek tokenizer, or any other), or the
built-in byte-level tokenizer used by the tiny configs: 256 byte symbols (id = byte value,
GPT-2 byte->unicode alphabet, no merges) plus the specials 256 `<|bos|>`, 257 `<|noise|>`,
258 `<|pad|>`. Everything here runs on CPU and is pure Python around the Rust library.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dsv41c.errors import InputError

BYTE_LEVEL_SPECIALS = ("<|bos|>", "<|noise|>", "<|pad|>")

# Names tried, in order, when a tokenizer.json does not say which token plays which role.
_BOS_NAMES = ("<|bos|>", "<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>")
_PAD_NAMES = ("<|pad|>", "<｜▁pad▁｜>", "<pad>", "<|finetune_right_pad_id|>")
_NOISE_NAMES = ("<|noise|>",)


def gpt2_byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table used by ByteLevel (pre-tokenizer and decoder).

    Bytes that are already visible, non-space Latin-1 characters map to themselves; the other
    68 bytes map, in increasing byte order, to U+0100, U+0101, ...
    """
    visible = set(range(ord("!"), ord("~") + 1))
    visible |= set(range(ord("¡"), ord("¬") + 1))
    visible |= set(range(ord("®"), ord("ÿ") + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in visible:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_content(entry) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


class Tokenizer:
    """Encode/decode text; `backend` is the underlying `tokenizers.Tokenizer`.

    `len(tok)` and `tok.vocab_size` count every id the tokenizer knows, added tokens included.
    `bos_id`, `pad_id`, `noise_id` are ints or None when the tokenizer has no such token.
    """

    def __init__(self, backend: HFTokenizer, bos_id: int | None = None,
                 pad_id: int | None = None, noise_id: int | None = None):
        self.backend = backend
        self.bos_id = bos_id if bos_id is not None else self._find(_BOS_NAMES)
        self.pad_id = pad_id if pad_id is not None else self._find(_PAD_NAMES)
        self.noise_id = noise_id if noise_id is not None else self._find(_NOISE_NAMES)

    def _find(self, names) -> int | None:
        for name in names:
            i = self.backend.token_to_id(name)
            if i is not None:
                return i
        return None

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, bos_id: int | None = None,
                  pad_id: int | None = None, noise_id: int | None = None) -> "Tokenizer":
        """Load a `tokenizer.json`. Roles not given explicitly come from a sibling
        `tokenizer_config.json` (`bos_token`, `pad_token`) or from well-known token names."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise InputError(f"tokenizer file {path!r}: expected a tokenizer.json file, found nothing there")
        try:
            backend = HFTokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises plain Exception
            raise InputError(f"tokenizer file {path!r}: expected a readable tokenizer.json, "
                             f"found an error: {exc}") from exc
        config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = {}
            if isinstance(config, dict):
                if bos_id is None and (name := _token_content(config.get("bos_token"))) is not None:
                    bos_id = backend.token_to_id(name)
                if pad_id is None and (name := _token_content(config.get("pad_token"))) is not None:
                    pad_id = backend.token_to_id(name)
        return cls(backend, bos_id=bos_id, pad_id=pad_id, noise_id=noise_id)

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """The built-in tokenizer: 256 byte ids + `<|bos|>`=256, `<|noise|>`=257, `<|pad|>`=258."""
        byte_to_char = gpt2_byte_to_unicode()
        vocab = {byte_to_char[b]: b for b in range(256)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in BYTE_LEVEL_SPECIALS])
        ids = [backend.token_to_id(t) for t in BYTE_LEVEL_SPECIALS]
        assert ids == [256, 257, 258], ids
        return cls(backend, bos_id=256, pad_id=258, noise_id=257)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; the tokenizer's own post-processor is not applied, the BOS is
        prepended here when `add_bos` is set."""
        if not isinstance(text, str):
            raise InputError(f"tokenizer input: expected str, found {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise InputError("tokenizer: add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        """Text of `ids` with special tokens left out."""
        ids = [int(i) for i in ids]
        n = len(self)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise InputError(f"tokenizer decode: expected ids in [0, {n}), found {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(len={len(self)}, bos_id={self.bos_id}, pad_id={self.pad_id}, "
                f"noise_id={self.noise_id})")


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """`Tokenizer.from_file(path)`, or the built-in byte-level tokenizer when `path` is None."""
    if path is None:
        return Tokenizer.byte_level()
    return Tokenizer.from_file(path)
