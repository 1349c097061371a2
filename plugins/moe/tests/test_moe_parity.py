"""Mixtral and Qwen2-MoE against Hugging Face (tiny random configs, fp32): logits, the aux loss
under HF's convention, both on-disk expert layouts and their round trips; the router and the
dispatcher against formulas written out token by token."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from zoo_moe import convert
from zoo_moe.model import build
from zoo_moe.plugin import SPECS

from zoo.checkpoint.mapping import MappingError, from_external, to_external
from zoo.errors import UsageError
from zoo.nn.moe import MoE, balance_losses, stats_width
from zoo.spec import MLPSpec, MoESpec


def _hf(kind: str, **over):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, intermediate_size=48)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**{**common, "num_local_experts": 4, **over}))
    elif kind == "qwen3":  # per-head q/k norms; head_dim 16, not hidden / heads
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**common, "moe_intermediate_size": 16, "num_experts": 4,
                                                      "head_dim": 16, **over}))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**common, "moe_intermediate_size": 16,
                                                      "shared_expert_intermediate_size": 40, "num_experts": 4, **over}))
    torch.manual_seed(0)
    for p in model.parameters():  # large enough that routing differences would show
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def _ours(hf):
    cfg = convert.from_hf_config(hf.config.to_dict())
    sd = hf.state_dict()
    state = from_external(convert.import_table(cfg, list(sd)), sd, cfg)
    model = build(cfg, SPECS[cfg.layer_spec]).eval()
    model.load_state_dict(state, strict=True)
    return model, cfg, state


DENSE = [({"mlp_only_layers": [0]}, "TE"),  # DeepSeek's first dense layer
         ({"decoder_sparse_step": 2, "num_hidden_layers": 4}, "TETE"),  # Llama 4's interleaving
         ({"mlp_only_layers": [1, 2], "num_hidden_layers": 4, "norm_topk_prob": True}, "ETTE")]


# Sliding windows of 4 positions (the inputs have 12): Mixtral's on every layer, Qwen2-MoE's on the
# even layers below max_window_layers (transformers' rule), Qwen3-MoE's on every layer.
WINDOWS = [("mixtral", {"sliding_window": 4}),
           ("qwen", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
           ("qwen3", {"use_sliding_window": True, "sliding_window": 4})]


@pytest.mark.parametrize(("kind", "over"), [("mixtral", {}), ("qwen", {}), ("qwen", {"norm_topk_prob": True}),
                                            *(("qwen", over) for over, _ in DENSE), ("qwen3", {}),
                                            ("qwen3", {"norm_topk_prob": True, "mlp_only_layers": [0]}), *WINDOWS],
                         ids=["mixtral", "qwen2-moe", "qwen2-moe-norm-topk", *(f"qwen2-moe-{p}" for _, p in DENSE),
                              "qwen3-moe", "qwen3-moe-norm-topk-TE", "mixtral-window", "qwen2-moe-window",
                              "qwen3-moe-window"])
def test_logits_and_aux_loss_match_hugging_face(kind, over):
    hf = _hf(kind, **over)
    ours, cfg, _ = _ours(hf)
    dense = {**{str(o): p for o, p in DENSE}, str({"norm_topk_prob": True, "mlp_only_layers": [0]}): "TE"}
    assert cfg.symbols == dense.get(str(over), "E" * hf.config.num_hidden_layers)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x, output_router_logits=True)
        assert (ours(x) - ref.logits).abs().max().item() <= 1e-5
        _, stats = ours(x, labels=x)
    terms = balance_losses(stats, num_experts=cfg.num_experts, top_k=cfg.top_k, convention="hf")
    assert terms["aux"].item() == pytest.approx(ref.aux_loss.item(), rel=1e-6)


def test_mixtral_both_expert_layouts_round_trip_bitwise_and_a_mix_is_refused(tmp_path):
    hf = _hf("mixtral")
    _, cfg, state = _ours(hf)  # from transformers 5's fused in-memory layout
    fused = hf.state_dict()
    assert any(".mlp.experts.gate_up_proj" in k for k in fused)
    back = to_external(convert.table(cfg, "fused"), state, cfg)
    assert back.keys() == fused.keys() and all(torch.equal(back[k], fused[k]) for k in fused)
    # The Hub layout, as save_pretrained writes it: one tensor per expert and projection.
    hf.save_pretrained(tmp_path / "hub")
    from safetensors.torch import load_file

    hub = load_file(tmp_path / "hub" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in hub
    from_hub = from_external(convert.import_table(cfg, list(hub)), hub, cfg)
    assert all(torch.equal(from_hub[k], state[k]) for k in state)
    exported = to_external(convert.table(cfg), state, cfg)
    assert exported.keys() == hub.keys() and all(torch.equal(exported[k], hub[k]) for k in hub)
    mixed = {**hub, "model.layers.0.mlp.experts.gate_up_proj": fused["model.layers.0.mlp.experts.gate_up_proj"]}
    with pytest.raises(MappingError, match="mixes expert layouts"):
        convert.import_table(cfg, list(mixed))


def test_zoo_convert_reads_a_saved_mixtral_and_writes_one_transformers_loads(tmp_path, capsys):
    from transformers import MixtralForCausalLM

    from zoo.cli import main

    hf = _hf("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "zoo")]) == 0
    assert main(["convert", "--to", "hf", str(tmp_path / "zoo"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    again = MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)


def _layer(spec: MoESpec, **kw) -> MoE:
    torch.manual_seed(3)
    layer = MoE(spec, hidden=16, ffn_hidden=24, num_experts=6, top_k=2, **kw)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _by_token(layer: MoE, x: torch.Tensor, keep: set[tuple[int, int]] | None = None) -> torch.Tensor:
    """The MoE written token by token: y_t = sum_k gate_tk * expert_k(x_t) (independent of the sort)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.weight.t()
    scores = torch.softmax(logits, -1) if layer.router.score == "softmax" else torch.sigmoid(logits)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = torch.topk(scores[t], layer.top_k).indices
        g = scores[t, top]
        if layer.router.normalize:
            g = g / g.sum()
        for e, w in zip(top.tolist(), g):
            if keep is not None and (t, e) not in keep:
                continue
            gate, up = (layer.gate_up[e] @ flat[t]).chunk(2)
            out[t] += w * (layer.down[e] @ (torch.nn.functional.silu(gate) * up))
    return out.view_as(x)


