"""Pure-torch versions of the `sgl_kernel` CPU kernels that SGLang 0.5.23's speculative paths
call (EAGLE-3 and NGRAM, `--device cpu --attention-backend intel_amx`). NGRAM's n-gram corpus
is not among them: SGLang builds that C++ extension itself at startup (JIT, with g++).

SGLang's CPU speculative path is written against the CPU build of sgl_kernel
(sgl-kernel/csrc/cpu/spec.cpp, kvcache.cpp, decode.cpp, extend.cpp), which PyPI does not ship.
Each function here follows the contract of its C++ kernel (same arguments, same in-place
outputs), written from those sources and from the Triton twins in
sglang/kernels/ops/speculative/; the tree kernels are checked against the Triton ones by
tools/sglang_cpu/check_kernels.py (tests/test_sglang_kernels_live.py).

The two attention kernels do the work of every forward, so they are batched: one padded
gather and one masked attention over all requests (fp32 accumulate, GQA by head groups),
with no Python loop per request. The bookkeeping kernels touch a few integers per request;
their loops cost microseconds. No AMX instruction runs anywhere: `intel_amx` is only the
name of SGLang's CPU attention backend, which calls the two attention kernels below.

Each kernel logs its first call to stderr ("[sgl_kernel cpu] first call of X"), so a server
log says which kernels a run used.
"""

from __future__ import annotations

import ctypes
import sys

import torch
import torch.nn.functional as F

_SEEN: set[str] = set()
# Padded attention scores above this many fp32 elements are computed in groups of requests.
MAX_SCORE_ELEMENTS = 1 << 26


def _first_call(name: str) -> None:
    if name not in _SEEN:
        _SEEN.add(name)
        print(f"[sgl_kernel cpu] first call of {name}", file=sys.stderr, flush=True)


# --- attention (csrc/cpu/decode.cpp, extend.cpp; called by layers/attention/intel_amx_backend.py)


def _unsupported(kernel: str, is_cross_attention, encoder_lens, sinks) -> None:
    if is_cross_attention or encoder_lens is not None or sinks is not None:
        raise NotImplementedError(f"{kernel} (CPU stand-in): cross-attention and attention sinks")


def _scaled(x: torch.Tensor, scale) -> torch.Tensor:
    x = x.float()
    return x if scale in (None, 1.0) else x * scale


def _attend(q, k, v, visible, sm_scale: float, logit_cap: float) -> torch.Tensor:
    """Masked attention of padded requests in fp32: q [B, Lq, H, D], k [B, Lk, Hk, D],
    v [B, Lk, Hk, Dv], visible [B, Lq, Lk] (True = attend) -> [B, Lq, H, Dv]. Query head h reads
    KV head h // (H / Hk), as SGLang's kernels do. Rows with nothing visible come back NaN.
    One fused scaled_dot_product_attention call (GQA included) unless logits are capped."""
    b, lq, h, d = q.shape
    hk = k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # B, heads, L, D
    if not logit_cap or logit_cap <= 0:
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=visible[:, None], scale=sm_scale, enable_gqa=h != hk
        )
        return out.transpose(1, 2)
    qf = qf.reshape(b, hk, h // hk, lq, d)  # B, Hk, G, Lq, D
    scores = torch.matmul(qf, kf.transpose(-1, -2).unsqueeze(2)) * sm_scale
    scores = logit_cap * torch.tanh(scores / logit_cap)
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf.unsqueeze(2))  # B, Hk, G, Lq, Dv
    return out.reshape(b, h, lq, -1).transpose(1, 2)


