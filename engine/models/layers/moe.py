"""Mixture-of-experts MLP (Qwen3-Next / Qwen3.5-MoE style): a softmax router over
`num_experts`, each token sent to its `top_k` experts (weights renormalised to sum 1 when
`norm_topk_prob`), every expert a gated MLP; plus an optional shared expert that every
token passes through, scaled by `sigmoid(shared_gate(x))`.

Ring-linear routing (`MoEConfig.scoring="sigmoid"`): sigmoid scores of a float32 router
product; a per-expert `router_bias` added only to choose the experts; group-limited
top-k (a group scores the sum of its two best biased scores, only the best `topk_groups`
groups are eligible); the chosen unbiased scores renormalised and times
`routed_scaling_factor`.

Expert compute is grouped, not a loop over experts: the (token, choice) pairs are sorted
by expert, and two grouped GEMMs (`torch.nn.functional.grouped_mm`, one per projection,
with per-expert row offsets computed on the device) run every expert's rows in one call
each; each row's routing weight scales its expert intermediate, and the rows are put back in
token order by one gather and summed over the k choices (`combine_choices`). No value
is read back to the host, so the layer can be captured in a CUDA graph. Where grouped_mm
cannot take the operands (strides not 16-byte aligned, or fp32 on CUDA) the experts run
one by one (`loop`, which reads the per-expert counts back), or, while a CUDA graph is
being captured, as one batched product over each row's own gathered expert weights
(`gathered`: no host read, memory per row = one expert's weights, so only for the small
batches that are captured).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import MoEConfig
from engine.models.layers.mlp import SwiGLU, gated_activation


def grouped_gemm_ok(a: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` takes rows like `a` against `weights` (16-byte aligned rows;
    bf16 on CUDA)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if a.is_cuda and a.dtype != torch.bfloat16:
        return False
    item = a.element_size()
    return all((w.shape[-1] * item) % 16 == 0 and (w.shape[-2] * item) % 16 == 0 for w in weights)


def combine_choices(y: torch.Tensor, order: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Rows `y [n*k, D]` in expert order (row i belongs to (token, choice) pair `order[i]`)
    -> the sum over each token's k choices `[n, D]`: the rows put back in pair order by one
    gather, then summed over k (accumulated in float32, rounded once). No atomics, no host
    read."""
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(order.numel(), device=order.device, dtype=order.dtype))
    return y.index_select(0, inv).view(n, k, y.shape[-1]).sum(dim=1)


class SparseMoE(nn.Module):
    """`experts_gate_up [E, 2I, D]` (gate rows then up rows), `experts_down [E, D, I]`,
    `router.weight [E, D]`; `shared` (a SwiGLU) and `shared_gate.weight [1, D]` when set."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, activation: str = "silu") -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.intermediate_size = cfg.intermediate_size
        self.scoring = cfg.scoring
        self.num_groups, self.topk_groups = cfg.num_groups, cfg.topk_groups
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.router = nn.Linear(hidden_size, cfg.num_experts, bias=False)
        self.router_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.expert_bias else None
        self.experts_gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, cfg.intermediate_size))
        self.shared = SwiGLU(hidden_size, cfg.shared_intermediate_size, activation) \
            if cfg.shared_intermediate_size else None
        self.shared_gate = nn.Linear(hidden_size, 1, bias=False) \
            if cfg.shared_intermediate_size and cfg.shared_expert_gate else None
        self.act = gated_activation(activation)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, D]` -> (weights `[N, k]` in x's dtype, expert ids `[N, k]`)."""
        if self.scoring == "sigmoid":
            return self.route_sigmoid(x)
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring-linear's router (see the module docstring), in float32."""
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))
        choice = scores if self.router_bias is None else scores + self.router_bias.float()
        if self.num_groups > 1:
            n = choice.shape[0]
            grouped = choice.view(n, self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).view(n, -1)
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        top = scores.gather(1, ids)
        if self.norm_topk_prob and self.top_k > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * self.routed_scaling_factor
        return top.to(x.dtype), ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x): x `[N, D]` -> `[N, D]`."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k  # token of each sorted (token, choice) pair
        xs = x[token]
        w_sorted = weights.reshape(-1)[order, None]
        w_gu, w_down = self.experts_gate_up, self.experts_down
        sorted_ids = flat[order]
        if grouped_gemm_ok(xs, w_gu, w_down):
            ends = torch.searchsorted(sorted_ids, torch.arange(self.num_experts, device=x.device), right=True)
            offs = ends.to(torch.int32)
            h = F.grouped_mm(xs, w_gu.transpose(1, 2), offs=offs)
            gate, up = h.chunk(2, dim=-1)
            # the routing weight scales the expert's intermediate (the down projection is
            # linear), a product over [rows, I] instead of [rows, D]
            y = F.grouped_mm(self.act(gate) * up * w_sorted, w_down.transpose(1, 2), offs=offs)
        else:
            if xs.is_cuda and torch.cuda.is_current_stream_capturing():
                y = self.gathered(xs, sorted_ids)
            else:
                y = self.loop(xs, sorted_ids)
            y = y * w_sorted
        return combine_choices(y.to(x.dtype), order, n, k)

    def loop(self, xs: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
        """The experts one by one over rows sorted by expert (the fallback of `experts`)."""
        counts = torch.bincount(sorted_ids, minlength=self.num_experts).tolist()
        outs, at = [], 0
        for e, c in enumerate(counts):
            if c:
                gate, up = F.linear(xs[at:at + c], self.experts_gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(self.act(gate) * up, self.experts_down[e]))
                at += c
        return torch.cat(outs) if outs else xs.new_zeros(0, xs.shape[-1])

    def gathered(self, xs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each row through its own expert, as batched products over gathered weights (no
        host read): xs `[M, D]`, expert_ids `[M]` -> `[M, D]`."""
        h = torch.bmm(self.experts_gate_up[expert_ids], xs[:, :, None])[..., 0]
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(self.experts_down[expert_ids], (self.act(gate) * up)[:, :, None])[..., 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        out = self.experts(flat, weights, ids)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.reshape(*lead, x.shape[-1])
