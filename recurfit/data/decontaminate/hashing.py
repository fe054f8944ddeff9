"""Words and n-grams as 64-bit hashes, by the rule the package docstring states: `words` and `word_hashes` a word
at a time (the rule written plainly), `batch_word_hashes` a batch of texts at once in numpy, `ngram_hashes` the
hash of every run of n words."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

# The ASCII characters neither alphanumeric nor whitespace, and those str.split splits on but bytes.split does not.
ASCII_DELETED = bytes(c for c in range(128) if not chr(c).isalnum() and not chr(c).isspace())
ASCII_SPACES = bytes.maketrans(b"\x1c\x1d\x1e\x1f", b"    ")
# The rule for the rest of ASCII: capitals lower-cased, and every character str.split splits on a 0 byte.
ASCII_RULE = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZ\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ", b"abcdefghijklmnopqrstuvwxyz" + bytes(10)
)
NON_ASCII_NOT_WORD = re.compile(r"[^\x00-\x7f\w\s]")  # \w: the characters str.isalnum accepts (and _)
# splitmix64's finaliser constants: they spread a word's polynomial over 64 bits; P is the polynomials' base.
MIX1, MIX2, P = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def words(text: str) -> list[bytes]:
    """The normalised words of `text` (see the module docstring), as UTF-8 bytes: the rule written plainly, one
    text at a time. `batch_word_hashes` applies the same rule to a batch at once; the tests hold them equal."""
    # bytes.translate deletes the ASCII characters at memory speed; a regular expression, slower, only the rest.
    cleaned = text.lower().encode().translate(ASCII_SPACES, ASCII_DELETED)
    if text.isascii():
        return cleaned.split()
    kept = NON_ASCII_NOT_WORD.sub("", cleaned.decode())
    return " ".join(kept.split()).encode().split()  # str.split splits on Unicode spaces too


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit values that spreads every input bit over all 64."""
    h = (h ^ (h >> np.uint64(30))) * MIX1
    h = (h ^ (h >> np.uint64(27))) * MIX2
    return h ^ (h >> np.uint64(31))


def word_hashes(items: Sequence[bytes]) -> np.ndarray:
    """The 64-bit hash of each word, one word at a time (the reference `batch_word_hashes` is tested against):
    the polynomial Σ byte[j] · P^j (mod 2^64) of its UTF-8 bytes, spread by splitmix64's finaliser."""
    sums = []
    for word in items:
        total, power = 0, 1
        for byte in word:
            total, power = (total + byte * power) % 2**64, power * int(P) % 2**64
        sums.append(total)
    return _mix(np.array(sums, dtype=np.uint64))


class _Powers:
    """P^j and P^-j (mod 2^64) for j = 0, 1, …, grown on demand; and a buffer as long, for the products."""

    def __init__(self, base: int):
        self.base, self.up, self.down = base, np.ones(1, np.uint64), np.ones(1, np.uint64)
        self.buffer = np.empty(1, np.uint64)

    def __call__(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.up) < count:
            size = max(count, 2 * len(self.up))
            inverse = pow(self.base, -1, 2**64)
            self.up = np.multiply.accumulate(np.r_[np.uint64(1), np.full(size - 1, self.base, np.uint64)])
            self.down = np.multiply.accumulate(np.r_[np.uint64(1), np.full(size - 1, inverse, np.uint64)])
            self.buffer = np.empty(size, np.uint64)
        return self.up[:count], self.down[:count], self.buffer[:count]


_POWERS = _Powers(int(P))
_PIECE = 1 << 16  # bytes hashed at a time: the power tables stay this small, in cache (unless a word is longer)
# The non-ASCII characters met so far, each by its UTF-8 bytes read as a big-endian integer (its key): the
# class of its lower case, KEEP (alphanumeric), SPACE (whitespace) or DELETE (the rest), and that lower case's
# key; 0 for the 26 capitals (`Σ`, whose lower case depends on its neighbours, and those whose lower case has
# another length in UTF-8, such as `İ`) that only str.lower, on their whole text, lower-cases as the rule does.
# Built one new character at a time.
KEEP, SPACE, DELETE = 0, 1, 2
_CHARACTERS: dict[int, tuple[int, int]] = {}
_KEY_MASKS = np.array([0xFFFF0000, 0xFFFFFF00, 0xFFFFFFFF], dtype=np.uint32)  # 2-, 3- and 4-byte characters


def _character(key: int) -> tuple[int, int]:
    found = _CHARACTERS.get(key)
    if found is None:
        raw = key.to_bytes(4, "big")
        char = raw[: 2 + (raw[0] >= 0xE0) + (raw[0] >= 0xF0)].decode()
        lower = char.lower()
        if char == "Σ" or len(lower) != 1 or len(lower.encode()) != len(char.encode()):
            found = (KEEP, 0)
        else:
            kind = KEEP if lower.isalnum() else SPACE if lower.isspace() else DELETE
            found = (kind, int.from_bytes(lower.encode().ljust(4, b"\0"), "big"))
        _CHARACTERS[key] = found
    return found


