"""Numpy reference of the emulator's synthetic Qwen3 model: the test oracle.

Bit-exact twin of ``calrt/emu_engine.c`` (u64 arithmetic mod 2**64):

* ``sm(z)`` splitmix64 finaliser; ``mix(s, tok, pos)`` advances a sequence state;
* the state of every sequence at length 0 is ``sm(calbin_seed)``;
* ``logits_bf16(s)``: BF16 bits, value ``(b - 128) / 32`` with
  ``b = ((s ^ i * 0x9E3779B97F4A7C15) * 0xD6E8FEB86659FD93) >> 56`` and the unique argmax
  ``s % V`` set to 8.0 (0x4100); a model's salt is XORed into ``s`` first;
* prefill output ``[1, D0, V]``: the last tile of the job's tokens, rows past the end zero;
* embeds path: the token of a row is ``fnv1a32`` of the row's BF16 bytes.
"""

from __future__ import annotations

import numpy as np

from calexec.drivers.synthetic.calbin import VOCAB

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
POS_MUL = 0xC2B2AE3D27D4EB4F
MIX_XOR = 0xD1B54A32D192ED03
LOGIT_MUL = 0xD6E8FEB86659FD93
ARGMAX_BF16 = 0x4100

_index_mul: dict[int, np.ndarray] = {}


def sm(z: int) -> int:
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def mix(state: int, token: int, pos: int) -> int:
    """The state after one more position (token and pos taken as u32, like the device)."""
    return sm(state ^ (((token & 0xFFFFFFFF) * GOLDEN) & MASK) ^ (((pos & 0xFFFFFFFF) * POS_MUL) & MASK) ^ MIX_XOR)


def initial_state(seed: int) -> int:
    return sm(seed)


def fnv1a32(data: bytes) -> int:
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def embed_tokens(embeds: np.ndarray) -> list[int]:
    """Token of each row of a [n, hidden] BF16 (uint16) array, as the device derives it."""
    rows = np.ascontiguousarray(embeds, dtype=np.uint16)
    return [fnv1a32(rows[r].tobytes()) for r in range(rows.shape[0])]


def logits_bf16(state: int, vocab: int = VOCAB, salt: int = 0) -> np.ndarray:
    """BF16 bits (uint16[vocab]) of the logits of state."""
    mul = _index_mul.get(vocab)
    if mul is None:
        mul = _index_mul[vocab] = np.arange(vocab, dtype=np.uint64) * np.uint64(GOLDEN)
    s = (state ^ salt) & MASK
    x = (np.uint64(s) ^ mul) * np.uint64(LOGIT_MUL)
    b = (x >> np.uint64(56)).astype(np.int32)
    f = (b - 128).astype(np.float32) * np.float32(0.03125)
    out = (f.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    out[s % vocab] = ARGMAX_BF16
    return out


def argmax_token(state: int, vocab: int = VOCAB, salt: int = 0) -> int:
    """The greedy next token of state (the unique argmax of its logits)."""
    return ((state ^ salt) & MASK) % vocab


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def advance(state: int, tokens: list[int], past: int) -> list[int]:
    """States after each of tokens placed at positions past, past+1, ...: len(tokens)+1 items."""
    states = [state]
    for i, tok in enumerate(tokens):
        states.append(mix(states[-1], int(tok), past + i))
    return states


def prefill_output(states: list[int], tile_d0: int, vocab: int = VOCAB, salt: int = 0) -> np.ndarray:
    """The prefill logits tensor [1, tile_d0, vocab] for a job whose chain is states."""
    n = len(states) - 1
    if n < 1:
        raise ValueError(f"prefill needs at least one token, got {n}")
    out = np.zeros((1, tile_d0, vocab), dtype=np.uint16)
    start = ((n - 1) // tile_d0) * tile_d0
    for r in range(tile_d0):
        if start + r < n:
            out[0, r] = logits_bf16(states[start + r + 1], vocab, salt)
    return out


def valid_row(n: int, tile_d0: int) -> int:
    """Row of the prefill output tile holding the last token's logits."""
    return (n - 1) % tile_d0


class OracleSequence:
    """The device KV of one sequence, mirrored: states after each committed position."""

    def __init__(self, seed: int, salt: int = 0, vocab: int = VOCAB) -> None:
        self.states = [initial_state(seed)]
        self.salt = salt
        self.vocab = vocab

    @property
    def length(self) -> int:
        return len(self.states) - 1

    def run(self, tokens: list[int], past: int | None = None) -> list[int]:
        """Execute a job of tokens at past (default: the committed length); returns its chain."""
        past = self.length if past is None else past
        if past > self.length:
            raise ValueError(f"past {past} beyond committed length {self.length}")
        chain = advance(self.states[past], tokens, past)
        self.states = self.states[: past + 1] + chain[1:]
        return chain

    def prefill(self, tokens: list[int], tile_d0: int, past: int | None = None) -> np.ndarray:
        return prefill_output(self.run(tokens, past), tile_d0, self.vocab, self.salt)

    def decode(self, token: int) -> np.ndarray:
        chain = self.run([token])
        return logits_bf16(chain[-1], self.vocab, self.salt).reshape(1, 1, self.vocab)

    def next_token(self) -> int:
        return argmax_token(self.states[-1], self.vocab, self.salt)
