"""Prompt lookup (n-gram) proposals for speculative decoding: guess a request's next tokens by finding
its last few tokens earlier in its own prompt and output, and proposing what followed them there
(continued as a copy from the same distance back). Why, the index and its costs: docs/speculative.md.
"""

from __future__ import annotations

from collections.abc import Sequence

_TOKEN_BITS = 32  # a child's key is (node << 32) | token: one int, cheaper to hash and store than a tuple
_TOKEN_LIMIT = 1 << _TOKEN_BITS


class NgramIndex:
    """The tokens of one request (prompt and output so far) and, for each n in 1..max_n, the end
    position of the latest earlier occurrence of every n-gram (an occurrence ending before the last
    position). Tokens are vocabulary ids, integers in [0, 2**32).

    A trie of the n-grams read backwards (last token first): the node reached by ``t[q], ..., t[q-n+1]``
    holds the end (q + 1) of that n-gram's latest occurrence. The n-grams ending at the last position
    go in only when the next token arrives, which makes "earlier" exact without a check."""

    _map_type: type[dict[int, int]] = dict  # the trie's child map (a subclass may count its operations)

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, got max_n={max_n}")
        if min_n < 1:
            raise ValueError(f"min_n must be at least 1, got min_n={min_n}")
        if min_n > max_n:
            raise ValueError(f"min_n must be at most max_n, got min_n={min_n} > max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._tokens: list[int] = []
        # The trie: node 0 is the root (the empty n-gram); `_child[(node << 32) | token]` is the node one
        # token further back; `_end[node]` is the end of the latest occurrence of the node's n-gram,
        # that is the position of the token that followed it.
        self._child: dict[int, int] = self._map_type()
        self._end: list[int] = [0]

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens`, indexing the n-grams each one closes off: as token p arrives, those ending
        at p - 1 (the n-grams ending at the new last position wait for the next token)."""
        new = [int(token) for token in tokens]
        if not new:
            return
        if min(new) < 0 or max(new) >= _TOKEN_LIMIT:
            bad = next(token for token in new if not 0 <= token < _TOKEN_LIMIT)
            raise ValueError(f"token ids must lie in [0, 2**{_TOKEN_BITS}), got {bad}")
        seq = self._tokens
        start = max(len(seq), 1)  # the first token closes nothing: there is no position before it
        seq.extend(new)
        self._index(start, None)

    def _index(self, start: int, undo: list | None) -> None:
        """Indexes the n-grams closed off by the tokens from position `start` on; `undo` (when given)
        records each change: a new child's key, or (node, its previous end)."""
        seq, child, end, max_n = self._tokens, self._child, self._end, self.max_n
        for p in range(start, len(seq)):
            node = 0
            # n = 1..max_n: the n-gram seq[p-n..p), read from seq[p-1] backwards
            for q in range(p - 1, max(p - max_n, 0) - 1, -1):
                key = (node << _TOKEN_BITS) | seq[q]
                nxt = child.get(key)
                if nxt is None:
                    nxt = len(end)
                    child[key] = nxt
                    end.append(p)
                    if undo is not None:
                        undo.append(key)
                else:
                    if undo is not None:
                        undo.append((nxt, end[nxt]))
                    end[nxt] = p
                node = nxt

    def propose_after(self, extra: Sequence[int], k: int) -> list[int]:
        """What `propose(k)` would give after `extend(extra)`, the index left as it is (speculative
        decoding's pipelined step: the proposal if the tokens in flight, `extra`, are all accepted)."""
        seq = self._tokens
        length, nodes = len(seq), len(self._end)
        seq.extend(int(token) for token in extra)
        undo: list = []
        try:
            self._index(max(length, 1), undo)
            return self.propose(k)
        finally:
            for change in reversed(undo):
                if isinstance(change, tuple):
                    self._end[change[0]] = change[1]
                else:
                    del self._child[change]
            del self._end[nodes:]
            del seq[length:]

    def propose(self, k: int) -> list[int]:
        """The `k` tokens that followed the latest earlier occurrence of the longest suffix of length
        min_n..max_n that occurred before, read on past the end of the sequence as a copy from the
        same distance back (so the period of a repetition is continued); [] if none did or k <= 0."""
        seq = self._tokens
        if k <= 0 or len(seq) < 2:
            return []
        child = self._child
        node, depth = 0, 0
        last = len(seq) - 1
        # a suffix of length n has an earlier occurrence only if n <= len - 1, which the trie enforces:
        # it holds no n-gram ending at the last position, and none longer than the tokens before it
        for q in range(last, max(last - self.max_n, -1), -1):
            nxt = child.get((node << _TOKEN_BITS) | seq[q])
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        if depth < self.min_n:
            return []
        start = self._end[node]
        proposal = seq[start : start + k]
        if len(proposal) < k:  # the copy runs past the end: it repeats seq[start:] (period len - start)
            proposal = proposal * (k // len(proposal) + 1)
            del proposal[k:]
        return proposal


class NgramProposer:
    """Per request indexes, fed from the requests' token lists."""

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        NgramIndex(max_n, min_n)  # refuse bad bounds now, not at the first request
        self.max_n = max_n
        self.min_n = min_n
        self._indexes: dict[int, NgramIndex] = {}

    def __len__(self) -> int:
        return len(self._indexes)

    def propose(
        self, requests: Sequence[tuple[int, Sequence[int]]], limits: Sequence[int]
    ) -> list[list[int]]:
        """The proposal of each request, at most `limits[i]` tokens for request i (0: none, but its
        tokens are still indexed, so later steps need not catch up).

        `requests` holds (uid, tokens): the prompt, then the output so far. Between calls a request's
        list only grows, and only the tokens past those indexed are read. A list shorter than what
        was indexed for its uid, or disagreeing with it at the last indexed token (recomputed after a
        preemption, or a uid reused), gets a fresh index built from the whole list."""
        if len(requests) != len(limits):
            raise ValueError(f"{len(requests)} requests but {len(limits)} limits")
        proposals = []
        for (uid, tokens), limit in zip(requests, limits):
            index = self._indexes.get(uid)
            seen = 0 if index is None else len(index)
            if index is None or len(tokens) < seen or (seen and tokens[seen - 1] != index._tokens[-1]):
                index = self._indexes[uid] = NgramIndex(self.max_n, self.min_n)
                seen = 0
            if len(tokens) > seen:
                index.extend(tokens[seen:])
            proposals.append(index.propose(limit))
        return proposals

    def propose_after(
        self,
        requests: Sequence[tuple[int, Sequence[int]]],
        extras: Sequence[Sequence[int]],
        ks: Sequence[int],
    ) -> list[list[int]]:
        """Each request's `ks[i]` tokens as `propose` would give them after its tokens and `extras[i]`
        (tokens in flight, supposed accepted), which are not indexed."""
        self.propose(requests, [0] * len(requests))  # index what arrived
        return [
            self._indexes[uid].propose_after(extra, k) for (uid, _), extra, k in zip(requests, extras, ks)
        ]

    def forget(self, uid: int) -> None:
        """Drop a finished request's index (nothing happens for a uid never seen)."""
        self._indexes.pop(uid, None)
