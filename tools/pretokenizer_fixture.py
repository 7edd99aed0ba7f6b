"""Writes fixtures/tokenizers/pretokenizers.json: the Python `tokenizers` library's encodings of a
few hundred strings under the pre-tokenizers GGUF files name `llama-bpe` (Llama 3) and `qwen2`
(Qwen 2.5 and 3), configured as those models' tokenizer.json configure them, over one byte-level
BPE vocabulary trained here. `tests/integration/tokenizers.rs` writes the vocabulary into a GGUF
file with each `tokenizer.ggml.pre` and checks kvflow encodes every string to the same ids.

    pip install tokenizers==0.22.1
    python3 tools/pretokenizer_fixture.py
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# The Split patterns of Llama 3's and Qwen 2's tokenizer.json (digits: runs of up to three,
# or one at a time).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026 and we've 1,234,567 tokens.",
    "def main():\n    print('hello, world')\n    return 0\n\n\nif __name__ == '__main__':\n    main()\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文文本, 한국어 텍스트 😀👍🏽",
    "fn add(a: u32, b: u32) -> u32 { a + b } // 3.14159 and 0x1F; x += 42;\r\n\tindented\ttabs",
    "I'M SHOUTING, THEY'LL HEAR. You'd think she'd've known. Don't, won't, can't — it's fine...",
    "   leading spaces, trailing spaces   \n\n\n  multiple\n\n blank lines  \t \n",
]

STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n",
    " \n ",
    "Hello world",
    " Hello world",
    "Hello  world",
    "hello\tworld\r\nagain",
    "1",
    "12",
    "123",
    "1234",
    "12345678901",
    "3.14159",
    "1,000,000",
    "v2.0.1-rc3",
    "I'm here, you're there, they've gone, we'll see, he'd know, it's done",
    "I'M HERE, YOU'RE THERE, IT'S DONE",
    "'s 't 're",
    "naïve café Straße",
    "日本語のテキスト",
    "中文文本和数字123",
    "한국어 텍스트",
    "Ελληνικά και русский",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "e\u0301 composed vs \u00e9",  # NFC folds the first into the second under qwen2
    "x  = 1;\n    y = [1, 2, 3]\n",
    "def f(x):\n\treturn x**2  # square\n",
    "<html><body class=\"a\">text</body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "path/to/file.txt and C:\\Windows\\System32",
    "email@example.com https://example.org/a?b=c&d=e",
    "trailing spaces   ",
    "   leading spaces",
    "mixed \r\n line \r endings \n",
    "!!! ??? ... --- ***",
    "a\u00a0non-breaking space and a\u2003em space",
    "zero\u200bwidth",
]


def pad(rng: random.Random) -> str:
    """A random string from pieces of every class the patterns tell apart."""
    pieces = [
        "the", " The", "'s", "'LL", " 42", "2026", "007", " ", "  ", "\t", "\n", "\r\n", "\n\n ",
        "é", "日本", "😀", ",", ".", " ...", "—", "(", ")", "{", "}", "_", "x1", "αβγ", "д", "\u00a0",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))


def tokenizer_for(vocab: dict, merges: list, pattern: str, nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def main() -> None:
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_tok.train_from_iterator(CORPUS * 20 + STRINGS * 5, trainer=trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    rng = random.Random(7)
    strings = STRINGS + CORPUS + [pad(rng) for _ in range(260)]
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    cases = {}
    for name, pattern, nfc in [("llama-bpe", LLAMA3, False), ("qwen2", QWEN2, True)]:
        tok = tokenizer_for(vocab, pairs, pattern, nfc)
        cases[name] = [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in strings]
    out = Path(__file__).resolve().parent.parent / "fixtures/tokenizers/pretokenizers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    fixture = {
        "generated_by": "tools/pretokenizer_fixture.py with tokenizers " + __import__("tokenizers").__version__,
        "tokens": tokens,
        "merges": merges,
        "cases": cases,
    }
    out.write_text(json.dumps(fixture, ensure_ascii=False, indent=0) + "\n")
    differ = sum(a["ids"] != b["ids"] for a, b in zip(cases["llama-bpe"], cases["qwen2"]))
    print(f"{out}: {len(tokens)} tokens, {len(merges)} merges, {len(strings)} strings, {differ} encoded differently by the two")


if __name__ == "__main__":
    main()
