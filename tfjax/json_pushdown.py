"""response_format json_object as a pushdown automaton whose token tables live on the device (grammar.py walks them).

A lane's position is (flat state, depth, stack): the flat state is one of the byte automaton's states below
(where we are inside a value), `stack` holds the open containers as bits (bit i: the i-th from the top, 1 an
object, 0 an array) and `depth` counts them, the top object included, up to `MAX_DEPTH`; opening one more is
not allowed. The language is RFC 8259 JSON whose top value is an object, with no whitespace before the
opening `{` or after the closing `}` (EOS then ends the reply), and any JSON whitespace inside.

A token's effect is found on the host by running its bytes through the byte automaton from every flat state
with a symbolic stack: what the token pushes itself is known, and each entry below that it must read (a close
checks the kind it pops and whether anything is left beneath; a `,` peeks the top) becomes a branch on
(array, object, absent). A token reading more than `MAX_READS` entries is not allowed on those branches (no
SmolLM2 token has four closing brackets). The result per (state, token) is either a plain move (no stack
effect: the next flat state, stored like a DFA's) or `-(2 + (offset << 3 | reads))`: the token's outcomes
sit at `outcomes[offset + key]`, where `key` encodes the top `reads` entries of the stack at run time (`key`)
and an outcome is (next flat state or -1, pops, pushes, pushed bits, peak: the most containers the token holds
open at once beyond the stack it found, so `{}` is not allowed at `MAX_DEPTH`).
"""

from __future__ import annotations

import numpy as np

MAX_DEPTH = 31  # open containers, the top object included (the stack's bits fit an int32)
MAX_READS = 4  # stack entries one token may read below what it pushed itself
ARRAY, OBJECT, ABSENT = 0, 1, 2  # a stack entry's kind as the symbolic simulation reads it

# flat states: structure, numbers, literals, then strings (key and value flavours)
_STRUCT = ["start", "done", "obj_open", "obj_next", "after_key", "value", "arr_open", "after_value"]
_NUMBER = ["minus", "zero", "int", "dot", "frac", "exp", "exp_sign", "exp_digits"]
_LITERAL = ["t", "tr", "tru", "f", "fa", "fal", "fals", "n", "nu", "nul"]
_STRING = ["str", "esc", "u4", "u3", "u2", "u1", "c1", "c2", "c3", "e0", "ed", "f0", "f4"]
STATES = _STRUCT + _NUMBER + _LITERAL + [f"key_{s}" for s in _STRING] + [f"val_{s}" for s in _STRING]
S = {name: i for i, name in enumerate(STATES)}
START, DONE = S["start"], S["done"]

# byte actions
DIE, MOVE, OPEN_OBJ, OPEN_ARR, CLOSE_OBJ, CLOSE_ARR, COMMA = range(7)
_WS = b" \t\n\r"
_HEX = b"0123456789abcdefABCDEF"
_DIGITS = b"0123456789"


