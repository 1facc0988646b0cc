"""What carrying the aux rows costs a server, per transport: the CPU seconds each hidden-state
number costs the server to send, as bench/transport.py measures them (the transport's CPU over
the same forwards without rows). The JSON path turns every number into a Python float, msgpack
and text across SGLang's three processes (scheduler, detokenizer, tokenizer manager), so its cost
per token grows with the target's width and bounds the tokens/s a server can hand over; the hook
writes the rows' raw bytes from the scheduler. The ceiling counts all of it on one core: with each
process on a core of its own JSON's rises to the busiest process's (723 tokens/s at Kimi's width,
measured), still far below the hook's.

`eagle3 plan` takes a server's throughput as the lower of the assumed forward rate and this
ceiling (eagle3/sweep/plan.py).
"""

from __future__ import annotations

# Server CPU seconds per hidden-state number sent, at Kimi-K2.5's width (3 x 7,168 numbers a
# token): the transport's CPU over the same forwards without rows, all of the server's processes
# (docs/results/2026-12-05-1001-hook-transport.md). At SmolLM2's width (1,728) the same bench
# read 13% more per number for JSON: the cost is per number, not per token. The hook's figure is
# an upper bound (below what subtracting the forward resolves; its code alone costs 11 us a token).
SERVER_CPU_S_PER_NUMBER = {"json": 3527.6e-6 / 21504, "hook": 90.1e-6 / 21504}


def transport_ceiling(transport: str, numbers_per_token: int) -> float:
    """The most tokens/s one server's transport carries: its CPU per token is spent in one process."""
    return 1.0 / (SERVER_CPU_S_PER_NUMBER[transport] * numbers_per_token)