SWIGLU = MLPSpec(activation="silu", gated=True, bias=False)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
def test_dropless_dispatch_equals_the_per_token_formula(router):
    layer = _layer(MoESpec(expert=SWIGLU, router=router, normalize_topk=True))
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        assert torch.allclose(layer(x), _by_token(layer, x), atol=1e-5)
        assert layer.stats[-1].item() == 0  # nothing dropped


ROUTERS = [  # (score, renormalised, groups, group_topk, top_k, scaling, expert bias)
    ("softmax", True, 1, 1, 2, 1.0, False), ("softmax", True, 4, 2, 4, 1.0, False),
    ("softmax", False, 4, 2, 4, 1.0, False), ("softmax", True, 4, 1, 3, 1.0, False),
    ("softmax", True, 1, 1, 1, 1.0, False), ("softmax", False, 1, 1, 1, 1.0, False),  # top-1: a gate of 1 / the score
    ("sigmoid", True, 4, 2, 4, 2.5, True), ("sigmoid", True, 8, 3, 6, 1.0, False), ("sigmoid", True, 1, 1, 3, 2.5, True),
]


@pytest.mark.parametrize(("score", "norm", "groups", "group_topk", "k", "scale", "bias"), ROUTERS)
def test_router_equals_megatron_cores_routing(score, norm, groups, group_topk, k, scale, bias):
    """Every routing option (softmax renormalised or not, sigmoid with the expert bias, group-limited
    routing, the scaling factor) against megatron-core's topk_routing_with_score_function on the
    same logits: the same experts, the same gates."""
    from zoo.nn.moe import Router

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (megatron-core warns that Transformer Engine and Apex are missing)
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    gen = torch.Generator().manual_seed(k * groups)
    router = Router(8, 16, k, score=score, normalize=norm, expert_bias=bias, groups=groups, group_topk=group_topk,
                    scale=scale)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 8, generator=gen))
        if bias:
            router.expert_bias.copy_(0.3 * torch.randn(16, generator=gen))
    gates, experts, logits, _ = router(torch.randn(64, 8, generator=gen))
    probs, chosen = topk_routing_with_score_function(
        logits, k, use_pre_softmax=not norm, num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None, scaling_factor=scale if scale != 1.0 else None,
        score_function=score, expert_bias=router.expert_bias if bias else None)
    assert torch.equal(torch.zeros(64, 16, dtype=torch.bool).scatter(1, experts, True), chosen)
    assert torch.allclose(torch.zeros(64, 16).scatter(1, experts, gates.detach()), probs, rtol=1e-6, atol=1e-7)
    if groups > 1:  # the experts a token reaches lie in group_topk groups
        assert all(len(set((e // (16 // groups)).tolist())) <= group_topk for e in experts)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-params"])
def test_expert_gradients_equal_the_per_token_formulas(precision):
    """The experts' hand-written backward (`zoo.nn.moe_experts.ExpertMLPs`) against autograd through the
    token-by-token formula in fp32: exact in fp32; under bf16 autocast (weights cast one expert at
    a time, gradients made in bf16 and kept in the weights' fp32) and with bf16 parameters (tiles
    summed in fp32, rounded once) within bf16's rounding."""
    layer = _layer(MoESpec(expert=SWIGLU, normalize_topk=True))
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(4))  # ~40 rows an expert: several tiles
    probe = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(5))
    if precision == "bf16-params":  # the reference sees the same (bf16-representable) values
        x = x.bfloat16().float()
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(p.bfloat16().float())
    ref = torch.autograd.grad((_by_token(layer, x) * probe).sum(), [layer.gate_up, layer.down])
    if precision == "bf16-params":
        layer, x = layer.to(torch.bfloat16), x.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        got = torch.autograd.grad((layer(x).float() * probe).sum(), [layer.gate_up, layer.down])
    for g, r in zip(got, ref):
        assert g.dtype == (torch.bfloat16 if precision == "bf16-params" else torch.float32) and g.shape == r.shape
        err = float((g.float() - r).norm() / r.norm())
        assert err <= (1e-6 if precision == "fp32" else 2e-2), err


def test_bf16_expert_products_on_a_cpu_use_a_fixed_set_of_shapes():
    """oneDNN keeps kernels per matrix-product shape: under bf16 autocast on a CPU every expert
    product's row count (or, for weight gradients, summed length) is a power of two >= 16, however
    the tokens were routed, so the set of shapes cannot grow with training."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) and args[0].dtype == torch.bfloat16:
                self.rows.add(tuple(args[0].shape))  # (the router's products are fp32)
            return func(*args, **(kwargs or {}))

    layer = _layer(MoESpec(expert=SWIGLU, normalize_topk=True))
    with Shapes() as seen:
        for seed in range(4):
            x = torch.randn(2, 20 + 17 * seed, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
            y.float().sum().backward()
    dims = {d for shape in seen.rows for d in shape} - {16, 24, 48}  # hidden, ffn, gated ffn: fixed
    assert dims and all(d >= 16 and d & (d - 1) == 0 for d in dims), sorted(dims)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_factor_drops_what_the_policy_says(policy):
    layer = _layer(MoESpec(expert=SWIGLU, normalize_topk=True), capacity_factor=0.5, drop_policy=policy)
    x = torch.randn(2, 12, 16)
    flat = x.reshape(-1, 16)
    with torch.no_grad():
        scores = torch.softmax(flat @ layer.router.weight.t(), -1)
        top = torch.topk(scores, 2)
        gate = top.values / top.values.sum(-1, keepdim=True)  # what Megatron's "probs" policy ranks by
        capacity = math.ceil(24 * 2 / 6 * 0.5)
        keep = set()
        for e in range(6):
            mine = [(t, gate[t, top.indices[t].tolist().index(e)].item()) for t in range(24) if e in top.indices[t].tolist()]
            if policy == "probs":
                mine.sort(key=lambda a: -a[1])
            keep |= {(t, e) for t, _ in mine[:capacity]}
        got = layer(x)
        assert layer.stats[-1].item() == 48 - len(keep) > 0
        assert torch.allclose(got, _by_token(layer, x, keep), atol=1e-5)


def test_megatron_aux_loss_is_one_per_layer_when_balanced_and_the_z_loss_is_the_mean_squared_lse():
    e, k, n = 4, 2, 8
    stats = torch.zeros(2, stats_width(e))
    stats[:, :e] = n * k / e  # every expert gets its share
    stats[:, e:2 * e] = n / e  # uniform probabilities
    stats[:, 2 * e + 2] = n
    assert balance_losses(stats, num_experts=e, top_k=k)["aux"].item() == pytest.approx(2.0)
    assert balance_losses(stats, num_experts=e, top_k=k, convention="hf")["aux"].item() == pytest.approx(k)
    layer = _layer(MoESpec(expert=SWIGLU))
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        layer(x)
        z = balance_losses(layer.stats[None], num_experts=6, top_k=2)["z"]
        lse = torch.logsumexp(x.reshape(-1, 16) @ layer.router.weight.t(), -1)
    assert z.item() == pytest.approx(lse.square().mean().item(), rel=1e-6)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
def test_sequence_aux_loss_equals_megatron_cores_seq_aux_loss(router):
    """aux_loss_convention="sequence" against megatron-core's ``seq_aux_loss`` as its router computes
    it (`TopKRouter._apply_seq_aux_loss`: the routing map and scores of
    `compute_routing_scores_for_aux_loss`, tokens in its [sequence, batch] order, every sequence's
    experts as experts of their own, divided by the batch): the loss and its gradient."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    layer = _layer(MoESpec(expert=SWIGLU, router=router), sequence_stats=True)
    b, t, e, k = 3, 8, 6, 2
    x = torch.randn(b, t, 16)
    layer(x)
    ours = balance_losses(layer.stats[None], num_experts=e, top_k=k, convention="sequence")["aux"]
    (grad_ours,) = torch.autograd.grad(ours, layer.router.weight)
    logits = (x.transpose(0, 1).reshape(-1, 16) @ layer.router.weight.t())  # [s, b] order
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, k, router.split("_")[0])
    per_seq_map, per_seq_scores = routing_map.reshape(t, -1), scores.reshape(t, -1)  # (s, b * E)
    theirs = switch_load_balancing_loss_func(per_seq_scores, per_seq_map.sum(0), t, k, e, 1.0) / b
    (grad_theirs,) = torch.autograd.grad(theirs, layer.router.weight)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-5, atol=1e-7)
    # and it is not the micro-batch-wide loss: the sequences are balanced one by one
    assert ours.item() != pytest.approx(balance_losses(layer.stats[None], num_experts=e, top_k=k)["aux"].item())