def _byte_table() -> np.ndarray:
    """[state, byte] -> (action, next flat state): the JSON byte automaton without its stack."""
    t = np.zeros((len(STATES), 256, 2), np.int32)  # (DIE, 0) by default

    def put(state: str, chars, action: int, nxt: str = "start"):
        for c in chars if not isinstance(chars, int) else [chars]:
            t[S[state], c] = (action, S[nxt])

    put("start", b"{", OPEN_OBJ, "obj_open")
    for s in ("obj_open", "obj_next", "after_key", "value", "arr_open", "after_value"):
        put(s, _WS, MOVE, s)
    put("obj_open", b'"', MOVE, "key_str")
    put("obj_open", b"}", CLOSE_OBJ)
    put("obj_next", b'"', MOVE, "key_str")
    put("after_key", b":", MOVE, "value")
    for s in ("value", "arr_open"):  # a value starts
        put(s, b'"', MOVE, "val_str")
        put(s, b"{", OPEN_OBJ, "obj_open")
        put(s, b"[", OPEN_ARR, "arr_open")
        put(s, b"-", MOVE, "minus")
        put(s, b"0", MOVE, "zero")
        put(s, b"123456789", MOVE, "int")
        put(s, b"t", MOVE, "t")
        put(s, b"f", MOVE, "f")
        put(s, b"n", MOVE, "n")
    put("arr_open", b"]", CLOSE_ARR)
    put("after_value", b",", COMMA)
    put("after_value", b"}", CLOSE_OBJ)
    put("after_value", b"]", CLOSE_ARR)
    for word in ("true", "false", "null"):
        for i in range(1, len(word)):
            put(word[:i], ord(word[i]), MOVE, word[: i + 1] if i + 1 < len(word) else "after_value")
    # numbers: a byte that cannot continue one ends it and acts as it would after any value
    put("minus", b"0", MOVE, "zero")
    put("minus", b"123456789", MOVE, "int")
    for s in ("zero", "int", "frac", "exp_digits"):
        t[S[s]] = t[S["after_value"]]
    put("int", _DIGITS, MOVE, "int")
    for s in ("zero", "int"):
        put(s, b".", MOVE, "dot")
    for s in ("zero", "int", "frac"):
        put(s, b"eE", MOVE, "exp")
    put("dot", _DIGITS, MOVE, "frac")
    put("frac", _DIGITS, MOVE, "frac")
    put("exp", b"+-", MOVE, "exp_sign")
    put("exp", _DIGITS, MOVE, "exp_digits")
    put("exp_sign", _DIGITS, MOVE, "exp_digits")
    put("exp_digits", _DIGITS, MOVE, "exp_digits")
    for f, closed in (("key_", "after_key"), ("val_", "after_value")):
        put(f + "str", [c for c in range(0x20, 0x80) if c not in b'"\\'], MOVE, f + "str")
        put(f + "str", b'"', MOVE, closed)
        put(f + "str", b"\\", MOVE, f + "esc")
        put(f + "str", range(0xC2, 0xE0), MOVE, f + "c1")  # UTF-8 (RFC 3629): no overlong forms or surrogates
        put(f + "str", 0xE0, MOVE, f + "e0")
        put(f + "str", [*range(0xE1, 0xED), 0xEE, 0xEF], MOVE, f + "c2")
        put(f + "str", 0xED, MOVE, f + "ed")
        put(f + "str", 0xF0, MOVE, f + "f0")
        put(f + "str", range(0xF1, 0xF4), MOVE, f + "c3")
        put(f + "str", 0xF4, MOVE, f + "f4")
        put(f + "esc", b'"\\/bfnrt', MOVE, f + "str")
        put(f + "esc", b"u", MOVE, f + "u4")
        for a, b in (("u4", "u3"), ("u3", "u2"), ("u2", "u1"), ("u1", "str")):
            put(f + a, _HEX, MOVE, f + b)
        for a, b in (("c1", "str"), ("c2", "c1"), ("c3", "c2")):
            put(f + a, range(0x80, 0xC0), MOVE, f + b)
        put(f + "e0", range(0xA0, 0xC0), MOVE, f + "c1")
        put(f + "ed", range(0x80, 0xA0), MOVE, f + "c1")
        put(f + "f0", range(0x90, 0xC0), MOVE, f + "c2")
        put(f + "f4", range(0x80, 0x90), MOVE, f + "c2")
    return t


BYTES = _byte_table()
_ACTION, _NEXT = BYTES[..., 0].tolist(), BYTES[..., 1].tolist()

# A branch of the symbolic simulation: (entries read below the token's own pushes, flat state, kinds the token
# pushed and has not popped (bottom first), entries of the original stack popped, the most containers open at
# once beyond the original stack's: `{}` at MAX_DEPTH opens one too many even though it closes it).
Branch = tuple[tuple[int, ...], int, tuple[int, ...], int, int]


def _read(branch: Branch) -> list[tuple[Branch, int]]:
    """The top entry's kind, branching on an unread entry of the original stack ([] past `MAX_READS`)."""
    read, flat, pushed, pops, peak = branch
    if pushed:
        return [(branch, pushed[-1])]
    if pops < len(read):
        return [(branch, read[pops])]
    if read and read[-1] == ABSENT:  # nothing lies below an absent entry
        return [(branch, ABSENT)]
    if len(read) >= MAX_READS:
        return []
    return [((read + (k,), flat, pushed, pops, peak), k) for k in (ARRAY, OBJECT, ABSENT)]


