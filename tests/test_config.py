"""Layered configuration: defaults < flavor/recipe < YAML files < command line, type checks,
suggestions, layouts, and the resolved config written to the run directory."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest
import yaml

from zoo import config as C
from zoo.errors import ConfigError
from zoo.parallel import layout


@dataclass(kw_only=True)
class Inner:
    depth: int = 2


@dataclass(kw_only=True)
class ModelCfg:
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 256
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    layer_spec: str = "dense"
    tower: Inner = dataclasses.field(default_factory=Inner)


def resolve(overrides=(), files=(), recipe=(), defaults=None):
    return C.resolve(family="fam", flavor="tiny", model_cls=ModelCfg, model_defaults=defaults or ModelCfg(),
                     recipe=recipe, files=files, overrides=overrides)


def test_layers_apply_lowest_first(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("train:\n  steps: 10\n  seed: 7\noptimizer:\n  lr: 1.0e-3\nmodel:\n  hidden_size: 96\n")
    b.write_text("train: {steps: 20}\n")
    run = resolve(
        recipe=[("recipe", {"train.steps": 5, "train.micro_batch_size": 3, "optimizer.lr": 0.5})],
        files=[(str(a), C.read_yaml(a)), (str(b), C.read_yaml(b))],
        overrides=["train.steps=30", "model.num_layers=8"],
        defaults=ModelCfg(hidden_size=32),
    )
    assert run.train.steps == 30  # command line beats both files and the recipe
    assert run.train.seed == 7  # file beats the section default
    assert run.train.micro_batch_size == 3  # recipe beats the section default
    assert run.optimizer.lr == 1e-3  # file beats recipe
    assert run.model.hidden_size == 96 and run.model.num_layers == 8
    assert run.train.precision == "fp32"  # untouched default


def test_unknown_keys_suggest_the_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'train.step' \(did you mean train.steps"):
        resolve(overrides=["train.step=3"])
    with pytest.raises(ConfigError, match=r"did you mean optimizer.lr=3\?"):
        resolve(overrides=["optimiser.lr=3"])
    with pytest.raises(ConfigError, match=r"did you mean model.hidden_size"):
        resolve(overrides=["model.hiden_size=3"])


def test_other_frameworks_names_get_zoos_key_with_their_value(tmp_path):
    """Megatron's, Megatron-Bridge/DFM's and Hugging Face's names for a setting (and zoo's own key
    under the wrong section) fail with zoo's key and the user's value, ready to paste."""
    for text, form in [("train.train_iters=5", "train.steps=5"),  # DFM's override
                       ("model.tensor_model_parallel_size=4", "parallel.tp=4"),
                       ("checkpoint.load_checkpoint=/ck/iter_5000", "checkpoint.load=/ck/iter_5000"),
                       ("learning_rate=3e-4", "optimizer.lr=3e-4"),  # Hugging Face's TrainingArguments
                       ("bf16=true", "train.precision=bf16"),
                       ("model.num_attention_heads=8", "model.num_heads=8")]:
        with pytest.raises(ConfigError, match=rf"unknown key '{re.escape(text.split('=')[0])}' \(in zoo: {re.escape(form)}\)$"):
            resolve(overrides=[text])
    for text, form in [("train.lr=0.1", "optimizer.lr=0.1"), ("seq_length=128", "train.seq_length=128")]:
        with pytest.raises(ConfigError, match=rf" \(did you mean {re.escape(form)}\?\)$"):  # zoo's key, another section
            resolve(overrides=[text])
    bridge = tmp_path / "bridge.yaml"  # a Megatron-Bridge recipe's sections
    bridge.write_text("model:\n  tensor_model_parallel_size: 2\n")
    with pytest.raises(ConfigError, match=r"bridge.yaml: unknown key 'model.tensor_model_parallel_size' \(in zoo: parallel.tp=2\)"):
        resolve(files=[(str(bridge), C.read_yaml(bridge))])
    bridge.write_text("dataset:\n  dataset_path: /data/wds\n")  # a section zoo does not have
    with pytest.raises(ConfigError, match=r"unknown key 'dataset.dataset_path' \(in zoo: data.path=/data/wds\)"):
        resolve(files=[(str(bridge), C.read_yaml(bridge))])
    # nothing offered where zoo has no such key for this model, or where the value asks for nothing
    for text in ("model.kv_channels=8", "bf16=false"):
        with pytest.raises(ConfigError, match=r"unknown key '[\w.]+'") as err:
            resolve(overrides=[text])
        assert "in zoo" not in str(err.value) and "head_dim" not in str(err.value) and "precision" not in str(err.value)


def test_every_foreign_name_leads_to_a_key_zoo_has():
    """The translation table names only keys that exist: a section key, or a model key of some
    installed family."""
    from zoo.config import foreign
    from zoo.config.layers import dotted_keys
    from zoo.registry import get_registry

    keys = {k for name, cls in C.SECTIONS.items() for k in dotted_keys(cls, name)}
    models = {k for entry in get_registry().families.values() for k in dotted_keys(entry.family.config, "model")}
    for name, form in foreign.NAMES.items():
        key = form.split("=", 1)[0]
        if form.startswith("nothing"):  # a sentence: what it names exists
            named = re.findall(rf"\b(?:{'|'.join(C.SECTIONS)})\.[a-z_]+", form)
            assert all(k in keys for k in named), (name, form)
        elif key.startswith("--"):
            assert key.split()[0] in ("--run-dir", "--config"), (name, form)
        else:
            assert key in (models if key.startswith("model.") else keys), (name, form)
        assert name == name.lower() and "-" not in name


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  micro_batch: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'train.micro_batch' \(did you mean train.micro_batch_size"):
        resolve(files=[(str(bad), C.read_yaml(bad))])
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML"):
        C.read_yaml(broken)
    with pytest.raises(ConfigError, match=r"missing.yaml: config file not found"):
        C.read_yaml(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list.yaml: a config file must be a mapping"):
        C.read_yaml(listy)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.steps=abc", "train.steps='abc': expected int"),
        ("train.steps=1.5", "expected int"),
        ("train.precision=fp8", "expected one of 'fp32', 'bf16', 'fp16'"),
        ("model.tie_embeddings=1", "expected bool"),
        ("optimizer.lr=fast", "expected float"),
        ("train.global_batch_size=[1]", "expected int or null"),
        ("model.tower=3", "is a group of keys"),
        ("train.steps.x=1", "has no sub-keys"),
        ("train", "not an override"),
        ("optimizer.lr_mult={head.*:0.5}", "expected dict[str, float], got dict (YAML needs a space after ':'"),
    ],
)
def test_bad_values_name_key_and_expected_type(override, message):
    with pytest.raises(ConfigError, match="command line.*" + message.replace("[", r"\[").replace("(", r"\(")):
        resolve(overrides=[override])


@pytest.mark.parametrize(("override", "message"), [
    ("train.initial_loss_scale=0", "initial_loss_scale=0.0 must be a positive finite number"),
    ("train.initial_loss_scale=inf", "initial_loss_scale=inf must be a positive finite number"),
    ("train.loss_scale_window=0", "loss_scale_window=0 must be at least 1"),
])
def test_bad_loss_scale_settings_fail_when_the_config_resolves(override, message):
    """Caught with the configuration (a dry run shows them), not when the trainer is built."""
    with pytest.raises(ConfigError, match=f"train: {message}.*command line"):
        resolve(overrides=[override])
    ok = resolve(overrides=["train.initial_loss_scale=1024"])
    assert ok.train.initial_loss_scale == 1024.0


def test_values_are_converted_losslessly():
    run = resolve(overrides=[
        "train.steps=1e3", "optimizer.lr=3e-4", "optimizer.weight_decay=0", "train.global_batch_size=null",
        "data.path=0.5 a 0.5 b", "data.split=949,50,1", "model.tower.depth=5", "model.rope_theta=500000",
        "data.path=[0.3, x, 0.7, y]",
    ])
    assert run.train.steps == 1000 and isinstance(run.train.steps, int)
    assert run.optimizer.lr == 3e-4 and isinstance(run.optimizer.weight_decay, float)
    assert run.train.global_batch_size is None
    assert run.data.split == "949,50,1"
    assert run.data.path == [0.3, "x", 0.7, "y"]
    assert run.model.tower.depth == 5 and isinstance(run.model.tower, Inner)
    assert run.model.rope_theta == 500000.0


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="parallel: zero=2"):
        resolve(overrides=["parallel.zero=2"])
    with pytest.raises(ConfigError, match="global_batch_size=10 is not a multiple of micro_batch_size=4"):
        resolve(overrides=["train.micro_batch_size=4", "train.global_batch_size=10"])
    with pytest.raises(ConfigError, match="order="):
        resolve(overrides=["parallel.order=tp-dp-pp"])


def test_resolved_yaml_round_trips(tmp_path):
    run = resolve(overrides=["train.steps=12", "model.tower.depth=3", "data.path=[1, a]", "parallel.tp=2"])
    path = tmp_path / "config.yaml"
    path.write_text(run.to_yaml())
    tree = C.read_yaml(path)
    assert tree["family"] == "fam" and tree["flavor"] == "tiny"
    again = resolve(files=[(str(path), tree)])
    assert again == run


def plan(world, overrides=(), model=None):
    run = resolve(overrides=overrides, defaults=model)
    return layout.plan(run, world_size=world)


def test_layout_derives_dp_and_accumulation():
    lay = plan(8, ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=16"])
    assert (lay.tp, lay.pp, lay.dp, lay.cp) == (2, 2, 2, 1)
    assert lay.grad_accum == 16 // (2 * 2)
    assert (lay.etp, lay.expert_dp) == (1, 8 // (1 * 1 * 2))  # experts are never TP-split: etp=1, edp = world / (ep * pp)
    assert "world 8 = tp=2 x cp=1 x dp=2 x pp=2" in lay.describe()
    assert "experts" not in lay.describe()  # a dense model has no expert grid to describe
    ramp = plan(2, ["train.micro_batch_size=2", "train.global_batch_size=16", "train.rampup_batch_size=[4,4,1000]"])
    assert "global batch 16 (ramped up from 4 by 4 over 1,000 samples) = micro 2 x dp 2 x accumulation 4" \
        in ramp.describe()


@dataclasses.dataclass
class MoECfg(ModelCfg):
    num_experts: int = 4


def test_fsdp_layouts_describe_what_shards_and_what_replicates():
    assert plan(4, ["parallel.fsdp=4"]).describe().startswith("world 4 = tp=1 x cp=1 x dp=4 x pp=1 (fsdp over 4 ranks)")
    assert "(fsdp over dp x cp = 4 ranks)" in plan(4, ["parallel.fsdp=2", "parallel.cp=2"]).describe()
    assert "(hsdp: fsdp over 2 ranks x 2 replicas)" in plan(4, ["parallel.fsdp=2"]).describe()
    assert "(hsdp: fsdp over fsdp x cp = 4 ranks x 2 replicas)" in plan(8, ["parallel.fsdp=2", "parallel.cp=2"]).describe()


def test_a_model_with_experts_describes_their_grid():
    run = C.resolve(family="fam", flavor="tiny", model_cls=MoECfg, model_defaults=MoECfg(), recipe=(), files=(),
                    overrides=["parallel.ep=2"])
    lay = layout.plan(run, world_size=4)
    assert lay.experts and lay.describe().startswith("world 4 = tp=1 x cp=1 x dp=4 x pp=1 (experts: etp=1 x ep=2 x dp=2)")


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (6, ["parallel.tp=4"], "world size 6 is not divisible by tp\\*cp\\*pp"),
        (3, ["parallel.tp=3"], "tp=3 does not divide model.num_heads=4"),
        (8, ["parallel.pp=8"], "pp\\*vpp = 8\\*1 stages for 4 layers"),
        (2, ["parallel.sequence_parallel=true"], "sequence_parallel=true needs tp > 1"),
        (2, ["parallel.vpp=2"], "vpp=2 needs pp > 1"),
        (4, ["parallel.pp=2", "parallel.vpp=3"], "stages for 4 layers"),
        (2, ["parallel.ep=2"], "has no experts"),
        (2, ["parallel.cp=2", "train.seq_length=6"], "divisible by 2\\*cp"),
        (2, ["model.vocab_size=255", "parallel.tp=2", "model.num_heads=2"], "tp=2 does not divide model.vocab_size=255"),
        (4, ["train.micro_batch_size=2", "train.global_batch_size=6"], "not a multiple of micro_batch_size\\*dp"),
        (4, ["parallel.fsdp=3"], "fsdp=3 must divide the data-parallel size dp=4"),
        # every size on a batch-size ramp splits into the layout's micro-batches (x pp under vpp)
        (2, ["train.micro_batch_size=2", "train.global_batch_size=16", "train.rampup_batch_size=[2,2,40]"],
         "reaches a global batch of 2, not a multiple of micro_batch_size\\*dp = 4"),
        (2, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=2", "train.global_batch_size=16",
             "train.rampup_batch_size=[2,2,40]"], "reaches 1 micro-batch a step, which interleaved 1F1B"),
    ],
)
def test_invalid_layouts_fail_at_config_time(world, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(world, overrides)


def test_every_section_has_the_documented_names():
    keys = set(C.Layers(ModelCfg, ModelCfg()).keys())
    for key in ["train.steps", "train.micro_batch_size", "train.global_batch_size", "train.seq_length",
                "train.precision", "train.seed", "optimizer.lr", "optimizer.weight_decay", "schedule.warmup_steps",
                "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep",
                "parallel.sequence_parallel", "parallel.zero", "data.path", "checkpoint.dir",
                "checkpoint.interval", "checkpoint.resume", "logging.interval"]:
        assert key in keys, key
    assert yaml.safe_load(resolve().to_yaml())["train"]["precision"] == "fp32"


def test_megatron_values_that_decide_zoos_form():
    """--moe-layer-freq N with --num-layers spells the pattern (Megatron: layer i is MoE iff
    i % N == 0); the load-balancing type's value picks the answer."""
    from zoo.config import foreign
    from zoo.config.layers import dotted_keys
    from zoo.registry import get_registry

    fam = get_registry().get("mixtral").family
    keys = {k for name, cls in C.SECTIONS.items() for k in dotted_keys(cls, name)} | set(dotted_keys(fam.config, "model"))
    argv = ["--num-layers", "6", "--moe-layer-freq", "3", "--moe-router-load-balancing-type", "none"]
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        " (in zoo: model.num_layers=6 model.pattern=ETTETT model.aux_loss_coeff=0)"
    argv[-1] = "aux_loss"
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys).endswith(
        "; nothing to set: the Switch aux loss is on by default (model.aux_loss_coeff))")
    argv[-1] = "seq_aux_loss"
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys).endswith(
        " model.aux_loss_convention=sequence)")
    # Megatron's lengths in samples, and the warmup as a fraction: zoo's steps
    argv = ["--train-samples", "1000", "--global-batch-size", "32", "--lr-warmup-samples", "320", "--lr-decay-samples",
            "960"]
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        " (in zoo: train.steps=32 train.global_batch_size=32 schedule.warmup_steps=10 schedule.decay_steps=30)"
    for ramp in ("[32,32,0]", "[32,30,1000]", "[256,32,1000]", "[32,32]"):  # no ramp, off the steps, none left, 2
        with pytest.raises(ConfigError, match=r"rampup_batch_size=\[.*\]: "):
            resolve(overrides=["train.global_batch_size=256", f"train.rampup_batch_size={ramp}"])
    argv = ["--rampup-batch-size", "32", "32", "1000", "--global-batch-size", "256"]
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        " (in zoo: train.rampup_batch_size=[32,32,1000] train.global_batch_size=256)"
    argv = ["--train-iters", "200", "--lr-warmup-fraction", "0.01"]
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        " (in zoo: train.steps=200 schedule.warmup_steps=2)"
    # Megatron's sliding window (left, right) and the layers it skips, as megatron-core decides them
    from megatron.core.transformer.utils import is_layer_window_attention

    # the list forms, which Megatron evaluates as Python and zoo reads without evaluating
    argv = ["--moe-layer-freq", "([0]+[1]*3)", "--window-attn-skip-freq", "[1,0]*2"]
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        " (in zoo: model.pattern=TEEE model.window_layers=[0,2])"
    for text in ("__import__('os').system('x')", "[1]*100000*100000", "[2, 1]", "[]"):
        assert foreign.int_list(text) is None, text
    argv = ["--num-layers", "8", "--window-size", "(4095,0)", "--window-attn-skip-freq", "3"]
    sliding = [i for i in range(8) if is_layer_window_attention((4095, 0), 3, i + 1)]  # (1-based layer numbers)
    assert foreign.flag_hint(argv, [a for a in argv if a.startswith("--")], keys) == \
        f" (in zoo: model.num_layers=8 model.sliding_window=4096 model.window_layers=[{','.join(map(str, sliding))}])"
    for size, answer in (("-1,0", "nothing to set: a left size of -1 is no window"),
                         ("4,4", "nothing like it: zoo's sliding windows are causal")):
        assert foreign.flag_hint(["--window-size", size], ["--window-size"], keys).startswith(f" (in zoo: {answer}")
