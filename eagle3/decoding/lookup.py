"""Prompt lookup as a tree branch: the tokens that followed the context's latest n-gram before.

Small models repeat the prompt and themselves (names, code, lists), and a drafter of one layer
learns that copying only slowly; a string match finds it for free. The engine grafts this
continuation onto the draft tree (`tree.graft_chain`) so that one verification tries both.
"""

from __future__ import annotations


def lookup_continuation(context: list[int], max_tokens: int, max_ngram: int = 3) -> list[int]:
    """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
    context's last n-gram, longest n (<= max_ngram) first; [] when nothing matches."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        suffix = context[-n:]
        # most recent occurrence first: in a repetition the latest copy predicts best
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + max_tokens]
                if follow:
                    return follow
    return []
