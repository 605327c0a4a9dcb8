"""Tests for runtime.components.tokenizer: round trips for bytes, tokenizer.json and SentencePiece."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.components.tokenizer import (ByteTokenizer, HfTokenizer, SentencePieceTokenizer, TextStream,
                                         load_tokenizer)
from runtime.errors import InvalidArgumentError, NotFoundError

TEXTS = ["hello world", "Ünïcödé and emoji 🙂", "", "line one\nline two"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world", "a small corpus for a tiny tokenizer",
          "on-device runtimes swap adapters", "line one\nline two"] * 20


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "sp"), vocab_size=300, byte_fallback=True,
        character_coverage=1.0, minloglevel=2)
    return folder / "sp.model"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tokenizer = ByteTokenizer(stop_token_ids=[10])
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids) and tokenizer.decode(ids) == text
    assert tokenizer.stop_token_ids == (10,) and tokenizer.vocab_size == 256


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(hf_json, text):
    for tokenizer in (HfTokenizer(hf_json), HfTokenizer(hf_json.read_bytes()), load_tokenizer(hf_json)):
        assert tokenizer.decode(tokenizer.encode(text)) == text
        assert tokenizer.stop_token_ids == (tokenizer._tokenizer.token_to_id("</s>"),)


@pytest.mark.parametrize("text", [t for t in TEXTS if "\n" not in t])
def test_sentencepiece_round_trip(sp_model, text):
    for tokenizer in (SentencePieceTokenizer(sp_model), SentencePieceTokenizer(sp_model.read_bytes()),
                      load_tokenizer(sp_model)):
        assert tokenizer.decode(tokenizer.encode(text)) == text
        assert tokenizer.vocab_size == 300 and tokenizer.stop_token_ids == (2,)


def test_bad_tokenizer_files(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ not json")
    with pytest.raises(InvalidArgumentError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)
    junk = tmp_path / "sp.model"
    junk.write_bytes(b"\x00\x01 junk")
    with pytest.raises(InvalidArgumentError, match="not a valid SentencePiece"):
        load_tokenizer(junk)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(56))
    with pytest.raises(InvalidArgumentError, match=r"model\.gguf: a GGUF file.*--bundle"):
        load_tokenizer(gguf)
    with pytest.raises(NotFoundError):
        load_tokenizer(tmp_path / "missing.json")


def test_special_tokens_read_as_the_vocabulary_spells_them(hf_json, sp_model):
    hf = HfTokenizer(hf_json)
    assert hf.token_text(hf.stop_token_ids[0]) == "</s>" and hf.decode(hf.stop_token_ids) == ""
    assert hf.bos_token is None and hf.encode("hello", add_special_tokens=True) == hf.encode("hello")
    sp = SentencePieceTokenizer(sp_model)
    assert sp.token_text(2) == "</s>" and sp.bos_token == "<s>"
    assert sp.encode("hello", add_special_tokens=True) == [1, *sp.encode("hello")]
    byte = ByteTokenizer([10])
    assert byte.token_text(10) == "\n" and byte.encode("hi", add_special_tokens=True) == [104, 105]


def test_ids_past_the_vocabulary_decode_to_nothing(hf_json, sp_model):
    """A model may have more embeddings than its tokenizer has tokens (Gemma 3: 262,208 and
    262,144): an id the tokenizer lacks adds no text, and decoding never raises."""
    for tokenizer in (ByteTokenizer(), HfTokenizer(hf_json), SentencePieceTokenizer(sp_model)):
        ids, past = tokenizer.encode("hello world"), tokenizer.vocab_size
        assert tokenizer.decode([*ids[:2], past, *ids[2:], past + 63]) == "hello world"
        assert tokenizer.decode([past]) == ""


def test_a_token_s_own_bytes_where_the_vocabulary_spells_them(hf_json, sp_model):
    """What chat logprobs' ``bytes`` say: a byte-level BPE token's bytes and a byte-fallback
    piece's byte, a part of a character too; ``None`` where only the token's text tells."""
    byte = ByteTokenizer()
    assert [byte.token_bytes(t) for t in byte.encode("é")] == [b"\xc3", b"\xa9"] and byte.token_bytes(256) == b""
    hf = HfTokenizer(hf_json)
    for text in TEXTS:
        assert b"".join(hf.token_bytes(t) for t in hf.encode(text)) == text.encode()
    assert hf.token_bytes(hf.stop_token_ids[0]) is None
    sp = SentencePieceTokenizer(sp_model)
    pieces = sp.encode("🙂")  # not in the corpus: '▁' and four byte pieces
    assert [sp.token_bytes(t) for t in pieces] == [None, b"\xf0", b"\x9f", b"\x99", b"\x82"]
    assert sp.token_bytes(sp.vocab_size) is None


def test_text_that_is_not_unicode_is_refused_naming_where(hf_json, sp_model):
    """A lone surrogate (what Python makes of a command line's bytes that are not UTF-8) was
    a UnicodeEncodeError, a TypeError or a RuntimeError depending on the tokenizer; a
    non-str text an AttributeError or a TypeError."""
    for tokenizer in (ByteTokenizer(), HfTokenizer(hf_json), SentencePieceTokenizer(sp_model)):
        with pytest.raises(InvalidArgumentError, match=r"text holds a lone surrogate '\\udcff' at character 2"):
            tokenizer.encode("ab\udcffc")
        for value in (None, b"abc"):
            with pytest.raises(InvalidArgumentError, match="text is .*, expected a str"):
                tokenizer.encode(value)
        assert tokenizer.decode(tokenizer.encode("a\x00b")) == "a\x00b"


def test_negative_and_huge_ids_decode_to_nothing_and_read_as_nothing(hf_json, sp_model):
    """Decoding never fails (the protocol's promise): Hugging Face's library raised
    OverflowError for a negative id or one past 64 bits, SentencePiece's token_text an
    IndexError or a TypeError."""
    for tokenizer in (ByteTokenizer(), HfTokenizer(hf_json), SentencePieceTokenizer(sp_model)):
        ids = tokenizer.encode("hello")
        assert tokenizer.decode([-1, *ids, 2**70, -2**70]) == "hello"
        for token in (-1, 2**40, 2**70):
            assert tokenizer.token_text(token) == "" and not tokenizer.token_bytes(token)


def test_streamed_pieces_join_to_exactly_the_decoded_text(hf_json, sp_model):
    """What ``runtime generate`` prints token by token: a character split over tokens (bytes,
    byte-level BPE, byte-fallback pieces) comes whole with the token that completes it, and
    SentencePiece's spaces between words stay (decoding each token alone gave U+FFFD for
    each part of a character and dropped every word's space)."""
    rng = np.random.default_rng(0)
    for tokenizer in (ByteTokenizer(), HfTokenizer(hf_json), SentencePieceTokenizer(sp_model)):
        sequences = [tokenizer.encode(text) for text in ["é🙂 and ü", "hello world 🙂", "a\u4e2d\u6587b"]]
        sequences += [list(rng.integers(0, tokenizer.vocab_size, 40)) for _ in range(20)]  # broken bytes too
        for ids in sequences:
            stream = TextStream(tokenizer.decode)
            pieces = [stream.add(int(token)) for token in ids]
            pieces.append(stream.finish())
            assert "".join(pieces) == tokenizer.decode(ids), (type(tokenizer).__name__, ids)
        stream = TextStream(tokenizer.decode)
        pieces = [stream.add(token) for token in tokenizer.encode("é🙂")]
        assert "\ufffd" not in "".join(pieces) and "".join(pieces) + stream.finish() == "é🙂"


def test_a_tokenizer_path_that_is_no_file_says_what_it_is(hf_json, tmp_path):
    """A directory (a Hugging Face checkpoint's folder, say) was 'no such tokenizer file',
    though it exists; a tokenizer.json saved with a UTF-8 byte order mark (as Windows
    editors do) was read as a SentencePiece model and refused as one."""
    for load in (load_tokenizer, HfTokenizer, SentencePieceTokenizer):
        with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {tmp_path}: is a directory, expected a "):
            load(tmp_path)
        with pytest.raises(NotFoundError, match=f"{tmp_path / 'missing.json'}: no such file"):
            load(tmp_path / "missing.json")
    marked = tmp_path / "bom.json"
    marked.write_bytes(b"\xef\xbb\xbf" + hf_json.read_bytes())
    for tokenizer in (load_tokenizer(marked), HfTokenizer(marked), HfTokenizer(marked.read_bytes())):
        assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_sentencepiece_reads_its_bos_and_eos_spellings_in_text_as_those_tokens(sp_model):
    """A chat template inserts the tokenizer's bos_token and eos_token as text ('<s>', '</s>');
    SentencePiece encodes control pieces' spellings as their characters, so a rendered
    prompt began with '<', 's', '>' instead of the beginning-of-sentence token (a tokenizer.json
    reads them as the tokens)."""
    sp = SentencePieceTokenizer(sp_model)
    hello = sp.encode("hello")
    assert sp.encode("<s>hello") == [1, *hello] == sp.encode("hello", add_special_tokens=True)
    assert sp.encode("<s>hello</s><s>hello") == [1, *hello, 2, 1, *hello]
    assert sp.encode("hello</s>")[-1] == 2 and sp.decode(sp.encode("<s>hello</s>")) == "hello"
    assert sp.encode("<unk>") != [0]  # only the pieces a template inserts (bos, eos, pad) are read so


@pytest.mark.parametrize("family, stops", [
    ("Llama 3 (base and instruct, with tool calls)", ["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]),
    ("Phi-3", ["<|endoftext|>", "<|end|>"]),
])
def test_a_tokenizer_json_s_end_tokens_stop_a_generation(hf_json, tmp_path, family, stops):
    """A tokenizer.json does not say which tokens end a generation: the common spellings are
    looked up, and Llama 3's end of text (a base model's only end), its end of a tool call and
    Phi-3's end of turn were not among them, so those models generated past their end."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf_json))
    tokenizer.add_special_tokens(stops)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = HfTokenizer(path)
    assert {loaded.token_text(token) for token in loaded.stop_token_ids} >= set(stops), family


def test_a_sentencepiece_model_s_end_of_turn_stops_a_generation_as_in_a_tokenizer_json(tmp_path):
    """Gemma's tokenizer.model ends a chat turn with <end_of_turn>, a piece of its own: only the
    end-of-sentence id was a stop token, so a bare SentencePiece model's chat went past it."""
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=292, byte_fallback=True,
        character_coverage=1.0, minloglevel=2, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    sp = SentencePieceTokenizer(tmp_path / "sp.model")
    assert [sp.token_text(token) for token in sp.stop_token_ids] == ["</s>", "<end_of_turn>"]
    assert SentencePieceTokenizer(tmp_path / "sp.model", stop_token_ids=[2]).stop_token_ids == (2,)
