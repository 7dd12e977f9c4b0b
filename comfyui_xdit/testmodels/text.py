"""What every tiny test model shares, without a model of its own: the offline tokenizers'
vocabularies (CLIP BPE, T5 unigram, the byte alphabet and a word-merging byte-level BPE) and
the seeded construction of a component (each component's weights from its own seed and salt)."""
from __future__ import annotations

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512

_WORDS = """
a an the of and with in on at to by for from under over near behind inside
cat cats dog dogs bird fish horse cow fox bear lion tiger rabbit mouse owl frog
man woman person people child girl boy face portrait robot astronaut wizard knight
house tree trees forest mountain mountains river lake sea ocean beach sky cloud clouds
sun moon star stars night day city street car bike boat train castle garden flower flowers
field road bridge window door table chair book cup apple food cake
red green blue yellow orange purple pink black white gray brown gold silver
big small tall old young happy sad cute beautiful dark bright colorful
photo picture painting drawing sketch render image art style oil watercolor digital
realistic detailed high quality cinematic lighting sunset sunrise snow rain fog
sitting standing running flying walking sleeping wearing holding
hat glasses shirt dress
""".split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte maps to a printable character, so any
    prompt tokenizes without unknown tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Plain rank-ordered BPE, the algorithm the CLIP tokenizer runs."""
    symbols = list(symbols)
    while len(symbols) > 1:
        pairs = [(ranks.get(p, 1 << 60), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == 1 << 60:
            break
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary: the 512 byte symbols (plain and word-final), merges that make
    each of a few hundred common words one token, then the two special tokens last (as in
    real CLIP, so the legacy argmax-EOS pooling also finds them)."""
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    seen = set(tokens)
    ranks: dict[tuple[str, str], int] = {}
    for word in _WORDS:
        # Merges appended after all earlier ones cannot change how the earlier merges split
        # this word, so chaining the current pieces left to right makes it a single token.
        pieces = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        cur = pieces[0]
        for piece in pieces[1:]:
            ranks.setdefault((cur, piece), len(ranks))
            cur += piece
            if cur not in seen:
                seen.add(cur)
                tokens.append(cur)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, sorted(ranks, key=ranks.get)


def _t5_vocab() -> list[tuple[str, float]]:
    """A Unigram vocabulary in T5's layout (<pad>=0, </s>=1, <unk>=2). Whole words score far
    above single characters, so known words become one token and anything else still
    tokenizes character by character."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -6.0)]
    seen = {p for p, _ in pieces}
    for word in _WORDS:
        for piece in ("▁" + word, "▁" + word.capitalize()):
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, -3.0))
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()/&+"
    for ch in chars:
        for piece in (ch, "▁" + ch):
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, -9.0 if len(piece) == 1 else -8.5))
    return pieces


def _byte_level_bpe(words, specials):
    """A byte-level BPE `tokenizers.Tokenizer` (GPT-2 / Qwen / Tekken style): the 256 byte
    symbols, merges that make each of `words` (with its leading-space marker) one token, then
    `specials`. Any text tokenizes; the listed words cost one token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    space = _bytes_to_unicode()[ord(" ")]
    for word in words:
        pieces = _bpe(list(space + word), ranks)
        cur = pieces[0]
        for piece in pieces[1:]:
            if (cur, piece) not in ranks:
                ranks[(cur, piece)] = len(merges)
                merges.append((cur, piece))
            cur += piece
            vocab.setdefault(cur, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=T5_MAX_LENGTH)


# class name -> config entries replacing a builder's own (tiny_model.build_tiny_model's
# `transformer`: the bench builds a family's block at its released widths); empty normally
CONFIG_OVERRIDES: dict = {}
# class names constructed on the meta device (tiny_model.planned_transformer: sizes only)
ON_META: set = set()


def _seeded(seed: int, salt: int, ctor, *args, **kwargs):
    """Construct one component right after torch.manual_seed(seed, salt): each component's
    weights depend only on (seed, component), not on the order or size of the others."""
    import torch

    torch.manual_seed(seed * 1000 + salt)
    name = getattr(ctor, "__name__", "")
    kwargs.update(CONFIG_OVERRIDES.get(name, {}))
    if name in ON_META:
        with torch.device("meta"):
            return ctor(*args, **kwargs)
    return ctor(*args, **kwargs)