def test_expert_bias_moves_against_the_load_and_only_steers_the_choice():
    layer = _layer(MoESpec(expert=SWIGLU, router="sigmoid_topk"), expert_bias=True)
    x = torch.randn(4, 8, 16)
    layer(x)  # training forward: loads counted
    counts = layer.router.tokens_per_expert.clone()
    layer.router.update_bias(0.1)
    assert torch.equal(layer.router.expert_bias, 0.1 * torch.sign(counts.mean() - counts))
    assert layer.router.tokens_per_expert.sum() == 0
    gates, experts, _, scores = layer.router(x.reshape(-1, 16))
    unbiased = scores.gather(1, experts)
    assert torch.allclose(gates, unbiased / unbiased.sum(-1, keepdim=True))  # gates are the unbiased scores


def test_expert_bias_counts_tokens_in_a_model_built_on_the_meta_device(tmp_path):
    """`zoo train` builds models on the meta device and materializes them shard by shard: the
    router's token counter (no buffer) must start counting there too (it failed: "Cannot copy
    out of meta tensor"), and the bias then moves."""
    from zoo.cli import main

    run = tmp_path / "run"
    assert main(["train", "--model", "mixtral", "model.layer_spec=mixtral_sigmoid", "model.expert_bias=true",
                 "model.router_groups=4", "model.router_group_topk=1", "model.router_scaling=2.5", "train.steps=2",
                 "train.micro_batch_size=2", "train.seq_length=16", "train.eval_interval=0", "logging.progress=false",
                 "logging.tensorboard=false", "logging.plot=false", "--run-dir", str(run)]) == 0
    import zoo

    biases = [layer.moe.router.expert_bias for layer in zoo.load_model(str(run)).layers]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # two steps' updates of +-rate each


