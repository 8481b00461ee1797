"""Builds a `tokenizers` tokenizer from the vocabulary, merges and special-token ids stored in a GGUF file."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from tandem.engine.errors import UnsupportedModelError
from tandem.engine.tokenizer.tokenizer import Tokenizer

# llama.cpp's token types.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer splits for `tokenizer.ggml.pre` values whose merges were learned on a non-GPT-2 split.
# Anything else (gpt2, smollm, ...) uses the GPT-2 split built into ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """GPT-2 style byte-level BPE from the file's vocabulary and merges."""
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two vocabulary pieces is a
    merge, ranked by the merged token's score (best first), ties broken towards longer left pieces."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """SentencePiece BPE (Llama 2, Mistral): Metaspace, byte fallback, merges recovered from the scores."""
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise UnsupportedModelError("GGUF SentencePiece vocabulary has no scores for its tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores),
                                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # SentencePiece always adds its dummy prefix, even before a leading space ("  a" -> "\u2581\u2581\u2581a").
    # A normalizer does the same; the Metaspace pre-tokenizer skips it when the text starts with a space.
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """meta: GGUF key -> value. Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2,
    SmolLM2) and SentencePiece BPE (`"llama"`: Llama 2, Mistral). Raises UnsupportedModelError otherwise."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(_BUILDERS)}); "
            "load the model from its Hugging Face folder instead"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    backend, vocab = _BUILDERS[kind](meta, tokens)
    # In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's.
    alphabet = set(_byte_alphabet().values()) if kind == "gpt2" else None
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                                if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    eos_ids = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    return Tokenizer(backend, chat_template=meta.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos,
                     eos_token_ids=eos_ids)
