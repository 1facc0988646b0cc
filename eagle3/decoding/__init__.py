"""Speculative decoding with an EAGLE-3 drafter (chain, tree, sampling) and its evaluation."""
