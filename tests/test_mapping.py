"""Declarative checkpoint mappings: each transform against a hand-written reference, strict
coverage in both directions, and round trips that are bitwise identical."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from zoo.checkpoint.mapping import (
    Fuse,
    Ignore,
    MappingError,
    MappingTable,
    Patch,
    Rename,
    Replicate,
    Split,
    StackExperts,
    Tie,
    Transpose,
    check_shapes,
    from_external,
    to_external,
)


@dataclass
class Cfg:
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 3
    hidden: int = 12
    num_experts: int = 3

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def hf_llama_like(cfg: Cfg, g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.randn(10, cfg.hidden, generator=g)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = torch.randn(cfg.q_size, cfg.hidden, generator=g)
        sd[p + "self_attn.k_proj.weight"] = torch.randn(cfg.kv_size, cfg.hidden, generator=g)
        sd[p + "self_attn.v_proj.weight"] = torch.randn(cfg.kv_size, cfg.hidden, generator=g)
        for e in range(cfg.num_experts):
            sd[p + f"moe.experts.{e}.w1.weight"] = torch.randn(5, cfg.hidden, generator=g)
        sd[p + "rotary_emb.inv_freq"] = torch.randn(2, generator=g)  # legacy buffer
    return sd


LLAMA_LIKE = MappingTable(rules=(
    Rename("embed.weight", "model.embed_tokens.weight"),
    Fuse("layers.{i}.qkv.weight", ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                                   "model.layers.{i}.self_attn.v_proj.weight"),
         groups="num_kv_heads", sizes=("q_size", "kv_size", "kv_size")),
    StackExperts("layers.{i}.experts.w1", "model.layers.{i}.moe.experts.{e}.w1.weight"),
    Tie("head.weight", to="embed.weight"),
    Ignore(r"model\.layers\.\d+\.rotary_emb\.inv_freq"),
))


def test_fuse_interleaves_whole_gqa_groups():
    cfg = Cfg()
    theirs = hf_llama_like(cfg, torch.Generator().manual_seed(0))
    ours = from_external(LLAMA_LIKE, theirs, cfg)
    q, k, v = (theirs[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    per_group_q = cfg.num_heads // cfg.num_kv_heads * cfg.head_dim
    expected = []
    for grp in range(cfg.num_kv_heads):  # [q heads of the group, its k head, its v head] per group
        expected += [q[grp * per_group_q:(grp + 1) * per_group_q], k[grp * cfg.head_dim:(grp + 1) * cfg.head_dim],
                     v[grp * cfg.head_dim:(grp + 1) * cfg.head_dim]]
    assert torch.equal(ours["layers.1.qkv.weight"], torch.cat(expected))
    # Stacked experts and the tie.
    assert torch.equal(ours["layers.0.experts.w1"][2], theirs["model.layers.0.moe.experts.2.w1.weight"])
    assert ours["head.weight"] is ours["embed.weight"]


def test_round_trip_is_bitwise_identical():
    cfg = Cfg()
    theirs = hf_llama_like(cfg, torch.Generator().manual_seed(1))
    back = to_external(LLAMA_LIKE, from_external(LLAMA_LIKE, theirs, cfg), cfg)
    kept = {k: v for k, v in theirs.items() if "inv_freq" not in k}
    assert back.keys() == kept.keys()
    for key in kept:
        assert torch.equal(back[key], kept[key]), key


GPT2_LIKE = MappingTable(
    rules=(
        Split(("h.{i}.q.weight", "h.{i}.k.weight", "h.{i}.v.weight"), "transformer.h.{i}.attn.c_attn.weight", transpose=True),
        Transpose("h.{i}.fc.weight", "transformer.h.{i}.mlp.c_fc.weight"),
        Ignore(r"transformer\.h\.\d+\.attn\.(masked_)?bias"),
    ),
    import_prefixes=(("transformer.", ""),),
)


def test_split_and_transpose_follow_conv1d_layout():
    cfg = Cfg()
    d = 4
    c_attn = torch.randn(d, 3 * d)  # Conv1D keeps [in, out]; q|k|v along out
    c_fc = torch.randn(d, 4 * d)
    theirs = {}
    for i in range(cfg.num_layers):
        theirs[f"transformer.h.{i}.attn.c_attn.weight"] = c_attn + i
        theirs[f"transformer.h.{i}.mlp.c_fc.weight"] = c_fc + i
        theirs[f"transformer.h.{i}.attn.bias"] = torch.ones(1)
    ours = from_external(GPT2_LIKE, theirs, cfg)
    assert torch.equal(ours["h.1.k.weight"], (c_attn + 1)[:, d:2 * d].T)
    assert torch.equal(ours["h.0.fc.weight"], c_fc.T)
    back = to_external(GPT2_LIKE, ours, cfg)
    assert torch.equal(back["transformer.h.1.attn.c_attn.weight"], c_attn + 1)
    # Files saved from the base model lack the "transformer." prefix.
    bare = {k.removeprefix("transformer."): v for k, v in theirs.items()}
    again = from_external(GPT2_LIKE, bare, cfg)
    assert all(torch.equal(again[k], ours[k]) for k in ours)


def test_strict_coverage_lists_offending_keys():
    cfg = Cfg()
    theirs = hf_llama_like(cfg, torch.Generator().manual_seed(2))
    extra = {**theirs, "model.layers.0.surprise.weight": torch.ones(1)}
    with pytest.raises(MappingError, match=r"external keys not consumed by any rule: model\.layers\.0\.surprise\.weight"):
        from_external(LLAMA_LIKE, extra, cfg)
    missing = {k: v for k, v in theirs.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(MappingError, match=r"missing in the external state: model\.layers\.1\.self_attn\.k_proj\.weight"):
        from_external(LLAMA_LIKE, missing, cfg)
    ours = from_external(LLAMA_LIKE, theirs, cfg)
    ours["stray.weight"] = torch.ones(1)
    with pytest.raises(MappingError, match=r"zoo keys not consumed by any rule: stray\.weight"):
        to_external(LLAMA_LIKE, ours, cfg)
    twice = MappingTable(rules=(Rename("a", "x"), Rename("b", "x")))
    with pytest.raises(MappingError, match=r"external keys written more than once: x"):
        to_external(twice, {"a": torch.ones(1), "b": torch.ones(1)}, cfg)


def test_uneven_fuse_sizes_are_checked():
    bad = Cfg(head_dim=2)  # the sizes no longer add up to the fused tensor
    ours = from_external(LLAMA_LIKE, hf_llama_like(Cfg(), torch.Generator().manual_seed(3)), Cfg())
    with pytest.raises(MappingError, match="do not add up"):
        to_external(LLAMA_LIKE, ours, bad)


def test_check_shapes_names_the_first_mismatch():
    with pytest.raises(MappingError, match=r"w has shape \(3, 2\), the model expects \(2, 2\)"):
        check_shapes({"w": torch.ones(2, 2)}, {"w": torch.ones(3, 2)}, what="ckpt")
    with pytest.raises(MappingError, match=r"missing v; unexpected u"):
        check_shapes({"v": torch.ones(1)}, {"u": torch.ones(1)}, what="ckpt")


def test_patch_rule_maps_a_convolution_to_the_linear_over_patch_features():
    @dataclass
    class Cfg:
        patch_size: int = 2
        in_channels: int = 3
        num_layers: int = 2

    cfg = Cfg()
    conv = torch.randn(5, 3, 2, 2)
    table = MappingTable(rules=(Patch("embed.weight", "proj.weight"),
                                Replicate("t.weight", "blocks.{i}.t.weight")))
    t = torch.randn(4, 4)
    theirs = {"proj.weight": conv, "blocks.0.t.weight": t, "blocks.1.t.weight": t.clone()}
    ours = from_external(table, theirs, cfg)
    x = torch.randn(1, 3, 4, 6)
    want = torch.nn.functional.conv2d(x, conv, stride=2)  # (1, 5, 2, 3)
    # the image's patches with features ordered (ph, pw, C), in raster order
    patches = x.reshape(1, 3, 2, 2, 3, 2).permute(0, 2, 4, 3, 5, 1).reshape(1, 6, 12)
    got = (patches @ ours["embed.weight"].t()).reshape(1, 2, 3, 5).permute(0, 3, 1, 2)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(ours["t.weight"], t)
    back = to_external(table, ours, cfg)
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], v) for k, v in theirs.items())
    with pytest.raises(MappingError, match=r"blocks\.1\.t\.weight differs from blocks\.0\.t\.weight"):
        from_external(table, dict(theirs, **{"blocks.1.t.weight": t + 1}), cfg)