def test_expert_bias_stays_float32_and_keeps_moving_when_the_layer_is_cast_to_bf16():
    """`train.param_dtype=bf16` casts the model: the bias is no parameter (no fp32 master behind it),
    and in bf16 a 1e-3 step from 0.6 rounds back to where it was. The expected values are float32
    arithmetic on the same numbers."""
    layer = _layer(MoESpec(expert=SWIGLU, router="sigmoid_topk"), expert_bias=True).to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16 and layer.router.expert_bias.dtype == torch.float32
    layer.router.expert_bias.fill_(0.6)
    layer.router.tokens_per_expert = torch.tensor([9.0, 0.0, 3.0, 3.0, 3.0, 0.0])  # mean 3
    layer.router.update_bias(1e-3)
    start = torch.full((6,), 0.6)
    assert torch.equal(layer.router.expert_bias, start + 1e-3 * torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 1.0]))


def test_bad_moe_configs_fail_with_one_clear_line():
    from zoo_moe.plugin import mixtral_tiny

    cfg = mixtral_tiny()
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and num_experts=8"):
        type(cfg)(**{**cfg.__dict__, "top_k": 9})
    with pytest.warns(UserWarning, match="load balancing is off"):
        type(cfg)(**{**cfg.__dict__, "aux_loss_coeff": 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        type(cfg)(**{**cfg.__dict__, "aux_loss_coeff": 0.0, "expert_bias": True})  # balanced by the bias: no warning
    for pattern, err in (("EX", r"unknown symbol\(s\) 'X'"), ("EEE", "has 3 layers, num_layers=2"),
                         ("TT", "no MoE layer"), ("TE", "set dense_ffn_hidden_size"), ("EE|", "every pipeline stage")):
        with pytest.raises(ValueError, match=err):
            type(cfg)(**{**cfg.__dict__, "pattern": pattern})
    mixed = type(cfg)(**{**cfg.__dict__, "pattern": "T|E", "dense_ffn_hidden_size": 64})
    assert mixed.pipeline_stages == (1, 1) and mixed.moe_layers == 1
    with pytest.raises(UsageError, match="Hugging Face's Mixtral does not"):
        convert.to_hf_config(mixed)


@pytest.mark.parametrize("kind", ["qwen", "qwen3"])
def test_dense_layers_round_trip_through_zoo_convert_into_a_model_transformers_loads(tmp_path, capsys, kind):
    """Qwen2-MoE and Qwen3-MoE with mlp_only_layers and decoder_sparse_step: zoo convert both ways
    keeps every tensor, the dense layers' MLPs mapped only where they exist, and which layers are dense."""
    from transformers import AutoModelForCausalLM

    from zoo.cli import main

    hf = _hf(kind, num_hidden_layers=4, mlp_only_layers=[3], decoder_sparse_step=2)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "zoo")]) == 0
    assert main(["convert", "--to", "hf", str(tmp_path / "zoo"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    prefix = "Qwen2Moe" if kind == "qwen" else "Qwen3Moe"
    assert type(again) is type(hf)
    assert [type(layer.mlp).__name__ for layer in again.model.layers] == \
        [type(layer.mlp).__name__ for layer in hf.model.layers] == \
        [f"{prefix}MLP", f"{prefix}SparseMoeBlock", f"{prefix}MLP", f"{prefix}MLP"]
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)


@pytest.mark.parametrize(("kind", "over"), WINDOWS, ids=["mixtral", "qwen2-moe", "qwen3-moe"])
def test_sliding_windows_round_trip_through_zoo_convert(tmp_path, capsys, kind, over):
    """The layers that slide and their window survive zoo convert both ways: transformers builds the
    same attention from the exported config (its logits bitwise the original's), and the window
    matters (the same weights without it give other logits)."""
    from transformers import AutoModelForCausalLM

    from zoo.cli import main

    hf = _hf(kind, **over)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "zoo")]) == 0
    assert main(["convert", "--to", "hf", str(tmp_path / "zoo"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.sliding_window == 4
    assert getattr(again.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    x = torch.randint(0, 64, (1, 12))
    windowless = _hf(kind)
    windowless.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)
        assert (windowless(x).logits - hf(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize(("family", "symbol"), [("mixtral", "E"), ("mamba2", "M")])
def test_a_flavors_num_layers_overrides_alone_where_the_pattern_is_its_default(family, symbol):
    """The configs' layering starts from the flavor's config: an empty pattern must stay empty there,
    or `model.num_layers=6` would fail against the flavor's filled-in one."""
    from zoo import config as C
    from zoo.registry import get_registry

    fam = get_registry().get(family).family
    run = C.resolve(family=family, flavor="tiny", model_cls=fam.config, model_defaults=fam.flavors["tiny"](),
                    overrides=["model.num_layers=6"])
    assert run.model.pattern == "" and run.model.symbols == symbol * 6
    mixed = C.resolve(family=family, flavor="tiny", model_cls=fam.config, model_defaults=fam.flavors["tiny"](),
                      overrides=["model.num_layers=3", f"model.pattern={symbol}|{symbol}{symbol}"])
    assert mixed.model.pipeline_stages == (1, 2)


@pytest.mark.parametrize("flavor", ["mixtral_8x7b", "qwen15_moe_a27b", "qwen3_moe_30b_a3b"])
def test_flavors_count_what_transformers_builds_from_their_exported_config(flavor):
    """On the meta device: a flavor's parameters equal those of the Hugging Face model its exported
    config describes (Qwen3-30B-A3B: 30,532,122,624, as released)."""
    from transformers import AutoModelForCausalLM
    from zoo_moe import plugin

    cfg = getattr(plugin, flavor)()
    config = convert.to_hf_config(cfg)
    with torch.device("meta"):
        ours = sum(p.numel() for p in build(cfg, SPECS[cfg.layer_spec]).parameters())
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert ours == theirs
    if flavor == "qwen3_moe_30b_a3b":
        assert ours == 30_532_122_624


def test_dry_run_counts_a_ranks_share_of_the_experts(capsys):
    """Qwen3-30B-A3B on 16 ranks, ep8 x tp2: independent arithmetic of what one rank holds."""
    from zoo.cli import main

    assert main(["train", "--model", "qwen3-moe", "--flavor", "30B-A3B", "parallel.ep=8", "parallel.tp=2",
                 "parallel.sequence_parallel=true", "--world-size", "16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    layers, d, vocab = 48, 2048, 151936
    split = 2 * vocab * d + layers * ((32 + 2 * 4) * 128 * d + 32 * 128 * d)  # embeddings, head, q|k|v, o: over tp
    experts = layers * 128 * 3 * d * 768  # over ep
    whole = layers * (128 * d + 2 * d + 2 * 128) + d  # router, norms, q/k norms, final norm
    assert f"# parameters: {split + experts + whole:,}" in out  # (30,532,122,624, as released)
    assert f"# parameters per rank (experts over ep x etp): {split // 2 + experts // 8 + whole:,}" in out
