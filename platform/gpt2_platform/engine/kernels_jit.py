"""The Triton sources of the decode kernels (engine/kernels.py launches them).

A module of its own so that importing the engine does not import Triton: only a process that launches a
kernel (CUDA, or the interpreter under TRITON_INTERPRET=1) loads it, on its first launch. A CPU worker that
had loaded Triton's native bindings printed their leak reports when it exited.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp: libdevice's is not there in the interpreter. Stable for large |x| (exp -> inf gives 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def ln_linear_kernel(
    x_ptr,  # (B, K) activations, row stride K
    ln_w_ptr,  # (K,) or None
    ln_b_ptr,
    w_ptr,  # (N, K) weight, nn.Linear layout
    bias_ptr,  # (N,) or None
    res_ptr,  # (B, N) residual, or None; may be out_ptr itself
    out_ptr,  # (B, N)
    N,
    eps,
    K: tl.constexpr,
    LN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0: none; else an index in _ACTIVATION_CODES
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One row (grid axis 1) and BLOCK_N output columns (axis 0) a program.
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    ks = tl.arange(0, BLOCK_K)
    # The first block of weights before waiting: it does not depend on the kernel before this one, so
    # under programmatic dependent launch its load overlaps that kernel's last microseconds.
    w_first = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (our input) are visible from here on
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start loading its own weights
    x_row = x_ptr + row * K
    dtype = out_ptr.dtype.element_ty
    if LN:
        # Two passes over the row (K values, cached in L1/L2): the mean, then the variance.
        total = 0.0
        for k0 in tl.static_range(0, K, BLOCK_K):
            xk = tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0)
            total += tl.sum(xk.to(tl.float32), axis=0)
        mean = total / K
        sq = 0.0
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            xk = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            centred = tl.where(k_ok, xk - mean, 0.0)
            sq += tl.sum(centred * centred, axis=0)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        if k0 == 0:
            w = w_first
        else:
            w = tl.load(w_rows + k0 + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        xk = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0)
        if LN:
            g = tl.load(ln_w_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(ln_b_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            # The layer norm's output, rounded to the activation dtype as the model's is.
            xk = tl.where(k_ok, (xk.to(tl.float32) - mean) * rstd * g + beta, 0.0).to(dtype)
        acc += tl.sum(xk.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += bias
    if ACTIVATION != 0:
        # On the rounded linear output, as the model's activation sees it.
        h = acc.to(dtype).to(tl.float32)
        if ACTIVATION == 1:  # GPT-2's GELU, tanh approximation
            acc = 0.5 * h * (1.0 + _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)))
        elif ACTIVATION == 2:  # exact GELU
            acc = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
        elif ACTIVATION == 3:
            acc = tl.maximum(h, 0.0)
        else:  # SiLU
            acc = h / (1.0 + tl.exp(-h))
    out_offsets = row * N + cols
    if RESIDUAL:
        res = tl.load(res_ptr + out_offsets, mask=col_ok, other=0.0).to(tl.float32)
        acc = res + acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + out_offsets, acc.to(dtype), mask=col_ok)


@triton.jit
def decode_attention_kernel(
    qkv_ptr,  # (B, 3C): this step's queries, keys and values
    kv_ptr,  # the layer's cache (slots, 2, H, T, D)
    pos_ptr,  # (B,) each row's position
    out_ptr,  # (B, C)
    scale,
    stride_slot,
    stride_kv,
    stride_head,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
    STAGES: tl.constexpr = 0,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if PDL:  # everything read here comes from the kernels before: wait for them first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    C: tl.constexpr = H * D
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + b)
    row = qkv_ptr + b.to(tl.int64) * 3 * C + h * D
    q = tl.load(row + d).to(tl.float32) * scale
    k_new = tl.load(row + C + d)
    v_new = tl.load(row + 2 * C + d)
    keys = kv_ptr + b.to(tl.int64) * stride_slot + h * stride_head
    values = keys + stride_kv
    # The step's own key and value: stored for later steps, and used here from registers.
    tl.store(keys + pos * D + d, k_new)
    tl.store(values + pos * D + d, v_new)
    m = tl.sum(q * k_new.to(tl.float32), axis=0)  # running max of the scores, starting with our own
    total = 1.0  # running sum of exp(score - m)
    acc = v_new.to(tl.float32)
    # Positions before ours, from the cache: online softmax over blocks of BLOCK_T positions. With STAGES,
    # a `tl.range` loop that Triton software-pipelines (the next block's loads issued before this block's
    # arithmetic); without, a while loop, as Triton's interpreter takes no loaded value as a `range` bound.
    if STAGES > 0:
        for t0 in tl.range(0, pos, BLOCK_T, num_stages=STAGES):
            m, total, acc = _attend_block(keys, values, q, d, t0, pos, m, total, acc, D, BLOCK_T)
    else:
        t0 = 0
        while t0 < pos:
            m, total, acc = _attend_block(keys, values, q, d, t0, pos, m, total, acc, D, BLOCK_T)
            t0 += BLOCK_T
    tl.store(out_ptr + b.to(tl.int64) * C + h * D + d, (acc / total).to(out_ptr.dtype.element_ty))


@triton.jit
def _attend_block(keys, values, q, d, t0, pos, m, total, acc, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """One block of positions [t0, t0 + BLOCK_T) below `pos` folded into the running (max, sum, values)."""
    t = t0 + tl.arange(0, BLOCK_T)
    t_ok = t < pos
    offsets = t.to(tl.int64)[:, None] * D + d[None, :]
    k = tl.load(keys + offsets, mask=t_ok[:, None], other=0.0).to(tl.float32)
    scores = tl.where(t_ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    p = tl.exp(scores - m_new)
    alpha = tl.exp(m - m_new)
    v = tl.load(values + offsets, mask=t_ok[:, None], other=0.0).to(tl.float32)
    return m_new, total * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def cache_write_kernel(
    k_ptr,  # (N, H, D) any strides: the tokens' keys
    v_ptr,
    kv_ptr,  # the layer's cache (slots, 2, H, T, D), contiguous
    slot_ptr,  # (N,) each token's slot
    pos_ptr,  # (N,) each token's position
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_slot,
    stride_kv,
    stride_head,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    i = tl.arange(0, BLOCK)  # (head, dim) of this token, flattened
    ok = i < H * D
    h, d = i // D, i % D
    slot = tl.load(slot_ptr + n).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    k = tl.load(k_ptr + n.to(tl.int64) * stride_kn + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + n.to(tl.int64) * stride_vn + h * stride_vh + d, mask=ok)
    target = kv_ptr + slot * stride_slot + h * stride_head + pos * D + d
    tl.store(target, k, mask=ok)
    tl.store(target + stride_kv, v, mask=ok)


@triton.jit
def add_layer_norm_kernel(
    x_ptr,  # (B, C) the residual stream, updated in place when there is a bias
    bias_ptr,  # (C,) a linear's bias still to be added to x, or None
    ln_w_ptr,
    ln_b_ptr,
    y_ptr,  # (B, C) out: layer_norm(x)
    eps,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    dtype = x_ptr.dtype.element_ty
    if PDL:  # x comes from the GEMM before: wait for it before reading (or writing) it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * C + c, mask=c_ok, other=0.0)
    if HAS_BIAS:
        # The bias the GEMM before left out (it added the residual instead), rounded as a residual add is.
        x = (x.to(tl.float32) + tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(x_ptr + row * C + c, x, mask=c_ok)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=0) / C
    centred = tl.where(c_ok, xf - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / C + eps)
    g = tl.load(ln_w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    beta = tl.load(ln_b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + c, (centred * rstd * g + beta).to(dtype), mask=c_ok)


@triton.jit
def embed_kernel(
    staged_ptr,  # (4, S): token, position, step, fed
    tokens_ptr,  # (S,) what the previous step left
    positions_ptr,
    steps_ptr,
    current_ptr,  # (3, S) out: this step's token, position and step per row
    wte_ptr,
    wpe_ptr,
    x_ptr,  # (B, C) out
    S,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    fed = tl.load(staged_ptr + 3 * S + b) != 0
    token = tl.where(fed, tl.load(staged_ptr + b), tl.load(tokens_ptr + b))
    position = tl.where(fed, tl.load(staged_ptr + S + b), tl.load(positions_ptr + b))
    step = tl.where(fed, tl.load(staged_ptr + 2 * S + b), tl.load(steps_ptr + b))
    tl.store(current_ptr + b, token)
    tl.store(current_ptr + S + b, position)
    tl.store(current_ptr + 2 * S + b, step)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    tok_emb = tl.load(wte_ptr + token * C + c, mask=c_ok, other=0.0)
    pos_emb = tl.load(wpe_ptr + position * C + c, mask=c_ok, other=0.0)
    tl.store(x_ptr + b.to(tl.int64) * C + c, tok_emb + pos_emb, mask=c_ok)
