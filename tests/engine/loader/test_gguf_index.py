"""engine/loader/gguf_index.py: a GGUF file parsed once per version of it, the rest read from the cache, with the
same metadata and the same tensor bytes as the gguf package's own reader."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quantize

from tandem.engine.errors import ModelLoadError
from tandem.engine.loader.gguf_index import metadata_of, open_gguf


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A small GGUF file with a tensor of each layout the index maps (float32, float16, bfloat16 and quantized
    blocks) and metadata of each kind (strings, numbers, a bool, lists)."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_rope_freq_base(10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list(["<s>", "hello", "wörld", "\u2581x"])
    writer.add_token_merges(["h e", "l l"])
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("a.f32", weight)
    writer.add_tensor("b.f16", weight.astype(np.float16))
    writer.add_tensor("c.bf16", quantize(weight, Q.BF16), raw_dtype=Q.BF16)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        writer.add_tensor(f"d.{qtype.name}", quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def tiny(written, tmp_path, monkeypatch):
    """A file of its own (a test may change it) and a cache folder of its own."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.gguf"
    path.write_bytes(written)
    return path


def cached_files(tmp_path):
    return sorted((tmp_path / "cache" / "gguf").glob("*.json"))


def test_a_cached_index_equals_the_readers_metadata_and_bytes(tiny, tmp_path):
    parsed = open_gguf(tiny)
    [cache] = cached_files(tmp_path)
    again = open_gguf(tiny)
    assert cached_files(tmp_path) == [cache]
    reader = GGUFReader(tiny)
    assert parsed.metadata == again.metadata == metadata_of(reader, tiny)
    assert parsed.tensors == again.tensors
    assert len(again.tensors) == len(reader.tensors)
    assert len(reader.tensors) == 6 and again.metadata["tokenizer.ggml.tokens"][2] == "wörld"
    for info, t in zip(again.tensors, reader.tensors):
        data = again.data(info)
        assert info.name == t.name and data.dtype == t.data.dtype and data.shape == t.data.shape
        assert np.array_equal(data.view(np.uint8), t.data.view(np.uint8)), info.name
        assert not data.flags.writeable


def test_a_changed_file_is_parsed_again(tiny, tmp_path):
    open_gguf(tiny)
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    open_gguf(tiny)
    assert len(cached_files(tmp_path)) == 2  # a new key: the old entry is never read for the new file
    tiny.write_bytes(tiny.read_bytes()[:-64])  # truncated: another size, parsed, refused
    with pytest.raises(ModelLoadError, match="truncated"):
        open_gguf(tiny)


def test_a_corrupt_cache_is_ignored_and_rewritten(tiny, tmp_path, caplog):
    want = open_gguf(tiny)
    [cache] = cached_files(tmp_path)
    cache.write_text('{"format": 1, "metadata": ')
    with caplog.at_level(logging.WARNING, logger="tandem.engine.loader.gguf_index"):
        got = open_gguf(tiny)
    assert got.metadata == want.metadata and got.tensors == want.tensors
    assert "ignoring the GGUF index cache" in caplog.text
    assert open_gguf(tiny).tensors == want.tensors and cache.read_text().startswith('{"format": 1')


def test_an_unwritable_cache_folder_costs_only_speed(tiny, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.WARNING, logger="tandem.engine.loader.gguf_index"):
        index = open_gguf(tiny)
    assert len(index.tensors) == len(GGUFReader(tiny).tensors)
    assert "could not keep the GGUF index" in caplog.text
