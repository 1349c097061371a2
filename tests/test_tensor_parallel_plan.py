"""A decoder family written from docs/plugins.md alone, out of the core's layers, declares no
``tp_plan``: the core derives the split from the layers (`zoo.parallel.apply.derived_plan`), the
layout check accepts tensor parallelism for it, and at tp=2 (gloo) its loss and every gradient,
gathered to full shape, equal the single-process model's. Drawn over random configs: gated or
plain MLPs, per-head q/k norms or none, grouped or full KV heads, tied heads or not."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn

from zoo.testing import run_distributed


@dataclasses.dataclass(kw_only=True)
class DecoderConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 48
    tie_embeddings: bool = False
    layer_spec: str = "gated"


def _spec(name: str):
    from zoo.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec

    gated, qk_norm = name.startswith("gated"), name.endswith("qknorm")
    norm = NormSpec(kind="rmsnorm") if gated else NormSpec(kind="layernorm")
    block = BlockSpec(norm=norm, mixer=AttentionSpec(causal=True, bias=not gated,
                                                     qk_norm=NormSpec(kind="rmsnorm") if qk_norm else None),
                      ffn=MLPSpec(activation="silu" if gated else "gelu_tanh", gated=gated, bias=not gated))
    return ModelSpec(blocks={"T": block}, embedding="token", positions="none", final_norm=norm, head="lm")


SPECS = ("gated", "gated_qknorm", "plain", "plain_qknorm")


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, spec) -> None:
        from zoo.nn import make_norm
        from zoo.nn.layers import TransformerLayer
        from zoo.nn.linear import LMHead, TokenEmbedding

        super().__init__()
        d, block = cfg.hidden_size, spec.block_for("T")
        self.embed = TokenEmbedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            TransformerLayer(block, hidden=d, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                             head_dim=d // cfg.num_heads, ffn_hidden=cfg.ffn_hidden_size, eps=1e-5, layer=i)
            for i in range(cfg.num_layers))
        self.norm = make_norm(spec.final_norm, d, 1e-5)
        self.head = LMHead(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from zoo.nn import linear_cross_entropy

        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return linear_cross_entropy(self.norm(x).flatten(0, 1), self.head, labels.flatten())


def _family():
    from zoo.family import Family, PipelineSpec

    return Family(name="plain-decoder", description="a decoder of the core's layers", task="causal_lm",
                  config=DecoderConfig, flavors={"tiny": DecoderConfig}, specs={n: _spec(n) for n in SPECS},
                  build=Decoder, loss=lambda m, b: (m(b["tokens"], b["labels"]), {}),
                  example_batch=lambda cfg, **kw: {},
                  pipeline=PipelineSpec(layers="layers", first=("embed",), last=("norm", "head"), input_key="tokens"))


def _configs(seed: int) -> list[DecoderConfig]:
    """One random config per layer spec."""
    rng = random.Random(seed)
    out = []
    for spec in SPECS:
        heads = rng.choice([2, 4, 8])
        out.append(DecoderConfig(vocab_size=rng.choice([32, 64, 100]), hidden_size=heads * rng.choice([4, 8]),
                                 num_layers=rng.choice([1, 2]), num_heads=heads,
                                 num_kv_heads=rng.choice([h for h in (2, heads) if heads % h == 0]),
                                 ffn_hidden_size=rng.choice([16, 24, 40]), tie_embeddings=rng.random() < 0.5,
                                 layer_spec=spec))
    return out


def _run(cfg: DecoderConfig, tp: int) -> dict:
    import torch.distributed as dist

    from zoo.parallel.apply import _matches, apply_tensor_parallel, tensor_parallel_plan, tensor_parallel_shards

    torch.manual_seed(0)
    model = Decoder(cfg, _spec(cfg.layer_spec))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab_size, (2, 12), generator=g)
    labels = torch.randint(cfg.vocab_size, (2, 12), generator=g)
    plan, local = tensor_parallel_plan(model)  # nothing declared: all of it derived
    group = dist.group.WORLD if tp > 1 else None
    if tp > 1:
        apply_tensor_parallel(model, plan, local, group)
        assert model.layers[0].attn.h == cfg.num_heads // tp and model.embed.weight.shape[0] < cfg.vocab_size
    loss = model(tokens, labels)
    loss.backward()
    split = tensor_parallel_shards(model)
    grads = {}
    for name, p in model.named_parameters():
        style = next((s for pat, s in plan.items() if _matches(name.rpartition(".")[0], pat)), None)
        if tp > 1 and name in split:  # the full gradient from every rank's piece, as the layer splits it
            grads[name] = split[name].gather(p.grad)
        elif tp > 1 and style == "per_head":  # whole on each rank, its gradient partial per rank's heads
            grads[name] = p.grad.clone()
            dist.all_reduce(grads[name])
        else:
            grads[name] = p.grad.clone()
    return {"loss": loss.item(), "grads": grads, "plan": plan}


def test_the_derived_plan_is_megatrons_split_of_a_decoder():
    """Every module's style, against the table Megatron-LM applies to a GPT/LLaMA decoder."""
    from zoo.parallel.apply import tensor_parallel_plan

    for spec in SPECS:
        cfg = DecoderConfig(layer_spec=spec)
        plan, local = tensor_parallel_plan(Decoder(cfg, _spec(spec)))
        want = {"embed": "vocab_embedding", "head": "vocab_head"}
        for i in range(cfg.num_layers):
            want |= {f"layers.{i}.attn.qkv": "column", f"layers.{i}.attn.proj": "row",
                     f"layers.{i}.mlp.fc": "column_gated" if spec.startswith("gated") else "column",
                     f"layers.{i}.mlp.proj": "row"}
            if spec.endswith("qknorm"):
                want |= {f"layers.{i}.attn.q_norm": "per_head", f"layers.{i}.attn.k_norm": "per_head"}
        assert plan == want, spec  # norms, the attention core: replicated (not in the plan)
        assert local == {f"layers.{i}.attn": ("h", "kv") for i in range(cfg.num_layers)}


def test_a_family_declares_only_what_the_core_cannot_derive():
    """A declared pattern wins over the derived style of the modules it names; the rest is derived."""
    from zoo.parallel.apply import tensor_parallel_plan

    model = Decoder(DecoderConfig(), _spec("gated"))
    plan, _ = tensor_parallel_plan(model, {"layers.*.mlp.fc": "column"})
    assert plan["layers.*.mlp.fc"] == "column" and "layers.0.mlp.fc" not in plan
    assert plan["layers.0.attn.qkv"] == "column" and plan["embed"] == "vocab_embedding"


def test_the_layout_check_accepts_tp_for_a_family_without_a_plan():
    from zoo.config.layers import resolve
    from zoo.errors import ConfigError
    from zoo.parallel.layout import plan

    fam = _family()
    run = resolve(family=fam.name, flavor="tiny", model_cls=DecoderConfig, model_defaults=DecoderConfig(),
                  overrides=["parallel.tp=2"])
    assert plan(run, world_size=2, family=fam).tp == 2
    own = dataclasses.replace(fam, build=lambda cfg, spec: nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ConfigError, match="declares no tp_plan, and its model holds none of the core's layers"):
        plan(run, world_size=2, family=own)


@pytest.mark.parametrize("seed", [0, 1])
def test_tp2_of_a_family_without_a_plan_equals_one_process(seed):
    for cfg in _configs(seed):
        ref = _run(cfg, 1)
        for got in run_distributed(_run, 2, cfg, 2, timeout=180):
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), cfg
            assert got["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{cfg} {name}")
