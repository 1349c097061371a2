"""Mixture of experts: router, dropless dispatch, experts, and the statistics load balancing needs.

A core primitive (not a plugin's) so any family can put experts in a block: the MoE decoders of
``zoo-moe`` and the ``E`` symbol of a hybrid Mamba stack build the same `MoE` layer from a
`zoo.spec.MoESpec`. Like `zoo.nn.AttentionCore`, the layer is plain single-process code with a
few fields the core sets from outside (`zoo.parallel.engine`): ``ep_group`` shards the experts over
expert-parallel ranks (tokens then travel by all-to-all), ``stats_group`` sums the routing
statistics over ranks that hold other tokens of the same sequences (sequence and context parallel).

Shapes: N tokens, D hidden, E experts (``E_l`` on this rank), k experts per token, F expert width.
Experts are two 3-D parameters, ``gate_up`` (E, 2F, D) (``[gate; up]`` rows per expert, Hugging
Face's fused layout; (E, F, D) for an ungated MLP) and ``down`` (E, D, F).

Dispatch is dropless by default: the (token, expert) assignments are sorted by expert once, so each
expert's tokens are one contiguous slice (no per-expert mask scans), run through the expert as one
GEMM per slice (or one grouped GEMM where torch has a working one for the device), scaled by their
gate and summed back per token. A capacity factor drops the assignments over capacity instead.

Load balancing is computed from per-layer sufficient statistics (`stats_width` columns per MoE
layer: tokens per expert, router probability per expert, sum of squared log-sum-exp, the
sequence-wise balance term, token count, dropped assignments). The model carries them to its loss
(across pipeline stages too), where `balance_losses` turns them into the Switch aux loss
(Megatron's per-layer convention, Hugging Face's layer-pooled one, or Megatron's per-sequence
``seq_aux_loss``) and the z-loss, so balancing never depends on a flag the user forgets.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from zoo.nn import Float32Buffers
from zoo.nn.linear import Linear
from zoo.nn.moe_experts import ExpertMLPs, grouped_mm_works
from zoo.spec import MoESpec, check_routing

AuxConvention = Literal["megatron", "hf", "sequence"]


def stats_width(num_experts: int) -> int:
    """Columns of one MoE layer's statistics row: counts (E), probability sums (E), z sum, sequence
    term, tokens, dropped."""
    return 2 * num_experts + 4


class _SumStats(torch.autograd.Function):
    """Sum a statistics row over ranks holding other tokens of the same sequences. Every rank then
    computes the same balancing loss; backward hands each rank the gradient of its own part, times
    ``scale`` where the loss is averaged (not summed) over those ranks afterwards (context parallel)."""

    @staticmethod
    def forward(ctx: Any, row: torch.Tensor, group: Any, scale: float) -> torch.Tensor:
        from zoo.parallel import comm

        ctx.scale = scale
        return comm.all_reduce(row.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.scale if ctx.scale != 1 else grad, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits (rows), its own conjugate with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        out = grad.new_empty((sum(out_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return out, None, None, None


class Router(Float32Buffers):
    """Token-choice top-k router: ``logits = x W^T`` (in fp32, autocast or not), scores by softmax or sigmoid over all
    experts, top-k chosen on the scores (plus ``expert_bias`` when aux-loss-free balancing is on),
    gates = the chosen unbiased scores, renormalised to sum to one when ``normalize``, times ``scale``
    (DeepSeek-V3's routed_scaling_factor).

    ``groups > 1``: group-limited routing (DeepSeek-V2's device-limited, V3's node-limited): the
    experts form ``groups`` equal groups, each scored by the sum of its top ``top_k // group_topk``
    choice values, and the top-k is taken inside the best ``group_topk`` groups only. This is
    megatron-core's rule; Hugging Face's DeepSeek-V3 sums the top 2, the same for its configs
    (top_k = 2 x group_topk). A renormalised softmax chooses on the logits, as Megatron's (the same
    top-k; the group sums differ)."""

    force: tuple[int, ...] | None = None  # tests: every token goes to these experts (idle experts on purpose)
    float32_buffers = ("expert_bias",)  # (its own state: a bf16 copy would stop moving, see Float32Buffers)

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str, normalize: bool,
                 expert_bias: bool = False, groups: int = 1, group_topk: int = 1, scale: float = 1.0) -> None:
        super().__init__()
        check_routing(num_experts, top_k, groups, group_topk)
        self.num_experts, self.top_k, self.score, self.normalize = num_experts, top_k, score, normalize
        self.groups, self.group_topk, self.scale = groups, group_topk, scale
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias moved against the load each step.
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)
        self.tokens_per_expert = torch.zeros(num_experts)  # since the last bias update (not state)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> gates (N, k) fp32, experts (N, k), logits (N, E) fp32, scores (N, E) fp32."""
        # fp32 under autocast too (Megatron's moe_router_dtype=fp32): a token's experts should not
        # flip on the bf16 rounding of near-tied logits; E columns, a negligible product.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        choose = scores if self.expert_bias is None else scores.detach() + self.expert_bias
        if self.groups > 1:
            if self.score == "softmax" and self.normalize and self.expert_bias is None:
                choose = logits
            per = self.num_experts // self.groups
            best = choose.detach().view(-1, self.groups, per).topk(self.top_k // self.group_topk, dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.group_topk, dim=-1).indices, True)
            choose = choose.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        experts = torch.topk(choose, self.top_k, dim=-1).indices
        if self.force is not None:
            experts = torch.tensor(self.force, device=x.device).expand(x.shape[0], self.top_k)
        gates = scores.gather(1, experts)
        # (top-1 too: its gate is then 1.0, as in Mixtral's and Qwen's own code and Megatron's post-softmax
        # top-k; the router learns through the balancing loss alone)
        if self.normalize:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        if self.scale != 1.0:
            gates = gates * self.scale
        if self.expert_bias is not None and torch.is_grad_enabled():
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
            self.tokens_per_expert = self._counted(counts.device) + counts
        return gates, experts, logits, scores

    def _counted(self, device: torch.device) -> torch.Tensor:
        """The tokens counted since the last update, on ``device``. (Not a buffer, so a router built
        on the meta device, as `zoo train` builds models, keeps a meta tensor here: nothing counted.)"""
        if self.tokens_per_expert.is_meta:
            return torch.zeros(self.num_experts, device=device)
        return self.tokens_per_expert.to(device)

    @torch.no_grad()
    def update_bias(self, rate: float, group: Any = None) -> None:
        """Once per optimizer step: ``bias += rate * sign(mean load - load)`` with the loads summed
        over ``group`` (every rank that routed other tokens through this layer)."""
        if self.expert_bias is None:
            return
        from zoo.parallel import comm

        counts = comm.all_reduce(self._counted(self.expert_bias.device).clone(), group)
        if counts.sum() > 0:
            self.expert_bias += rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert = torch.zeros_like(counts)


class MoE(nn.Module):
    """Routed experts (and an optional gated shared expert) replacing a block's MLP.

    ``forward(x)`` maps (B, T, D) to (B, T, D) and leaves this call's statistics row (see
    `stats_width`) in ``self.stats``, which the model accumulates and hands to its loss.
    """

    def __init__(self, spec: MoESpec, *, hidden: int, ffn_hidden: int, num_experts: int, top_k: int,
                 shared_ffn_hidden: int = 0, capacity_factor: float | None = None,
                 drop_policy: Literal["probs", "position"] = "probs", expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, router_groups: int = 1, router_group_topk: int = 1,
                 router_scaling: float = 1.0, sequence_stats: bool = False) -> None:
        super().__init__()
        from zoo.nn import ACTIVATIONS

        if spec.expert.bias:
            raise ValueError("MoESpec: expert MLPs with biases are not supported (no MoE model has them)")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive (or None: dropless)")
        self.spec, self.num_experts, self.top_k = spec, num_experts, top_k
        self.sequence_stats = sequence_stats  # the per-sequence balance term (aux_loss_convention "sequence")
        self.capacity_factor, self.drop_policy, self.bias_update_rate = capacity_factor, drop_policy, bias_update_rate
        self.gated, self.activation, self.act = spec.expert.gated, spec.expert.activation, ACTIVATIONS[spec.expert.activation]
        self.router = Router(hidden, num_experts, top_k, score="softmax" if spec.router == "softmax_topk" else "sigmoid",
                             normalize=spec.normalize_topk, expert_bias=expert_bias, groups=router_groups,
                             group_topk=router_group_topk, scale=router_scaling)
        self.gate_up = nn.Parameter(torch.empty(num_experts, ffn_hidden * (2 if self.gated else 1), hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.shared: nn.Module | None = None
        self.shared_gate: nn.Linear | None = None
        if spec.shared_expert is not None:
            from zoo.nn.layers import MLP

            self.shared = MLP(spec.shared_expert, hidden=hidden, ffn_hidden=shared_ffn_hidden)
            self.shared_gate = Linear(hidden, 1, bias=False) if spec.shared_gate else None
        # Set from outside (zoo.parallel.engine); read only here.
        self.ep_group: Any = None
        self.ep_size, self.ep_rank = 1, 0
        self.etp_group: Any = None  # expert tensor parallelism: each expert's MLP split over these ranks
        self.etp_size = 1
        self.dispatcher: Literal["alltoall", "allgather"] = "alltoall"
        self.stats_group: Any = None
        self.stats_scale = 1.0
        self.stats: torch.Tensor | None = None

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        gates, experts, logits, scores = self.router(flat)
        n, k = experts.shape
        flat_e = experts.reshape(-1)
        order = torch.argsort(flat_e, stable=True) if self.drop_policy == "position" or self.capacity_factor is None \
            else _by_expert_then_gate(flat_e, gates.detach().reshape(-1))
        counts = torch.bincount(flat_e, minlength=self.num_experts)
        dropped = torch.zeros((), device=x.device)
        if self.capacity_factor is not None:  # keep the first `capacity` of each expert's slice
            capacity = math.ceil(n * k / self.num_experts * self.capacity_factor)
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(order.numel(), device=x.device) - starts.repeat_interleave(counts)
            keep = pos < capacity
            dropped = (~keep).sum().float()
            order = order[keep]
            counts = counts.clamp(max=capacity)
        if self.ep_size > 1 and self.dispatcher == "allgather":
            out = self._gather_dispatch(flat, gates, flat_e, order)
        else:
            token = order // k
            picked = gates.reshape(-1)[order]  # gate of each kept assignment (gradients reach the router)
            xs = flat.index_select(0, token)
            ys = self._dispatch(xs, counts) if self.ep_size > 1 else self._split_experts(xs, counts)
            ys = (ys.float() * picked[:, None]).to(x.dtype)
            # summed into a (B, T, D) tensor, not viewed as one: a module under FSDP must not return a view
            out = x.new_zeros(b, t, d)
            out.view(n, d).index_add_(0, token, ys)
        y = out if out.dim() == 3 else out.view(b, t, d)
        if self.shared is not None:
            shared = self.shared(x)
            y = y + (torch.sigmoid(self.shared_gate(x)) * shared if self.shared_gate is not None else shared)
        self.stats = self._statistics(experts, logits, scores, n, dropped, b)
        return y

    def _statistics(self, experts: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, n: int,
                    dropped: torch.Tensor, batch: int) -> torch.Tensor:
        """[tokens per expert (E) | router probability summed over tokens (E) | sum of lse^2 | sequence
        term | N | dropped]. The probabilities are the softmax over all experts (sigmoid scores
        normalised to sum to one), unbiased: the Switch loss's P_i, as Megatron and HF compute it."""
        with torch.no_grad():
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
        probs = scores if self.router.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        z = torch.logsumexp(logits, dim=-1).square().sum()
        seq = self._sequence_term(experts, probs, batch) if self.sequence_stats else z.new_zeros(())
        tail = torch.stack([torch.full((), float(n), device=logits.device), dropped.float()])
        row = torch.cat([counts, probs.sum(0), z[None], seq[None], tail])
        if self.stats_group is not None:
            row = _SumStats.apply(row, self.stats_group, self.stats_scale)
        return row

    def _sequence_term(self, experts: torch.Tensor, probs: torch.Tensor, batch: int) -> torch.Tensor:
        """Megatron's ``seq_aux_loss`` (DeepSeek-V3's sequence-wise balance loss) before its
        coefficient: the Switch loss of each sequence of the micro-batch, ``E sum_i f_bi P_bi`` with
        f_bi the fraction of sequence b's assignments routed to expert i and P_bi its mean router
        probability over the sequence, averaged over the sequences. A rank holding part of each
        sequence (sequence or context parallel) counts the whole sequence's assignments (summed over
        ``stats_group``) and adds its own tokens' probabilities: summed over the group by the
        statistics row, the term is the whole sequences'."""
        e, k = self.num_experts, self.top_k
        with torch.no_grad():
            rows = experts.view(batch, -1, k)
            counts = torch.zeros(batch, e, device=probs.device).scatter_add_(
                1, rows.flatten(1), torch.ones(rows.flatten(1).shape, device=probs.device))
            if self.stats_group is not None:
                from zoo.parallel import comm

                counts = comm.all_reduce(counts, self.stats_group)
            tokens = counts.sum(1, keepdim=True) / k  # each sequence's length, all of it
        p = probs.view(batch, -1, e).sum(1)  # (B, E): this rank's tokens of each sequence
        return (e * (counts / (tokens * k)) * (p / tokens)).sum() / batch

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Rows of ``xs`` sorted by (local) expert, ``counts`` per expert -> expert outputs, same order."""
        from zoo.nn import gated_activation

        if xs.is_cuda and grouped_mm_works(xs.device, xs.dtype):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
            h = gated_activation(h, self.activation) if self.gated else self.act(h)
            return torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
        if torch.is_autocast_enabled(xs.device.type):  # the dtype F.linear would compute in
            xs = xs.to(torch.get_autocast_dtype(xs.device.type))
        return ExpertMLPs.apply(xs, gate_up, down, counts.tolist(), self.act, self.gated)

    def _dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallel: assignments sorted by global expert go to the rank holding it (counts
        exchanged first), run there sorted by local expert, and come back in the same order."""
        import torch.distributed as dist

        ep, el = self.ep_size, self.local_experts
        send_counts = counts.view(ep, el)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = _AllToAll.apply(xs, out_splits, in_splits, self.ep_group)  # (source rank, expert) order
        local_expert = torch.arange(el, device=xs.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        perm = torch.argsort(local_expert, stable=True)  # -> expert-major
        ys = self._split_experts(recv.index_select(0, perm), recv_counts.sum(0))
        back = torch.empty_like(ys).index_copy(0, perm, ys) if ys.shape[0] else ys
        return _AllToAll.apply(back, in_splits, out_splits, self.ep_group)

    def _split_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`_experts` on this rank's experts; under expert tensor parallelism (Megatron's ETP) each
        expert's MLP is split over ``etp_group`` (gate/up by rows, down by columns): the ranks'
        rows are gathered, each computes its part of every row (regrouped by expert), and the
        partial outputs are summed back to the rows' own rank (an all-to-all each way)."""
        if self.etp_size == 1:
            return self._experts(xs, counts, self.gate_up, self.down)
        from zoo.parallel import comm

        t, n = self.etp_size, xs.shape[0]
        sizes = comm.all_gather(counts, self.etp_group, 0).view(t, -1)  # (etp rank, local expert): rows
        totals = sizes.sum(1).tolist()
        rows = _AllToAll.apply(xs.repeat(t, 1), totals, [n] * t, self.etp_group)  # every rank's rows, rank-major
        expert = torch.arange(counts.numel(), device=xs.device).repeat(t).repeat_interleave(sizes.reshape(-1))
        perm = torch.argsort(expert, stable=True)  # -> expert-major
        ys = self._experts(rows.index_select(0, perm), sizes.sum(0), self.gate_up, self.down)
        back = torch.empty_like(ys).index_copy(0, perm, ys) if ys.shape[0] else ys
        partial = _AllToAll.apply(back, [n] * t, totals, self.etp_group)  # each rank's part of this rank's rows
        return partial.view(t, n, -1).sum(0)

    def _gather_dispatch(self, flat: torch.Tensor, gates: torch.Tensor, flat_e: torch.Tensor,
                         order: torch.Tensor) -> torch.Tensor:
        """Expert parallel by all-gather (Megatron's ``allgather`` dispatcher): every EP rank gets
        every rank's tokens, gates and kept assignments, runs its own experts on the assignments
        routed to them, and the partial outputs are summed back to each token's rank by a
        reduce-scatter. The backward is the same exchange reversed, so the tokens' and gates'
        gradients from every rank's experts reach their own rank summed."""
        from zoo.parallel import comm

        el, k = self.local_experts, self.top_k
        kept = torch.full_like(flat_e, -1)  # capacity-dropped assignments go to no expert
        kept[order] = flat_e[order]
        local = comm.all_gather(kept, self.ep_group, 0) - self.ep_rank * el
        tokens = comm.gather_seq(flat, self.ep_group, 0)  # (ep * N, D)
        all_gates = comm.gather_seq(gates.reshape(-1), self.ep_group, 0)
        mine = ((local >= 0) & (local < el)).nonzero().squeeze(1)
        mine = mine[torch.argsort(local[mine], stable=True)]  # by local expert, then rank and position
        token = mine // k
        ys = self._experts(tokens.index_select(0, token), torch.bincount(local[mine], minlength=el),
                           self.gate_up, self.down)
        ys = (ys.float() * all_gates[mine][:, None]).to(flat.dtype)
        out = tokens.new_zeros(tokens.shape).index_add_(0, token, ys)
        return comm.reduce_scatter_seq(out, self.ep_group, 0)

    @torch.no_grad()
    def shard_experts(self, group: Any, size: int, rank: int, *, etp_group: Any = None, etp: int = 1,
                      etp_rank: int = 0) -> None:
        """Keep experts ``[rank * E/size, (rank + 1) * E/size)``, and of each expert's MLP the
        ``etp_rank``-th of ``etp`` parts (gate/up rows, down columns) (called by the core before training)."""
        if self.num_experts % size:
            raise ValueError(f"ep={size} does not divide the {self.num_experts} experts")
        el = self.num_experts // size
        ffn = self.down.shape[2]
        if ffn % etp:
            raise ValueError(f"etp={etp} does not divide the experts' hidden width {ffn}")
        cols = slice(etp_rank * ffn // etp, (etp_rank + 1) * ffn // etp)
        gate_up = self.gate_up[rank * el:(rank + 1) * el]
        gate_up = (gate_up.unflatten(1, (2, ffn))[:, :, cols].flatten(1, 2) if self.gated else gate_up[:, cols])
        for name, piece in (("gate_up", gate_up), ("down", self.down[rank * el:(rank + 1) * el, :, cols])):
            setattr(self, name, nn.Parameter(piece.clone(), requires_grad=getattr(self, name).requires_grad))
        self.ep_group, self.ep_size, self.ep_rank = group, size, rank
        self.etp_group, self.etp_size = etp_group, etp


def _by_expert_then_gate(experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Assignments sorted by expert, highest gate first within each (the "probs" drop policy keeps
    an expert's most confident tokens)."""
    by_gate = torch.argsort(-gates, stable=True)
    return by_gate[torch.argsort(experts[by_gate], stable=True)]


def balance_losses(stats: torch.Tensor, *, num_experts: int, top_k: int, convention: AuxConvention = "megatron"
                   ) -> dict[str, torch.Tensor]:
    """Balancing terms from the MoE layers' statistics ``stats`` (L, `stats_width`).

    ``aux``: the Switch load-balancing loss (Fedus et al. 2021). ``megatron``: per layer
    ``E * sum_i f_i P_i`` with ``f_i`` the fraction of the N*k assignments routed to expert i and
    ``P_i`` its mean router probability, summed over layers (1 per layer when perfectly balanced).
    ``hf``: Hugging Face's ``load_balancing_loss_func``, every layer's tokens pooled into one set and
    counts divided by tokens, not assignments (k per layer pooled when balanced).
    ``sequence``: Megatron's ``seq_aux_loss``, the per-layer loss of each sequence averaged over the
    micro-batch's sequences, summed over layers (the layers must be built with ``sequence_stats``).
    ``z``: the router z-loss (Zoph et al. 2022), ``mean(logsumexp(logits)^2)`` summed over layers.
    ``load``: per layer, tokens of the busiest expert / mean tokens per expert;
    ``dropped``: assignments dropped by the capacity factor."""
    e = num_experts
    counts, probs = stats[:, :e], stats[:, e:2 * e]
    z_sum, seq, n, dropped = stats[:, 2 * e], stats[:, 2 * e + 1], stats[:, 2 * e + 2], stats[:, 2 * e + 3]
    n = n.clamp(min=1)
    if convention == "megatron":
        aux = (e * (counts / (n[:, None] * top_k)) * (probs / n[:, None])).sum()
    elif convention == "hf":
        rows = n.sum()
        aux = e * ((counts.sum(0) / rows) * (probs.sum(0) / rows)).sum()
    elif convention == "sequence":
        aux = seq.sum()
    else:
        raise ValueError(f"aux loss convention {convention!r}: one of megatron, hf, sequence")
    mean = counts.sum(1) / e
    load = counts.max(1).values / mean.clamp(min=1e-9)
    return {"aux": aux, "z": (z_sum / n).sum(), "load": load.detach(), "dropped": dropped.sum().detach()}


def balance_metrics(stats: torch.Tensor, *, num_experts: int, top_k: int, convention: str, aux_coeff: float,
                    z_coeff: float) -> dict[str, torch.Tensor]:
    """A MoE family's metrics from its carried statistics: ``aux_loss`` and ``z_loss`` (coefficients
    applied; the core backpropagates them), ``expert_load`` (one per layer) and ``dropped``
    (`zoo.family.MOE_METRICS` declares them)."""
    terms = balance_losses(stats, num_experts=num_experts, top_k=top_k, convention=convention)
    return {"aux_loss": aux_coeff * terms["aux"], "z_loss": z_coeff * terms["z"], "expert_load": terms["load"],
            "dropped": terms["dropped"]}


__all__ = ["MoE", "Router", "balance_losses", "balance_metrics", "stats_width"]
