"""Check the CPU kernels of ./sgl_kernel against SGLang's own code, in the SGLang venv.

  * tree building, greedy tree verification and NGRAM's tree reconstruction against SGLang's
    Triton kernels (sglang/kernels/ops/speculative/spec_tree.py, reconstruct_tree.py), run on
    the CPU by the Triton interpreter, on random draft trees shaped as the EAGLE draft loop
    shapes them (sglang's organize_draft_results) and on random NGRAM ancestor masks;
  * the batched attention kernels against one scaled_dot_product_attention per request, for
    decode, causal prefill over a cached prefix, and both tree-mask layouts of verification.

Run (tests/test_sglang_kernels_live.py does):
  SGLANG_USE_CPU_ENGINE=1 TRITON_INTERPRET=1 PYTHONPATH=tools/sglang_cpu \\
      <sglang venv>/bin/python tools/sglang_cpu/check_kernels.py
It prints one line per group and exits non-zero on any difference.
"""

from __future__ import annotations

import sys

import sgl_kernel
import torch
from sglang.kernels.ops.speculative import reconstruct_tree, spec_tree
from sglang.srt.speculative.eagle_utils import organize_draft_results

VOCAB = 50


def draft_tree(g: torch.Generator, bs: int, topk: int, steps: int, ndraft: int):
    """(parent_list, selected_index, draft_tokens) as EAGLE's draft loop hands them over."""
    scores = torch.rand(bs, 1, topk, generator=g)
    score_list, token_list = [scores], [torch.randint(0, VOCAB, (bs, topk), generator=g)]
    parents_list = [torch.arange(-1, topk, dtype=torch.long).unsqueeze(0).repeat(bs, 1)]
    for step in range(1, steps):
        expanded = torch.rand(bs, topk, topk, generator=g) * scores.reshape(bs, topk, 1)
        best, index = torch.topk(expanded.flatten(1), topk, dim=-1)
        score_list.append(expanded)
        token_list.append(torch.randint(0, VOCAB, (bs, topk * topk), generator=g))
        parents_list.append(index + (topk**2 * (step - 1) + topk))
        scores = best
    return organize_draft_results(score_list, token_list, parents_list, ndraft)


def build(fn, parents, selected, seq_lens, topk, steps, n, mode):
    bs = seq_lens.numel()
    size = n * n * bs if mode == 1 else int(seq_lens.sum()) * n + n * n * bs
    mask = torch.full((size,), True)
    positions = torch.empty(bs * n, dtype=torch.long)
    links = torch.full((3, bs, n), -1, dtype=torch.long)
    fn(parents, selected, seq_lens, mask, positions, links[0], links[1], links[2], topk, steps, n, mode)
    return mask, positions, links


def verify(fn, names, candidates, target, links, steps):
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    fn(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates,
        target_predict=target,
        **dict(zip(names, links, strict=True)),
    )
    return predicts, accept_index, accept_num


def check_trees() -> tuple[int, int]:
    same = total = 0
    shapes = [
        (1, 1, 2, 3),
        (2, 1, 3, 4),
        (1, 4, 2, 6),
        (1, 4, 2, 7),
        (3, 4, 3, 8),
        (2, 2, 4, 7),
        (2, 8, 3, 16),
    ]
    for bs, topk, steps, n in shapes:
        for mode in (0, 1):
            for seed in range(3):
                g = torch.Generator().manual_seed(seed)
                parents, selected, drafts = draft_tree(g, bs, topk, steps, n)
                seq_lens = torch.randint(3, 9, (bs,), generator=g)
                args = (parents.contiguous(), selected.contiguous(), seq_lens, topk, steps, n, mode)
                ours = build(sgl_kernel.build_tree_kernel_efficient_cpu, *args[:3], *args[3:])
                theirs = build(spec_tree.sgl_build_tree_kernel_triton, *args[:3], *args[3:])
                # the target agrees with some child at random nodes, so walks go deep
                candidates = torch.cat([torch.randint(0, VOCAB, (bs, 1), generator=g), drafts], 1)
                target = torch.randint(0, VOCAB, candidates.shape, generator=g)
                first_child = ours[2][1]
                agree = (first_child >= 0) & (torch.rand(candidates.shape, generator=g) < 0.7)
                target[agree] = candidates.gather(1, first_child.clamp(min=0))[agree]
                v_ours = verify(
                    sgl_kernel.verify_tree_greedy_cpu,
                    ("retrive_index", "retrive_next_token", "retrive_next_sibling"),
                    candidates, target, ours[2], steps,
                )  # fmt: skip
                v_theirs = verify(
                    spec_tree.verify_tree_greedy_triton,
                    ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"),
                    candidates, target, theirs[2], steps,
                )  # fmt: skip
                ok = all(torch.equal(a, b) for a, b in zip(ours + v_ours, theirs + v_theirs, strict=True))
                same += ok
                total += 1
                if not ok:
                    print(f"  differs: bs {bs} topk {topk} steps {steps} n {n} mode {mode} seed {seed}")
    return same, total