def decode_attention_cpu(
    query,
    k_cache,
    v_cache,
    key_scale,
    value_scale,
    output,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap=0.0,
    is_cross_attention=False,
    sliding_window=0,
    encoder_lens=None,
    sinks=None,
):
    """One query token per row: store key/value at slots `loc` (when given), then row i attends
    to the slots req_to_token[req_pool_indices[i], :seq_lens[i]] (the last `sliding_window`)."""
    _first_call("decode_attention_cpu")
    _unsupported("decode_attention_cpu", is_cross_attention, encoder_lens, sinks)
    hk, d, dv = k_cache.shape[1], k_cache.shape[-1], v_cache.shape[-1]
    if key is not None and value is not None:
        k_cache[loc.long()] = key.reshape(-1, hk, d).to(k_cache.dtype)
        v_cache[loc.long()] = value.reshape(-1, hk, dv).to(v_cache.dtype)
    rows = query.shape[0]
    if rows == 0:
        return
    lens = seq_lens.long()
    cols = torch.arange(int(lens.max()))
    visible = cols < lens[:, None]
    if sliding_window and sliding_window > 0:
        visible &= cols >= (lens - sliding_window)[:, None]
    slots = req_to_token[req_pool_indices.long(), : cols.numel()].long().masked_fill(~visible, 0)
    k = _scaled(k_cache[slots], key_scale)
    v = _scaled(v_cache[slots], value_scale)
    q = query.reshape(rows, 1, -1, d)
    out = _attend(q, k, v, visible[:, None, :], sm_scale, logit_cap)
    output.view(rows, -1, dv).copy_(out[:, 0].to(output.dtype))


def _extend_group(
    q_all, k_extend, v_extend, k_buffer, v_buffer, scales, req_to_token, rpi, slens, lens, starts,
    mask_flat, mask_offsets, qlen_only, is_causal, sm_scale, logit_cap,
):  # fmt: skip
    """extend_attention_cpu for one group of requests (tensors [B] of that group) -> (query
    rows [n], their outputs [n, H, Dv])."""
    d, dv = k_buffer.shape[-1], v_buffer.shape[-1]
    prefix = slens - lens
    qi = torch.arange(int(lens.max()))
    q_valid = qi < lens[:, None]  # B, Lq
    q_rows = (starts[:, None] + qi).masked_fill(~q_valid, 0)
    kc = torch.arange(int(slens.max()))
    k_valid = kc < slens[:, None]  # B, Lk
    slots = req_to_token[rpi[:, None], kc].long().masked_fill(~k_valid, 0)
    k, v = k_buffer[slots], v_buffer[slots]
    rel = kc - prefix[:, None]  # key position relative to the first new token, B, Lk
    if k_extend is not None and v_extend is not None:
        # the new tokens' keys come from this forward, not from the cache: put them in place
        req, j = q_valid.nonzero(as_tuple=True)
        k[req, prefix[req] + j] = k_extend.reshape(-1, k.shape[2], d)[starts[req] + j].to(k.dtype)
        v[req, prefix[req] + j] = v_extend.reshape(-1, v.shape[2], dv)[starts[req] + j].to(v.dtype)
    rel3 = rel[:, None, :]  # B, 1, Lk
    q3 = qi[None, :, None]  # 1, Lq, 1
    if mask_flat is not None:
        if qlen_only:  # per request L x L over the new tokens; the prefix is always visible
            inside = (rel3 >= 0) & (rel3 < lens[:, None, None])
            index = mask_offsets[:, None, None] + q3 * lens[:, None, None] + rel3.clamp(min=0)
            tree = mask_flat[index.clamp(max=mask_flat.numel() - 1)] & inside
            visible = (rel3 < 0) | tree
        else:  # FULL_MASK: per request L x S over prefix and new tokens
            index = mask_offsets[:, None, None] + q3 * slens[:, None, None] + kc
            visible = mask_flat[index.clamp(max=mask_flat.numel() - 1)]
    elif is_causal:
        visible = rel3 <= q3
    else:
        visible = torch.ones_like(rel3, dtype=torch.bool).expand(-1, qi.numel(), -1)
    visible = visible & k_valid[:, None, :] & q_valid[:, :, None]
    q = q_all[q_rows]
    out = _attend(q, _scaled(k, scales[0]), _scaled(v, scales[1]), visible, sm_scale, logit_cap)
    return q_rows[q_valid], out[q_valid]


