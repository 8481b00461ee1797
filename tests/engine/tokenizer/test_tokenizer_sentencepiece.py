"""SentencePiece GGUF vocabularies (Llama 2, Mistral): a model trained here, written the way llama.cpp writes
one, must tokenize like SentencePiece itself and like transformers' GGUF tokenizer."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm
from gguf import GGUFReader, GGUFWriter

from tandem.engine.loader.gguf_index import metadata_of
from tandem.engine.tokenizer.gguf_vocab import tokenizer_from_gguf
from tests.engine.tokenizer.test_tokenizer import BASE, CORPUS

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(SentencePiece processor, GGUF path) for a 600-piece BPE model with Llama 2's training options."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 3), model_writer=model, model_type="bpe", vocab_size=600,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
        allow_whitespace_only_pieces=True)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    ids = range(sp.get_piece_size())
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types([UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
                            BYTE if sp.is_byte(i) else NORMAL for i in ids])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return sp, path


@pytest.fixture(scope="module")
def ours(trained):
    _, path = trained
    return tokenizer_from_gguf(metadata_of(GGUFReader(path), path))


def test_ids_match_sentencepiece(trained, ours):
    sp, _ = trained
    mismatches = [s for s in CORPUS if ours.encode(s) != [1] + sp.encode(s)]
    assert not mismatches, mismatches[:5]


def test_ids_match_transformers_except_where_it_departs_from_sentencepiece(trained, ours):
    """transformers' GGUF conversion uses a Metaspace pre-tokenizer, which skips SentencePiece's dummy prefix
    when the text already starts with whitespace (SentencePiece itself does not: the test above). Everywhere
    else the two must agree."""
    from transformers import AutoTokenizer

    _, path = trained
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    mismatches = [s for s in CORPUS if ours.encode(s) != hf(s)["input_ids"]]
    assert all(s[:1].isspace() for s in mismatches), [s for s in mismatches if not s[:1].isspace()][:5]
    assert len(mismatches) < len(CORPUS) / 2


def test_decode_matches_sentencepiece_and_streams_whole_characters(trained, ours):
    sp, _ = trained
    for text in BASE:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == sp.decode(ids)
        detok = ours.detokenizer()
        deltas = [detok.step(i) for i in ids]
        assert "".join(deltas) == ours.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_rare_characters_fall_back_to_bytes(trained, ours):
    sp, _ = trained
    ids = ours.encode("𝄞", add_special_tokens=False)  # not in the training text: 4 UTF-8 byte pieces
    assert len(ids) == 5 and all(sp.is_byte(i) for i in ids[1:]) and ours.decode(ids) == "𝄞"