def ngram_mask(g: torch.Generator, n: int) -> torch.Tensor:
    """A random tree over n nodes in BFS order as an ancestor-or-self mask, like NGRAM's."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def check_reconstruct() -> tuple[int, int]:
    same = total = 0
    for bs, n in [(1, 2), (1, 5), (2, 8), (3, 12)]:
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            mask = torch.stack([ngram_mask(g, n) for _ in range(bs)]).reshape(-1)
            seq_lens = torch.randint(3, 40, (bs,), generator=g)
            outs = []
            for fn in (
                sgl_kernel.reconstruct_indices_from_tree_mask,
                reconstruct_tree.reconstruct_indices_from_tree_mask_triton,
            ):
                positions = torch.empty(bs * n, dtype=torch.long)
                links = torch.full((3, bs, n), -1, dtype=torch.long)
                fn(mask, seq_lens, positions, links[0], links[1], links[2], bs, n)
                outs.append((positions, links))
            ok = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            same += ok
            total += 1
            if not ok:
                print(f"  differs: bs {bs} n {n} seed {seed}")
    return same, total


def sdpa(q, k, v, visible, scale):
    """One request, written out in float64: q [L, H, D], k/v [S, Hk, D], visible [L, S] -> [L, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1).transpose(0, 1)  # H, S, D
    v = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(q.double().transpose(0, 1), k.transpose(1, 2)) * scale  # H, L, S
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v).transpose(0, 1).float()


def check_attention() -> tuple[float, int]:
    """The largest difference from per-request float64 attention over a batch of requests."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, pool, worst, cases = 9, 3, 64, 512, 0.0, 0
    k_buf = torch.randn(pool, kv_heads, dim, generator=g)
    v_buf = torch.randn(pool, kv_heads, dim, generator=g)
    req_to_token = torch.randperm(pool, generator=g)[: 4 * 100].view(4, 100).int()
    scale = dim**-0.5
    # decode: 4 rows of different lengths
    lens = torch.tensor([7, 30, 1, 64])
    rpi = torch.tensor([2, 0, 3, 1])
    q = torch.randn(4, heads * dim, generator=g)
    out = torch.empty(4, heads * dim)
    sgl_kernel.decode_attention_cpu(
        q, k_buf, v_buf, None, None, out, None, None, None, None, req_to_token, rpi, lens, scale
    )
    for i in range(4):
        slots = req_to_token[rpi[i], : lens[i]].long()
        ref = sdpa(q[i].view(1, heads, dim), k_buf[slots], v_buf[slots], None, scale)
        worst = max(worst, float((out[i].view(1, heads, dim) - ref).abs().max()))
    cases += 1
    # extend: causal over a cached prefix, then both tree-mask layouts
    ext = torch.tensor([5, 1, 9])
    total = torch.tensor([12, 40, 9])
    rpi = torch.tensor([1, 3, 0])
    starts = torch.cumsum(ext, 0) - ext
    for layout in ("causal", "qlen_only", "full"):
        q = torch.randn(int(ext.sum()), heads, dim, generator=g)
        k_new = torch.randn(int(ext.sum()), kv_heads, dim, generator=g)
        v_new = torch.randn(int(ext.sum()), kv_heads, dim, generator=g)
        masks, flat = [], []
        for L, S in zip(ext.tolist(), total.tolist(), strict=True):
            tree = torch.rand(L, L, generator=g) < 0.5
            tree |= torch.eye(L, dtype=torch.bool)
            visible = torch.ones(L, S, dtype=torch.bool)
            visible[:, S - L :] = torch.ones(L, L, dtype=torch.bool).tril() if layout == "causal" else tree
            if layout == "full":
                visible[:, : S - L] = torch.rand(L, S - L, generator=g) < 0.8
                visible[:, 0] = True
                flat.append(visible.reshape(-1))
            else:
                flat.append(tree.reshape(-1))
            masks.append(visible)
        tree_mask = None if layout == "causal" else torch.cat(flat)
        out = torch.empty_like(q)
        sgl_kernel.extend_attention_cpu(
            q, k_new, v_new, out, k_buf, v_buf, None, None, req_to_token, rpi, total, ext, starts,
            int(ext.max()), scale, tree_mask=tree_mask,
        )  # fmt: skip
        for i, (L, S) in enumerate(zip(ext.tolist(), total.tolist(), strict=True)):
            slots = req_to_token[rpi[i], :S].long()
            k, v = k_buf[slots].clone(), v_buf[slots].clone()
            rows = slice(int(starts[i]), int(starts[i]) + L)
            k[S - L :], v[S - L :] = k_new[rows], v_new[rows]
            ref = sdpa(q[rows], k, v, masks[i], scale)
            worst = max(worst, float((out[rows] - ref).abs().max()))
        cases += 1
    return worst, cases


def main() -> int:
    same, total = check_trees()
    triton = "identical to SGLang's Triton kernels"
    print(f"build_tree + verify_tree_greedy: {same}/{total} random trees {triton}")
    r_same, r_total = check_reconstruct()
    print(f"reconstruct_indices_from_tree_mask: {r_same}/{r_total} random NGRAM trees {triton}")
    worst, cases = check_attention()
    kinds = "decode; extend causal, QLEN_ONLY, FULL_MASK"
    print(f"attention: {cases} cases ({kinds}), max |diff| vs per-request float64 attention {worst:.2e}")
    ok = same == total and r_same == r_total and worst < 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