def _request_groups(lens: list[int], slens: list[int], heads: int) -> list[slice]:
    """Consecutive requests whose padded scores stay under MAX_SCORE_ELEMENTS together."""
    groups, start, lq, lk = [], 0, 0, 0
    for i, (length, total) in enumerate(zip(lens, slens, strict=True)):
        nlq, nlk = max(lq, length), max(lk, total)
        if i > start and (i - start + 1) * heads * nlq * nlk > MAX_SCORE_ELEMENTS:
            groups.append(slice(start, i))
            start, nlq, nlk = i, length, total
        lq, lk = nlq, nlk
    groups.append(slice(start, len(lens)))
    return groups


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    key_scale,
    value_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap=0.0,
    is_cross_attention=False,
    sliding_window=0,
    encoder_lens=None,
    sinks=None,
    tree_mask=None,
    is_causal=True,
):
    """Request i's extend_seq_lens[i] new tokens (rows extend_start_loc[i]...) attend to its
    seq_lens[i] - extend_seq_lens[i] cached tokens and to the new tokens: causally, all of them,
    or under `tree_mask` (True = visible), laid out per request as L x L over the new tokens
    (QLEN_ONLY) or L x S over the whole sequence (FULL_MASK)."""
    _first_call("extend_attention_cpu")
    _unsupported("extend_attention_cpu", is_cross_attention, encoder_lens, sinks)
    if sliding_window and sliding_window > 0:
        raise NotImplementedError("extend_attention_cpu (CPU stand-in): sliding window")
    if req_pool_indices.numel() == 0:
        return
    d, dv = k_buffer.shape[-1], v_buffer.shape[-1]
    heads = q_extend.reshape(q_extend.shape[0], -1).shape[1] // d
    q_all = q_extend.reshape(-1, heads, d)
    o_all = o_extend.view(-1, heads, dv)
    rpi, slens = req_pool_indices.long(), seq_lens.long()
    lens, starts = extend_seq_lens.long(), extend_start_loc.long()
    mask_flat = tree_mask.reshape(-1) if tree_mask is not None and tree_mask.numel() > 0 else None
    qlen_only = mask_flat is not None and mask_flat.numel() == int((lens * lens).sum())
    per_request = lens * lens if qlen_only else lens * slens
    mask_offsets = torch.cumsum(per_request, 0) - per_request
    for group in _request_groups(lens.tolist(), slens.tolist(), heads):
        rows, out = _extend_group(
            q_all, k_extend, v_extend, k_buffer, v_buffer, (key_scale, value_scale), req_to_token,
            rpi[group], slens[group], lens[group], starts[group], mask_flat, mask_offsets[group],
            qlen_only, is_causal, sm_scale, logit_cap,
        )  # fmt: skip
        o_all[rows] = out.to(o_all.dtype)


# --- KV cache slots (csrc/cpu/kvcache.cpp; kernels/ops/kvcache/cache_move.py) -----------------


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every KV buffer i (address data_ptrs[i], rows of strides[i] bytes):
    row[tgt_loc[j]] = row[src_loc[j]], all sources read before any target is written."""
    _first_call("copy_all_layer_kv_cache_cpu")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    nrows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (nrows * stride)).from_address(address)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(nrows, stride)
        rows[tgt] = rows[src]  # the gather on the right materialises first


def _segments(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments [starts[i], ends[i]): (segment id, position) of every element, in order."""
    lengths = (ends - starts).long()
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    pos = starts.long()[seg] + torch.arange(seg.numel()) - first[seg]
    return seg, pos


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[rpi[i], start[i]:end[i]] = the next end[i] - start[i] slots of out_cache_loc."""
    _first_call("assign_req_to_token_pool_cpu")
    seg, pos = _segments(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[seg], pos] = out_cache_loc[: seg.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """The reverse: out_cache_loc, request after request, = req_to_token[rpi[i], start[i]:end[i]]."""
    _first_call("assign_extend_cache_locs_cpu")
    seg, pos = _segments(start_offset, end_offset)
    out_cache_loc[: seg.numel()] = req_to_token[req_pool_indices.long()[seg], pos].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
):
    """Request i's topk * num_steps draft slots, req_to_token[rpi[i], seq_lens[i]:...], in order."""
    _first_call("assign_draft_cache_locs_contiguous_cpu")
    width = int(topk) * int(num_steps)
    cols = seq_lens.long()[:, None] + torch.arange(width)
    slots = req_to_token[req_pool_indices.long()[:, None], cols]
    out_cache_loc[: slots.numel()] = slots.reshape(-1).to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    """A req_to_token for the draft decode steps: row b * topk + j = request b's prefix slots,
    then the num_steps slots of its candidate j (allocated at seq_len + j * num_steps)."""
    _first_call("build_draft_decode_metadata_cpu")
    topk, num_steps = int(topk), int(num_steps)
    rpi, lens = req_pool_indices.long(), seq_lens.long()
    out = torch.zeros((rpi.numel() * topk, int(pool_len)), dtype=req_to_token.dtype)
    if rpi.numel() == 0:
        return out
    width = int(lens.max()) + num_steps
    cols = torch.arange(width)
    request = rpi.repeat_interleave(topk)[:, None]  # [B * topk, 1]
    length = lens.repeat_interleave(topk)[:, None]
    branch = torch.arange(topk).repeat(rpi.numel())[:, None]
    source = torch.where(cols < length, cols, cols + branch * num_steps)
    keep = cols < length + num_steps
    out[:, :width] = torch.where(keep, req_to_token[request, source.clamp(max=req_to_token.shape[1] - 1)], 0)
    return out


