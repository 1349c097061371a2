"""Mamba-2's SSD over whole chunks (Dao & Gu 2024), with a hand-written backward (`SSD`): within a
chunk the output is a masked "attention" with decays, ``y_in = (C B^T * L) X`` with ``L[i, j] =
exp(acum_i - acum_j)`` (acum the chunk's cumulative ``dt A``), plus the state entering the chunk
seen through C; each chunk's own state passes on in `pass_states`.

The within-chunk part is factored, ``L[i, j] = e_i / e_j``: all heads that share B and C then take
one product, and no (Q x Q) decay matrix exists; a chunk whose decays span more than float32's
range allows (`MAX_SPAN`) takes the decay matrices, a product per head. On a CPU the
elementwise work around its products runs as five
compiled passes (`_one_pass`), and x enters before dt: ``x dt`` is never materialised, and dt's
gradient through it comes from the pass that forms x's. `zoo_mamba.ssm.ssd_scan` chunks the sequence;
shapes as there, with BK = batch x chunks.
"""

from __future__ import annotations

from typing import Any

import torch

from zoo import kernels


def pass_states(states: torch.Tensor, log_decay: torch.Tensor, h0: torch.Tensor, *, reverse: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each chunk and the last one: ``h_{k+1} = exp(log_decay_k) h_k + states_k``.

    states (G, B*K, N, R*P) each chunk's own contribution, per group as `SSD` computes them;
    log_decay (B, H, K) each chunk's whole decay; h0 (B, H, P, N). One multiply-add per chunk on
    a (G, B, N, R*P) slice, in place and in this layout (a block decay matrix's products needed
    per-head copies). Returns the entering states like ``states`` and the last one (B, H, P, N).

    ``reverse``: the same recurrence from the last chunk to the first, as backward needs it:
    ``d_k = states_k + exp(log_decay_k) d_{k+1}`` from ``d_K = h0``; returns ``d_{k+1}`` for each
    chunk (the gradient of the state it leaves) and ``d_0``."""
    g, _, n, rp = states.shape
    bsz, h, k = log_decay.shape
    r = h // g
    src = states.view(g, bsz, k, n, r, rp // r)
    decay = torch.exp(log_decay).view(bsz, g, r, k).permute(1, 0, 3, 2)[:, :, :, None, :, None]  # (G, B, K, 1, R, 1)
    out = torch.empty_like(src)
    order = range(k - 1, 0, -1) if reverse else range(k - 1)
    first, step = (k - 1, -1) if reverse else (0, 1)
    out[:, :, first] = h0.reshape(bsz, g, r, -1, n).permute(1, 0, 4, 2, 3)  # (G, B, N, R, P)
    # each chunk's views made in one call (indexing them in the loop cost a quarter of its time)
    s, o, d = src.unbind(2), out.unbind(2), decay.unbind(2)
    for i in order:
        torch.addcmul(s[i], o[i], d[i], out=o[i + step])
    end = 0 if reverse else k - 1
    last = torch.addcmul(s[end], o[end], d[end])  # (G, B, N, R, P)
    return out.view(states.shape), last.permute(1, 0, 3, 4, 2).reshape(bsz, h, -1, n)


def _per_group(fn: Any, g: int, dim: int = 0) -> torch.Tensor:
    return torch.stack([fn(i) for i in range(g)], dim) if g > 1 else fn(0).unsqueeze(dim)


def _rows(s: torch.Tensor, g: int) -> torch.Tensor:
    """A per-position, per-head scale (BK, H, Q) as a view that multiplies (BK, Q, G, R, P)."""
    bk, h, q = s.shape
    return s.view(bk, g, h // g, q).permute(0, 3, 1, 2)[..., None]


def _rows_or_none(s: torch.Tensor | None, g: int) -> torch.Tensor | None:
    """`_rows`, or None for a factored-form scale where no chunk is factored."""
    return None if s is None else _rows(s, g)


def _one_pass(name: str, fn: Any, *args: torch.Tensor | None) -> Any:
    """``fn(*args)``, one pass over memory as a compiled kernel where the run's kernels fuse
    (`zoo.kernels.Kernels.fuses`; else eagerly: the same formulas)."""
    k = kernels.active()
    return k.fuse(name, fn, fn, *args) if k.fuses(args[0]) else fn(*args)


# The elementwise work around the products, each a function of (BK, Q, G, R, P) views and (BK, Q,
# G, R, 1) scales, run as one compiled pass (`_one_pass`): as torch's separate operations they
# were ~14 passes over T x H x P floats a layer, among them the gradient's five multiplications
# and two sums in `_input_grads`. The factored form's parts (``X / e``, e, and their gradients) are
# None where no chunk takes it (an accelerator, or every chunk by decay matrices).
def _inputs(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The products' operands from the scan's input x (before dt): ``w * X`` (u = dt w) and ``X / e``
    (v = dt / e)."""
    return x * u, None if v is None else x * v


def _output(y_off: torch.Tensor, from_start: torch.Tensor, inner: torch.Tensor | None, e: torch.Tensor | None
            ) -> torch.Tensor:
    """y: what the entering state adds, ``exp(acum) C S``, and the chunk's own, ``e (scores @ (X / e))``."""
    y = y_off * from_start
    return y if inner is None else y + inner * e


def _output_grads(dy: torch.Tensor, y: torch.Tensor, from_start: torch.Tensor, e: torch.Tensor | None
                  ) -> tuple[torch.Tensor | None, ...]:
    """``sum_p dY y`` (acum's gradient through y's exp(acum_i) factors) and dY scaled for the two
    parts' products."""
    return (dy * y).sum(-1), dy * from_start, None if e is None else dy * e


def _input_grads(dxw: torch.Tensor, dxs: torch.Tensor | None, xw: torch.Tensor, xs: torch.Tensor | None,
                 x: torch.Tensor, to_end: torch.Tensor, inv: torch.Tensor | None, dt: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
    """From the gradients of ``w X`` and ``X / e`` (X = x dt): x's, dt's, and acum's through w
    (``sum_p dXw X w``) and through 1 / e (``sum_p dXs X / e``)."""
    dxdt = dxw * to_end if dxs is None else dxw * to_end + dxs * inv
    return dxdt * dt, (dxdt * x).sum(-1), (dxw * xw).sum(-1), None if dxs is None else (dxs * xs).sum(-1)


def _decay_grad(dstates: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Each chunk's whole decay's gradient per head: ``<d(state after the chunk), state entering it>``."""
    return (dstates * start).sum((2, 4))


def _between_chunks(xw: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor,
                    chunk_decay: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The part that passes states between chunks: each chunk's own state ``B^T (w * X)``
    (w = exp(acum_end - acum); xw (BK, Q, G, R*P)) passed on in `pass_states`, the entering one
    seen through C. Returns ``C S_k`` (BK, Q, G, R, P), a permuted view of the products (y_off but
    for its exp(acum) factor), the entering states and the last state."""
    bk, q, g, rp = xw.shape
    states = _per_group(lambda i: b[:, :, i].transpose(1, 2) @ xw[:, :, i], g)  # (G, BK, N, R*P)
    start, last = pass_states(states, chunk_decay, h0)  # the state entering each chunk (G, BK, N, R*P)
    y_off = _per_group(lambda i: c[:, :, i] @ start[i], g)  # (G, BK, Q, R*P)
    r = chunk_decay.shape[1] // g
    return y_off.view(g, bk, q, r, rp // r).permute(1, 2, 0, 3, 4), start, last


def _between_chunks_backward(dye: torch.Tensor, dacum: torch.Tensor, dlast: torch.Tensor, xw: torch.Tensor,
                             b: torch.Tensor, c: torch.Tensor, start: torch.Tensor, from_start: torch.Tensor,
                             chunk_decay: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`_between_chunks`' gradients from ``dye`` = dY exp(acum) (BK, Q, G, R*P): of ``w * X`` (as
    a (BK, Q, G, R, P) view), B, C and the entering state; the chunks' whole decays' are added
    into ``dacum``."""
    bk, q, g, rp = dye.shape
    h = chunk_decay.shape[1]
    r = h // g
    dstart = _per_group(lambda i: c[:, :, i].transpose(1, 2) @ dye[:, :, i], g)  # (G, BK, N, R*P)
    dc = _per_group(lambda i: dye[:, :, i] @ start[i].transpose(1, 2), g, 2)  # (BK, Q, G, N)
    # the states' recurrence backwards: from the last chunk to the first, dlast entering
    dstates, dh0 = pass_states(dstart, chunk_decay, dlast, reverse=True)  # d(state after chunk k)
    d_decay = _one_pass("ssd_decay_grad", _decay_grad, dstates.view(g, bk, -1, r, rp // r),
                        start.view(g, bk, -1, r, rp // r))  # (G, BK, R)
    dacum[..., -1] += d_decay.permute(1, 0, 2).reshape(bk, h) * from_start[..., -1]
    # each chunk's own state: B^T (w * X)
    db = _per_group(lambda i: xw[:, :, i] @ dstates[i].transpose(1, 2), g, 2)  # (BK, Q, G, N)
    dxw = _per_group(lambda i: b[:, :, i] @ dstates[i], g).view(g, bk, q, r, rp // r).permute(1, 2, 0, 3, 4)
    return dxw, db, dc, dh0


def _cumulative(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's cumulative log decays (BK, H, Q) in float64, and from them the decay from each
    position to its chunk's end and from the chunk's start to each position, float32."""
    acum = a.transpose(1, 2).double().cumsum(-1)
    return acum, torch.exp(acum[..., -1:] - acum).float(), torch.exp(acum).float()


# The factored form's scales reach exp(span / 2) and exp(-span / 2): at 120, e^60 ~ 1e26 leaves
# float32 twelve decades for the products' sums, and e^-60 times an input stays a normal number.
# (Measured against the float64 recurrence: 1e-7 up to a span of 150 with inputs x 100 and B, C
# x 10; at 170 those inputs overflow.) A freshly built 2-layer Mamba-2 at T = 2,048 had spans up
# to 97 and 123 in its two layers (one chunk of 64 over the bound).
MAX_SPAN = 120.0


def _launch_bound(x: torch.Tensor) -> bool:
    """Whether x lives where a step is bound by kernel launches rather than by the work (an
    accelerator): there every chunk takes the decay matrices (choosing per chunk reads the spans on
    the host, a synchronisation per layer that idles the device while the host queues the next
    kernels) and heads share one batched product instead of a loop of per-head ones, which on a
    CPU run from strided views faster than a permuted copy. (Tests patch it to run that path here.)"""
    return x.device.type != "cpu"


def _within_by_matrices(x: torch.Tensor, scores: torch.Tensor, lmat: torch.Tensor) -> torch.Tensor:
    """``(scores * L) X`` per head for some chunks: x (n, Q, H, P), scores (n, G, Q, Q), lmat (n, H,
    Q, Q); a loop over heads reading x as strided views (a permuted copy cost more than the
    product). Returns (n, Q, H, P)."""
    n, q, h, p = x.shape
    g = scores.shape[1]
    mixed = (lmat.view(n, g, h // g, q, q) * scores[:, :, None]).view(n, h, q, q)
    if _launch_bound(x):  # one batched product
        return torch.matmul(mixed, x.transpose(1, 2)).transpose(1, 2)
    out = x.new_empty(h, n, q, p)
    for i in range(h):
        torch.bmm(mixed[:, i], x[:, :, i], out=out[i])
    return out.permute(1, 2, 0, 3)


def _mix_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dY X^T`` per head: dy, x (n, Q, H, P) -> (n, H, Q, Q)."""
    n, q, h, _ = x.shape
    if _launch_bound(x):
        return torch.matmul(dy.transpose(1, 2), x.permute(0, 2, 3, 1))
    out = x.new_empty(h, n, q, q)
    for i in range(h):
        torch.bmm(dy[:, :, i], x[:, :, i].transpose(1, 2), out=out[i])
    return out.permute(1, 0, 2, 3)


class SSD(torch.autograd.Function):
    """Mamba-2's SSD over whole chunks with a hand-written backward.

    Within a chunk, ``L[i, j] = e_i / e_j`` with ``e = exp(acum - m)``, m midway between the chunk's
    first and last cumulative decay (so |acum - m| <= span / 2): ``y_in = e * (tril(C B^T) @ (X /
    e))``, one (Q x Q) by (Q x R*P) product per group for all its R heads, forward and for dX, and
    one (Q x R*P) by (R*P x Q) for the scores' gradient; no (Q x Q) decay matrix exists. acum's
    gradient from y_in's factors is ``sum_p dY y_in`` (the e_i) less ``sum_p X dX_in`` (the 1 / e_j);
    with the ``exp(acum)`` factor of what the entering state adds, the first is ``sum_p dY y``.
    Chunks whose span exceeds `MAX_SPAN` (a head that forgets within the chunk) take the decay
    matrices ``L`` themselves instead, a product per head (`_within_by_matrices`), and their
    exponents' differences in float64 (a chunk's cumulative sum reaches hundreds where dt A is
    large, and float32 differences of such numbers lose digits next to the diagonal, where L is
    near 1); their scales are set to 0 and 1, so the factored products add nothing there. On an
    accelerator every chunk takes the decay matrices (`_launch_bound`).

    Keeps, linear in T: the inputs, the products' operands ``w * X`` and ``X / e`` (recomputing
    them cost more), the masked scores (T x Q x G), the entering states, y (kept by the caller
    anyway), the scales (T x H each) and the decay matrices of the chunks that need them. The
    elementwise work around the products runs as five compiled passes on a CPU (`_inputs`,
    `_output`, `_output_grads`, `_input_grads`, `_decay_grad`).
    x (BK, Q, H, P) the scan's input before dt (any strides: a view of the convolution's output);
    dt (BK, Q, H); a (BK, Q, H) = dt A; b, c (BK, Q, G, N); h0 (B, H, P, N).
    Returns y (BK, Q, H, P) and the last state (B, H, P, N)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bk, q, h, p = x.shape
        g, bsz = b.shape[2], h0.shape[0]
        r = h // g
        acum, to_end, from_start = _cumulative(a)
        scores = _per_group(lambda i: torch.bmm(c[:, :, i], b[:, :, i].transpose(1, 2)), g, 1).tril_()
        chunk_decay = acum[..., -1].float().view(bsz, -1, h).transpose(1, 2)  # (B, H, K)
        e = inv = idx = None
        if not _launch_bound(x):
            wide = (acum[..., 0] - acum[..., -1]).amax(-1) > MAX_SPAN  # (BK,): chunks for the decay matrices
            idx = wide.nonzero().flatten()
            if len(idx) < bk:
                mid = (acum[..., :1] + acum[..., -1:]) / 2
                e = torch.exp(acum - mid).float().masked_fill_(wide[:, None, None], 0.0)  # (BK, H, Q)
                inv = torch.exp(mid - acum).float().masked_fill_(wide[:, None, None], 1.0)
            if len(idx) == bk:
                idx = None
        x5, dtq = x.view(bk, q, g, r, p), dt.transpose(1, 2)  # (dt as the scales' (BK, H, Q))
        xw, xs = _one_pass("ssd_inputs", _inputs, x5, _rows(dtq * to_end, g),
                          _rows_or_none(None if inv is None else dtq * inv, g))
        xw = xw.reshape(bk, q, g, r * p)
        y_off, start, last = _between_chunks(xw, b, c, h0, chunk_decay)
        inner = None
        if e is not None:  # within the chunk: e * (scores @ (X / e)), all of a group's heads at once
            xs = xs.reshape(bk, q, g, r * p)
            inner = _per_group(lambda i: torch.bmm(scores[:, i], xs[:, :, i]), g, 2).view(bk, q, g, r, p)
        y = _one_pass("ssd_output", _output, y_off, _rows(from_start, g), inner, _rows_or_none(e, g))
        y = y.reshape(bk, q, h, p)
        sub = acum if idx is None else acum[idx]
        lmat = (sub[..., :, None] - sub[..., None, :]).float().exp_().tril_()  # exp(> 0) above, then zeroed
        if idx is None:
            y.add_(_within_by_matrices(x * dt[..., None], scores, lmat))
        elif len(idx):
            y.index_add_(0, idx, _within_by_matrices(x[idx] * dt[idx, ..., None], scores[idx], lmat))
        ctx.factored = e is not None
        ctx.save_for_backward(x, dt, xw, xs, b, c, scores, start, y, to_end, from_start, chunk_decay, e, inv, idx,
                              lmat)
        return y, last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor, dlast: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.autocast(dy.device.type, enabled=False):  # (when backward runs inside an autocast region)
            x, dt, xw, xs, b, c, scores, start, y, to_end, from_start, chunk_decay, e, inv, idx, lmat = \
                ctx.saved_tensors
            bk, q, h, p = x.shape
            g = b.shape[2]
            r = h // g
            dy5, y5, x5 = dy.contiguous().view(bk, q, g, r, p), y.view(bk, q, g, r, p), x.view(bk, q, g, r, p)
            dacum, dye, dye_in = _one_pass("ssd_output_grads", _output_grads, dy5, y5, _rows(from_start, g),
                                           _rows_or_none(e, g))
            dacum = dacum.reshape(bk, q, h).transpose(1, 2).contiguous()  # (BK, H, Q): y_i's exp(acum_i) factors
            dxw, db, dc, dh0 = _between_chunks_backward(dye.reshape(bk, q, g, r * p), dacum, dlast, xw, b, c, start,
                                                        from_start, chunk_decay)
            dtq = dt[..., None]
            dxs = xs5 = None
            if ctx.factored:  # within the chunk: y_in = e * (scores @ (x / e))
                dye_in = dye_in.reshape(bk, q, g, r * p)
                dxs = _per_group(lambda i: torch.bmm(scores[:, i].transpose(1, 2), dye_in[:, :, i]), g, 2)
                dxs, xs5 = dxs.view(bk, q, g, r, p), xs.view(bk, q, g, r, p)
                dscores = _per_group(lambda i: torch.bmm(dye_in[:, :, i], xs[:, :, i].transpose(1, 2)), g, 1).tril_()
            else:
                dscores = torch.zeros_like(scores)
            dx, ddt, dw, dw_in = _one_pass("ssd_input_grads", _input_grads, dxw, dxs, xw.view(bk, q, g, r, p), xs5,
                                           x5, _rows(to_end, g), _rows_or_none(inv, g), dtq.view(bk, q, g, r, 1))
            if dw_in is not None:
                dacum.sub_(dw_in.reshape(bk, q, h).transpose(1, 2))  # the 1 / e_j factors: sum_p dX_in X
            dx, ddt, dw = dx.reshape(bk, q, h, p), ddt.reshape(bk, q, h), dw.reshape(bk, q, h).transpose(1, 2)
            dacum.sub_(dw)  # w = exp(acum_end - acum)
            dacum[..., -1] += dw.sum(-1)
            if idx is None or len(idx):  # the decay matrices' chunks: y_in = (scores * L) X per head
                def rows(v: torch.Tensor) -> torch.Tensor:
                    return v if idx is None else v[idx]

                def add_rows(dst: torch.Tensor, v: torch.Tensor, alpha: float = 1) -> None:
                    if idx is None:
                        dst.add_(v, alpha=alpha)
                    else:
                        dst.index_add_(0, idx, v, alpha=alpha)

                xi, dti, dyi, si = rows(x), rows(dtq), rows(dy5.view(bk, q, h, p)), rows(scores)
                n = len(xi)
                dmix = _mix_grad(dyi, xi * dti)  # (n, H, Q, Q)
                dxdt = _within_by_matrices(dyi, si.transpose(-1, -2), lmat.transpose(-1, -2))
                add_rows(dx, dxdt * dti)
                add_rows(ddt, (dxdt * xi).sum(-1))
                dl = (lmat * dmix).view(n, g, r, q, q)  # d(scores * L) * L
                add_rows(dscores, dl.sum(2))
                dl.mul_(si[:, :, None])  # = d(L) * L: L's gradient through acum_i - acum_j
                add_rows(dacum, dl.sum(-2).view(n, h, q), alpha=-1)  # (row sums: in sum_p dY y)
            dc += _per_group(lambda i: dscores[:, i] @ b[:, :, i], g, 2)
            db += _per_group(lambda i: dscores[:, i].transpose(1, 2) @ c[:, :, i], g, 2)
            da = dacum.flip(-1).cumsum(-1).flip(-1).transpose(1, 2)  # acum = cumsum(a)
            return dx, ddt, da, db, dc, dh0