def normalised_bytes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The batch's normalised text as one array of UTF-8 bytes, every run of whitespace a 0 byte, with each
    text's start in it: the texts' words, in order, are the runs of non-zero bytes."""
    # bytes.translate lower-cases the ASCII letters, deletes the other ASCII characters but spaces and turns
    # those into 0 bytes, at memory speed. str.lower (slower on text that is not all ASCII) lower-cases each
    # character on its own but `Σ`, and lower case is idempotent: so the other capitals are lower-cased in
    # place, and str.lower runs only on the texts holding one of the 26 characters `_character` leaves to it.
    parts = [text.encode().translate(ASCII_RULE, ASCII_DELETED) for text in texts]
    for attempt in range(2):
        starts = np.zeros(len(parts), dtype=np.int64)
        np.cumsum([len(part) + 1 for part in parts[:-1]], out=starts[1:])
        joined = b"\0".join(parts)
        data = np.frombuffer(joined, dtype=np.uint8)
        if joined.isascii():
            return data, starts
        # The other characters: each read as one integer from its 2 to 4 bytes, each distinct one looked up once.
        lead = np.flatnonzero(data >= 0xC0)  # a multi-byte character's first byte
        size = 2 + (data[lead] >= 0xE0) + (data[lead] >= 0xF0)
        raw = data[np.minimum(lead[:, None] + np.arange(4), len(data) - 1)].astype(np.uint32)
        keys = ((raw[:, 0] << 24) | (raw[:, 1] << 16) | (raw[:, 2] << 8) | raw[:, 3]) & _KEY_MASKS[size - 2]
        distinct, which = np.unique(keys, return_inverse=True)
        found = [_character(key) for key in distinct.tolist()]
        classes = np.array([kind for kind, _ in found], dtype=np.uint8)[which]
        lowered = np.array([lower for _, lower in found], dtype=np.uint32)[which]
        by_str_lower = lowered == 0
        if attempt == 1 or not by_str_lower.any():
            break
        for i in np.unique(np.searchsorted(starts, lead[by_str_lower], "right") - 1).tolist():
            parts[i] = texts[i].lower().encode().translate(ASCII_RULE, ASCII_DELETED)
    recased = (lowered != keys) & ~by_str_lower  # (none by str.lower is left now: it lower-cased their texts)
    if recased.any():
        data = data.copy()
        for offset in range(4):
            where = recased & (size > offset)
            data[lead[where] + offset] = (lowered[where] >> np.uint32(24 - 8 * offset)).astype(np.uint8)
    changed = classes != KEEP
    if not changed.any():
        return data, starts
    lead, size, classes = lead[changed], size[changed], classes[changed]
    drop = np.zeros(len(data), dtype=bool)
    drop[lead[classes == DELETE]] = True
    for offset in (1, 2, 3):  # the bytes after a deleted or space character's first
        drop[(lead + offset)[size > offset]] = True
    if (classes == SPACE).any():
        data = data.copy() if not recased.any() else data
        data[lead[classes == SPACE]] = 0
    dropped = np.flatnonzero(drop)
    return data[~drop], starts - np.searchsorted(dropped, starts)


def batch_word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of the normalised words of all `texts` (as `word_hashes(words(text))` for each, concatenated),
    and the index of each text's first word in them, with their count at the end."""
    data, text_starts = normalised_bytes(texts)
    word = data != 0
    starts = np.flatnonzero(word[1:] > word[:-1]) + 1  # a word's first byte follows a 0 byte
    if len(data) and word[0]:
        starts = np.r_[0, starts]
    sums = np.empty(len(starts), dtype=np.uint64)
    # Σ byte[j] · P^j over a word starting at s is P^-s · Σ byte[j] · P^j with j counted from anywhere before it:
    # one product per byte, a running sum, and a difference of two running sums per word (0 bytes add nothing),
    # piece by piece of about _PIECE bytes (j counted from the piece's start).
    pieces = np.unique(np.r_[np.searchsorted(starts, np.arange(0, len(data), _PIECE)), len(starts)])
    for lo, hi in zip(pieces[:-1], pieces[1:]):
        begin, end = starts[lo], starts[hi] if hi < len(starts) else len(data)
        up, down, running = _POWERS(end - begin)
        local = starts[lo:hi] - begin
        np.multiply(data[begin:end], up, out=running)
        np.cumsum(running, out=running)
        totals = running[np.r_[local[1:] - 1, end - begin - 1]]  # the running sum at each word's end
        sums[lo:hi] = np.diff(totals, prepend=np.uint64(0)) * down[local]
    return _mix(sums), np.r_[np.searchsorted(starts, text_starts), len(starts)]


def ngram_hashes(hashes: np.ndarray, lengths: Iterable[int]) -> Iterator[tuple[int, np.ndarray]]:
    """For each length L (ascending), the hash of the run of L words starting at each position (Horner's
    Σ_k w[i + k] · P^(L-1-k), mod 2^64), joined from runs of 1, 2, 4, 8, … words: h_(a+b)[i] = h_a[i] · P^b +
    h_b[i + a]."""
    doubled = {1: hashes}  # the runs of 2^k words
    for length in sorted(set(lengths)):
        if length > len(hashes):
            return
        while max(doubled) * 2 <= length:
            half = max(doubled)
            previous = doubled[half]
            count = len(hashes) - 2 * half + 1
            doubled[2 * half] = previous[:count] * _power(half) + previous[half : half + count]
        done, current = 0, None
        for size in sorted(doubled, reverse=True):
            if length - done >= size:
                count = len(hashes) - done - size + 1
                part = doubled[size][done : done + count]
                current = part if current is None else current[:count] * _power(size) + part
                done += size
        yield length, current


def _power(exponent: int) -> np.uint64:
    return np.uint64(pow(int(P), exponent, 2**64))
