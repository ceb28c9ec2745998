import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41c.errors import InputError
from dsv41c.tokenizer import Tokenizer, gpt2_byte_to_unicode, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.byte_level()


def test_byte_to_unicode_table():
    table = gpt2_byte_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord("!")] == "!" and table[0xFF] == "ÿ"
    assert table[0] == "\u0100" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert table[0xAD] == "Ń"


def test_byte_level_layout(tok):
    assert len(tok) == tok.vocab_size == 259
    assert (tok.bos_id, tok.noise_id, tok.pad_id) == (256, 257, 258)
    assert [tok.id_to_token(i) for i in (256, 257, 258)] == ["<|bos|>", "<|noise|>", "<|pad|>"]
    table = gpt2_byte_to_unicode()
    assert all(tok.id_to_token(b) == table[b] for b in range(256))
    assert tok.backend.get_vocab_size(with_added_tokens=False) == 256


def test_ids_are_utf8_bytes(tok):
    text = "Hi ü 中文 🙂\t\r\n\x00"
    assert tok.encode(text) == [256] + list(text.encode("utf-8"))
    assert tok.encode(text, add_bos=False) == list(text.encode("utf-8"))
    assert tok.encode("", add_bos=False) == []


def test_decode_skips_specials(tok):
    ids = [256] + tok.encode("a b", add_bos=False) + [258, 257]
    assert tok.decode(ids) == "a b"
    with pytest.raises(InputError):
        tok.decode([259])


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip(text):
    tok = Tokenizer.byte_level()
    assert tok.decode(tok.encode(text)) == text or "<|" in text


def test_round_trip_samples(tok):
    for text in ["", " leading", "trailing  ", "e\u0301 café ﬁ", "👩‍👩‍👧 🇫🇷", "日本語のテキスト", "\ud7ff\ue000\U0010ffff"]:
        assert tok.decode(tok.encode(text)) == text


def test_from_file_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.backend.save(str(path))
    loaded = Tokenizer.from_file(path)
    assert (loaded.bos_id, loaded.noise_id, loaded.pad_id) == (256, 257, 258)
    assert len(loaded) == 259
    assert loaded.encode("x 🙂") == tok.encode("x 🙂")
    assert load_tokenizer(str(path)).encode("ab") == [256, 97, 98]


def test_from_file_uses_tokenizer_config(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|pad|>"}, "pad_token": "<|bos|>"}))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (loaded.bos_id, loaded.pad_id) == (258, 256)


def test_from_file_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(InputError, match="nope.json"):
        Tokenizer.from_file(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="bad.json"):
        load_tokenizer(str(bad))


def test_load_tokenizer_default():
    assert len(load_tokenizer(None)) == 259
