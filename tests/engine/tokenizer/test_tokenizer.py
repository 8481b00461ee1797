"""The tokenizer built from the GGUF vocabulary vs transformers' tokenizer of the same file."""

from __future__ import annotations

import itertools

import pytest

BASE = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "I'm sure they'll've done it; we'd rather not.",
    "Bonjour, ça va ? Très bien, merci.", "¿Dónde está la biblioteca? Mañana.", "Grüße aus München, Straße 5.",
    "Привет, как дела? Всё хорошо.", "こんにちは、世界。今日はいい天気ですね。", "北京欢迎你，上海也欢迎你。",
    "안녕하세요, 반갑습니다.", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "Γειά σου Κόσμε", "Xin chào thế giới",
    "สวัสดีชาวโลก", "Merhaba dünya, nasılsın?", "Cześć, jak się masz?", "Olá, tudo bem? Ótimo.", "Hej, hur mår du?",
    "😀😃😄 emoji 🦙🚀✨", "👨‍👩‍👧‍👦 family", "🇫🇷🇩🇪 flags", "❤️ hearts 💔", "math: ∑ x² ≤ ∞, π ≈ 3.14159",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age > 21 GROUP BY name;", "<div class=\"a\">&nbsp;</div>",
    "#include <stdio.h>\nint main() { printf(\"hi\\n\"); }", "const f = async () => await fetch('/api?q=1');",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "x = [i for i in range(10) if i % 2 == 0]",
    "    four spaces", "\ttab\tseparated\tvalues", "trailing spaces   ", "  ", "\n\n\n", " \n \n", "a  b   c    d",
    "line1\r\nline2\r\n", "12345 67890 3.14159 1e-10 0x1F", "2024-01-01T12:00:00Z", "$100.00 €50 £20 ¥1000",
    "CamelCaseIdentifier snake_case_identifier kebab-case", "https://example.com/path?query=1&b=2#frag",
    "email@example.com", "C'est l'été", "naïve café résumé", "ÅÄÖ åäö", "ﬁ ligature", "zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "", "a", " ", "Ω", "\u00a0nbsp",
]


def _corpus() -> list[str]:
    out = list(BASE)
    variants = [lambda s: " " + s, lambda s: s + "\n", lambda s: s.upper(), lambda s: s + " " + s]
    for s, v in itertools.product(BASE, variants):
        out.append(v(s))
    out += [a + "\n\n" + b for a, b in zip(BASE, reversed(BASE))]
    return out


CORPUS = _corpus()


def test_corpus_is_large_enough():
    assert len(set(CORPUS)) >= 200


@pytest.mark.reference
def test_ids_match_transformers(embedded, hf_embedded):
    _, hf_tokenizer = hf_embedded
    mismatches = [s for s in CORPUS if embedded.tokenizer.encode(s) != hf_tokenizer(s)["input_ids"]]
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(embedded, text):
    tok = embedded.tokenizer
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", [s for s in BASE if any(ord(c) > 127 for c in s)])
def test_streaming_detokenizer_never_splits_a_character(embedded, text):
    tok = embedded.tokenizer
    ids = tok.encode(text)
    detok = tok.detokenizer()
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_spans_several_tokens(embedded):
    """The streaming test above only means something if some characters really are split across tokens."""
    tok = embedded.tokenizer
    ids = tok.encode("🦙")
    assert len(ids) > 1
    detok = tok.detokenizer()
    assert [detok.step(i) for i in ids][:-1] == [""] * (len(ids) - 1)


def test_special_tokens_are_single_ids(embedded):
    tok = embedded.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.eos_token_ids == (2,)
    assert tok.decode([1, 28, 2]) == tok.decode([28])