# --- speculative bookkeeping (csrc/cpu/spec.cpp; kernels/ops/speculative/*.py) -----------------


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """The EAGLE verification tree of each request from the draft loop's choices: node 0 is the
    last verified token, node t > 0 is selected_index[t - 1]; a node's parent is the candidate
    that expanded it (parent_list[selected // topk], 0 = the root). Writes per node its position
    (seq_len + depth), first child / next sibling links, and the tree attention mask
    (mode 1 QLEN_ONLY: n x n per request; mode 0 FULL_MASK: n x (seq_len + n), prefix left as given)."""
    _first_call("build_tree_kernel_efficient_cpu")
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"build_tree_kernel_efficient_cpu (CPU stand-in): tree_mask_mode {mode}")
    n, topk = int(draft_token_num), int(topk)
    bs = verified_seq_len.shape[0]
    parents = parent_list.reshape(bs, -1).tolist()
    selected = selected_index.reshape(bs, -1).tolist()
    seq_lens = verified_seq_len.tolist()
    next_token = retrive_next_token.reshape(bs, n).tolist()
    next_sibling = retrive_next_sibling.reshape(bs, n).tolist()
    pos = positions.view(bs, n)
    flat_mask = tree_mask.view(-1)
    mask_start = 0
    for b in range(bs):
        sel, seq_len = selected[b][: n - 1], int(seq_lens[b])
        node_of = {token: i + 1 for i, token in reversed(list(enumerate(sel)))}  # first match wins

        def parent(node: int, b: int = b, sel: list = sel, node_of: dict = node_of) -> int | None:
            """The parent node of `node` (0 = the root), None when its parent was not selected."""
            block = sel[node - 1] // topk
            return 0 if block == 0 else node_of.get(parents[b][block])

        # children linked in reverse order, each new one in front: siblings end up ascending
        for node in range(n - 1, 0, -1):
            up = parent(node)
            if up is None:
                continue
            if next_token[b][up] != -1:
                next_sibling[b][node] = next_token[b][up]
            next_token[b][up] = node
        rows = torch.zeros((n, n), dtype=torch.bool)
        rows[:, 0] = True
        pos[b, 0] = seq_len
        for node in range(1, n):
            level, cur = 0, node
            while cur is not None and cur != 0:
                rows[node, cur] = True
                level += 1
                cur = parent(cur)
            pos[b, node] = seq_len + level
        if mode == 1:
            flat_mask[b * n * n : (b + 1) * n * n] = rows.reshape(-1)
        else:  # FULL_MASK: rows of seq_len + n, the tree part after the prefix
            block = flat_mask[mask_start : mask_start + n * (seq_len + n)].view(n, seq_len + n)
            block[:, seq_len:] = rows
            mask_start += n * (seq_len + n)
    retrive_index.view(-1).copy_(torch.arange(bs * n, dtype=retrive_index.dtype))
    retrive_next_token.view(bs, n).copy_(torch.tensor(next_token, dtype=retrive_next_token.dtype))
    retrive_next_sibling.view(bs, n).copy_(torch.tensor(next_sibling, dtype=retrive_next_sibling.dtype))


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Greedy verification: from the root, descend to the child whose draft token equals the
    target's prediction at the current node, as deep as that goes. Writes the accepted nodes'
    flat indices (accept_index), their count minus the root (accept_token_num), and the target's
    prediction at every accepted node (predicts)."""
    _first_call("verify_tree_greedy_cpu")
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    index = retrive_index.reshape(bs, n).tolist()
    next_token = retrive_next_token.reshape(bs, n).tolist()
    next_sibling = retrive_next_sibling.reshape(bs, n).tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    for b in range(bs):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            child = next_token[b][node]
            while child != -1 and cand[b][child] != target[last]:
                child = next_sibling[b][child]
            if child == -1:
                break
            pred[last] = target[last]
            accepted += 1
            node, last = child, index[b][child]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        pred[last] = target[last]


def reconstruct_indices_from_tree_mask(
    tree_mask,
    verified_seq_len,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    batch_size,
    draft_token_num,
):
    """NGRAM's verification tree from its ancestor mask (n x n per request, mask[i, j] = node j
    is an ancestor of node i or i itself): per node its position (seq_len + number of
    ancestors), its first child (the smallest later node it is an ancestor of) and its next
    sibling (the smallest later node with the same parent; the root has none). The contract of
    sgl_kernel.speculative.reconstruct_indices_from_tree_mask, as
    sglang/kernels/ops/speculative/reconstruct_tree.py spells it out."""
    _first_call("reconstruct_indices_from_tree_mask")
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    node = torch.arange(n)
    ancestors = tree_mask.reshape(bs, n, n).bool() & (node[None, :] < node[:, None])  # [b, i, j]
    positions.view(bs, n).copy_(ancestors.sum(-1) + verified_seq_len.reshape(bs, 1).long())
    retrive_index.view(bs, n).copy_(torch.arange(bs * n).view(bs, n))
    parent = torch.where(ancestors, node, -1).amax(-1)  # [b, i]
    first_child = torch.where(ancestors, node[None, :, None], n).amin(1)  # over rows k, per column
    retrive_next_token.view(bs, n).copy_(torch.where(first_child < n, first_child, -1))
    later = node[None, :, None] > node[None, None, :]  # [1, k, tid]: k after tid
    same = (parent[:, :, None] == parent[:, None, :]) & later
    sibling = torch.where(same, node[None, :, None], n).amin(1)
    retrive_next_sibling.view(bs, n).copy_(torch.where((parent >= 0) & (sibling < n), sibling, -1))


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]."""
    _first_call("fill_bonus_tokens_cpu")
    rows = torch.arange(accept_lens.shape[0]) * int(accept_stride) + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[rows].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc, size=None):
    """The KV slots of the accepted nodes (accept_index != -1), compacted in order."""
    _first_call("fill_accept_out_cache_loc_cpu")
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[: int(size)]
    kept = flat[flat > -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def rotate_input_ids_cpu(input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index=None):
    """Per request: shift its extend segment left by one and write its new token last (or at
    select_index[i]). Written for the multi-layer EAGLE path; the EAGLE-3 path never calls it."""
    _first_call("rotate_input_ids_cpu")
    starts, lens = extend_start_loc.tolist(), extend_seq_lens.tolist()
    for i, (start, length, token) in enumerate(zip(starts, lens, topk_index.tolist(), strict=True)):
        if length > 1:
            input_ids[start : start + length - 1] = input_ids[start + 1 : start + length].clone()
        if length > 0:
            input_ids[int(select_index[i]) if select_index is not None else start + length - 1] = token


ATTENTION_OPS = ("decode_attention_cpu", "extend_attention_cpu")

KERNELS = {
    fn.__name__: fn
    for fn in (
        decode_attention_cpu,
        extend_attention_cpu,
        copy_all_layer_kv_cache_cpu,
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        build_draft_decode_metadata_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
        reconstruct_indices_from_tree_mask,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        rotate_input_ids_cpu,
    )
}


def install_torch_ops() -> None:
    """SGLang's intel_amx backend calls the attention kernels as torch.ops.sgl_kernel.<name>."""
    namespace = torch.ops.sgl_kernel
    for name in ATTENTION_OPS:
        setattr(namespace, name, KERNELS[name])