def step(branch: Branch, byte: int) -> list[Branch]:
    """The branches after one byte ([]: the byte is not allowed on this branch)."""
    read, flat, pushed, pops, peak = branch
    action, nxt = _ACTION[flat][byte], _NEXT[flat][byte]
    if action == MOVE:
        return [(read, nxt, pushed, pops, peak)]
    if action in (OPEN_OBJ, OPEN_ARR):
        if len(pushed) >= MAX_DEPTH:
            return []
        return [(read, nxt, pushed + (OBJECT if action == OPEN_OBJ else ARRAY,), pops,
                 max(peak, len(pushed) + 1 - pops))]
    if action == COMMA:
        return [(r, S["obj_next"] if k == OBJECT else S["value"], p, q, m) for (r, _, p, q, m), k in _read(branch)
                if k != ABSENT]
    if action in (CLOSE_OBJ, CLOSE_ARR):
        want = OBJECT if action == CLOSE_OBJ else ARRAY
        out = []
        for (r, f, p, q, m), k in _read(branch):
            if k != want:
                continue
            popped = (r, f, p[:-1], q, m) if p else (r, f, p, q + 1, m)
            for b, below in _read(popped):  # the value just closed: inside another container, or the reply's end
                out.append((b[0], DONE if below == ABSENT else S["after_value"], b[2], b[3], b[4]))
        return out
    return []


def accepts(data: bytes) -> bool:
    """Whether `data` is a whole reply of the language (the host automaton the token tables are built from)."""
    branches = [((ABSENT,), START, (), 0, 0)]  # an empty stack: every read below is absent
    for byte in data:
        branches = [n for b in branches for n in step(b, byte)]
        if not branches:
            return False
    return any(b[1] == DONE for b in branches)


def key_of(depth: int, stack: int, reads: int) -> int:
    """The outcome key of a stack: k = min(depth, reads) present entries, then (if k < reads) an absent one."""
    k = min(depth, reads)
    return (1 << k) - 1 + (stack & ((1 << k) - 1))


def _entries_of(key: int, reads: int) -> tuple[int, ...]:
    k = (key + 1).bit_length() - 1
    bits = key - ((1 << k) - 1)
    return tuple((bits >> i) & 1 for i in range(k)) + (ABSENT,) * (reads - k)


class _Trie:
    __slots__ = ("children", "ids")

    def __init__(self):
        self.children: dict[int, _Trie] = {}
        self.ids: list[int] = []


def token_tables(spelled: dict[bytes, list[int]], vocab_size: int, eos_ids: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`next` [S, V] i32 and `outcomes` [O, 5] i32 (see the module docstring) for tokens spelled as given;
    tokens not in `spelled` (special ones) are never allowed, and EOS only in `done`."""
    root = _Trie()
    for text, ids in spelled.items():
        node = root
        for byte in text:
            node = node.children.setdefault(byte, _Trie())
        node.ids.extend(ids)
    table = np.full((len(STATES), vocab_size), -1, np.int32)
    groups: dict[tuple, int] = {}
    outcomes: list[tuple[int, int, int, int, int]] = []

    def entry(branches: list[Branch]) -> int:
        if len(branches) == 1 and branches[0][0] == () and branches[0][2] == () and branches[0][3:] == (0, 0):
            return branches[0][1]  # no stack effect: a plain move
        reads = max(len(b[0]) for b in branches)
        group = []
        for key in range((2 << reads) - 1):
            seen = _entries_of(key, reads)
            hit = [b for b in branches if b[0] == seen[: len(b[0])]]
            if not hit:
                group.append((-1, 0, 0, 0, 0))
                continue
            _, flat, pushed, pops, peak = hit[0]
            bits = sum(kind << i for i, kind in enumerate(reversed(pushed)))
            group.append((flat, pops, len(pushed), bits, peak))
        group = tuple(group)
        if group not in groups:
            groups[group] = len(outcomes)
            outcomes.extend(group)
        return -(2 + (groups[group] << 3 | reads))

    for state in range(len(STATES)):
        row = table[state]
        todo = [(root, [((), state, (), 0, 0)])]
        while todo:
            node, branches = todo.pop()
            for byte, child in node.children.items():
                nxt = [n for b in branches for n in step(b, byte)]
                if not nxt:
                    continue
                if child.ids:
                    row[child.ids] = entry(nxt)
                if child.children:
                    todo.append((child, nxt))
    table[DONE, list(eos_ids)] = DONE
    return table, np.asarray(outcomes or [(-1, 0, 0, 0, 0)], np.int32).reshape(-1, 5)
