"""Registry behaviour: discovery, listing, conflicts, broken plugins, suggestions, filtering,
hook validation. Fake distributions are found through importlib.metadata like installed ones."""

from __future__ import annotations

import json

import pytest
from _core_helpers import add_family_dist, registry_of, run_zoo

from zoo.errors import PluginError, UnknownNameError
from zoo.testing.plugins import fake_distribution


def test_zoo_list_shows_families_flavors_and_origin(plugin_root):
    add_family_dist(plugin_root, "zoo-falconlike", "falconlike_plugin", "falcon", version="2.5.1",
                    aliases=("falcon3",), flavors='{"tiny": tiny, "7B": tiny}')
    out = run_zoo("list", path=plugin_root)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("falcon "))
    assert "falcon3" in line and "tiny,7B" in line and "zoo-falconlike 2.5.1" in line
    # First-party and third-party plugins are listed beside it, through the same path.
    assert any(ln.startswith("mixer ") and "acme-mixer" in ln for ln in out.stdout.splitlines())
    assert any(ln.startswith("llama ") and "zoo-gpt" in ln for ln in out.stdout.splitlines())
    data = json.loads(run_zoo("list", "--json", path=plugin_root).stdout)
    fam = next(f for f in data["families"] if f["name"] == "falcon")
    assert fam == {"name": "falcon", "aliases": ["falcon3"], "flavors": ["tiny", "7B"], "task": "causal_lm",
                   "distribution": "zoo-falconlike", "version": "2.5.1", "entry_point": "falcon"}


def test_two_plugins_claiming_one_name_name_both_distributions(plugin_root):
    add_family_dist(plugin_root, "dist-one", "one_plugin", "llama", entry="one")
    add_family_dist(plugin_root, "dist-two", "two_plugin", "llama", entry="two", version="3.0")
    reg = registry_of(plugin_root)
    with pytest.raises(PluginError) as e:
        reg.get("llama")
    assert "dist-one 1.0" in str(e.value) and "dist-two 3.0" in str(e.value)
    out = run_zoo("train", "--model", "llama", "--dry-run", path=plugin_root)
    assert out.returncode == 1
    assert "dist-one" in out.stderr and "dist-two" in out.stderr
    assert "CONFLICT" in run_zoo("list", path=plugin_root).stdout


def test_alias_clash_is_a_conflict_too(plugin_root):
    add_family_dist(plugin_root, "dist-a", "a_plugin", "alpha", aliases=("shared",))
    add_family_dist(plugin_root, "dist-b", "b_plugin", "beta", aliases=("shared",))
    reg = registry_of(plugin_root)
    assert reg.get("alpha").family.name == "alpha" and reg.get("beta").family.name == "beta"
    with pytest.raises(PluginError, match="dist-a.*dist-b"):
        reg.get("shared")


def test_broken_plugin_is_listed_with_its_error_and_others_keep_working(plugin_root):
    add_family_dist(plugin_root, "zoo-good", "good_plugin", "good")
    fake_distribution(plugin_root, "zoo-broken", "0.9", plugins={"broken": "broken_plugin"},
                      files={"broken_plugin.py": "import does_not_exist_anywhere\n"})
    out = run_zoo("list", path=plugin_root)
    assert out.returncode == 0
    assert any(ln.startswith("good ") for ln in out.stdout.splitlines())
    assert "BROKEN plugin 'broken' (zoo-broken 0.9)" in out.stdout
    assert "does_not_exist_anywhere" in out.stdout
    assert run_zoo("list", "--strict", path=plugin_root).returncode == 1
    sel = run_zoo("info", "broken", path=plugin_root)
    assert sel.returncode == 1
    assert "zoo-broken" in sel.stderr and "does_not_exist_anywhere" in sel.stderr
    assert run_zoo("info", "good", path=plugin_root).returncode == 0


def test_plugin_whose_hook_raises_is_broken_not_fatal(plugin_root):
    add_family_dist(plugin_root, "zoo-raiser", "raiser_plugin", "raiser",
                    body="def zoo_datasets():\n    raise RuntimeError('no datasets today')\n")
    reg = registry_of(plugin_root)
    [bad] = reg.broken
    assert "zoo_datasets() raised RuntimeError: no datasets today" in bad.error and "zoo-raiser" in bad.error


def test_unknown_name_suggests_the_closest(plugin_root):
    out = run_zoo("info", "lama")
    assert out.returncode == 2
    assert "did you mean llama" in out.stderr
    add_family_dist(plugin_root, "zoo-falconlike", "falconlike_plugin", "falcon")
    with pytest.raises(UnknownNameError, match="did you mean falcon"):
        registry_of(plugin_root).get("falcn")


def test_zoo_plugins_restricts_what_loads(plugin_root):
    add_family_dist(plugin_root, "zoo-first", "first_plugin", "first")
    add_family_dist(plugin_root, "zoo-second", "second_plugin", "second")
    reg = registry_of(plugin_root, only="first")
    assert set(reg.families) == {"first"}
    with pytest.raises(UnknownNameError, match="excludes"):
        reg.get("second")
    by_dist = registry_of(plugin_root, only="zoo-second")
    assert set(by_dist.families) == {"second"}
    out = run_zoo("list", path=plugin_root, env={"ZOO_PLUGINS": "second"})
    names = [ln.split()[0] for ln in out.stdout.splitlines()[1:] if ln and not ln.startswith(" ")]
    assert "second" in names and "first" not in names and "mixer" not in names
    # The option overrides the variable.
    out = run_zoo("--plugins", "first", "list", path=plugin_root, env={"ZOO_PLUGINS": "second"})
    assert any(ln.startswith("first ") for ln in out.stdout.splitlines())
    assert not any(ln.startswith("second ") for ln in out.stdout.splitlines())


def test_hook_with_wrong_signature_is_rejected_naming_the_plugin(plugin_root):
    fake_distribution(plugin_root, "zoo-wrongsig", "1.2", plugins={"wrongsig": "wrongsig_plugin"},
                      files={"wrongsig_plugin.py": "def zoo_families(registry):\n    return []\n"})
    [bad] = registry_of(plugin_root).broken
    assert bad.plugin.distribution == "zoo-wrongsig"
    assert "plugin 'wrongsig' (zoo-wrongsig 1.2)" in bad.error and "registry" in bad.error


def test_misspelt_hook_is_rejected(plugin_root):
    fake_distribution(plugin_root, "zoo-typo", "1.0", plugins={"typo": "typo_plugin"},
                      files={"typo_plugin.py": "def zoo_familes():\n    return []\n"})
    [bad] = registry_of(plugin_root).broken
    assert "zoo_familes" in bad.error and "zoo-typo" in bad.error


@pytest.mark.parametrize(
    ("flavors", "body", "message"),
    [
        ('{"small": tiny}', "", "'tiny' flavor"),
        ('{"tiny": tiny}', "FAMILY = __import__('dataclasses').replace(FAMILY, name='Bad Name')", "must match"),
        ('{"tiny": tiny}', "FAMILY = __import__('dataclasses').replace(FAMILY, specs={'dense': 3})", "ModelSpec"),
        ('{"tiny": tiny}', "FAMILY = __import__('dataclasses').replace(FAMILY, recipe={'steps': 3})", "section.key"),
        ('{"tiny": tiny}', "FAMILY = __import__('dataclasses').replace(FAMILY, metrics=(__import__('zoo').MetricSpec("
                           "name='load', when='moe_layer'),))", "when='moe_layer' must name an attribute of the model config"),
    ],
)
def test_contract_violations_are_rejected_at_registration(plugin_root, flavors, body, message):
    add_family_dist(plugin_root, "zoo-bad", "bad_plugin", "bad", flavors=flavors, body=body)
    reg = registry_of(plugin_root)
    [bad] = reg.broken
    assert message in bad.error and "zoo-bad" in bad.error
    assert not reg.families


def test_non_frozen_spec_is_rejected(plugin_root):
    body = '''
from dataclasses import dataclass, replace
@dataclass(kw_only=True)
class Loose:
    width: int = 3
FAMILY = replace(FAMILY, specs={"dense": replace(SPEC, blocks={"A": replace(SPEC.blocks["A"], mixer=Loose())})})
'''
    add_family_dist(plugin_root, "zoo-loose", "loose_plugin", "loose", body=body)
    [bad] = registry_of(plugin_root).broken
    assert "Loose must be a frozen dataclass" in bad.error


def test_plugin_commands_run_and_cannot_shadow_core_commands(plugin_root):
    files = {
        "cmd_plugin.py": """
            from zoo import CommandSpec
            def zoo_commands():
                return [CommandSpec(name="hello", help="say hello", add_arguments=__name__ + "_impl:args",
                                    run=__name__ + "_impl:run"),
                        CommandSpec(name="list", help="shadow", add_arguments=__name__ + "_impl:args",
                                    run=__name__ + "_impl:run")]
        """,
        "cmd_plugin_impl.py": """
            def args(p):
                p.add_argument("--name", default="world")
            def run(args):
                print(f"hello {args.name}")
                return 0
        """,
    }
    fake_distribution(plugin_root, "zoo-hello", "0.1", plugins={"hello": "cmd_plugin"}, files=files)
    out = run_zoo("hello", "--name", "zoo", path=plugin_root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello zoo"
    listing = run_zoo("list", path=plugin_root).stdout
    assert "zoo hello (zoo-hello)" in listing
    assert "SHADOWED command 'list'" in listing


def test_entry_point_group_finds_the_installed_example():
    from zoo.registry import load_registry

    reg = load_registry(only="mixer")
    entry = reg.get("causal-mixer")  # alias
    assert entry.family.name == "mixer"
    assert entry.plugin.distribution == "acme-mixer"


def test_a_metric_with_when_exists_only_for_configs_where_that_attribute_holds():
    import dataclasses

    from _trainer_family import FAMILY, CondConfig

    from zoo import MetricSpec

    fam = dataclasses.replace(FAMILY, metrics=(MetricSpec(name="always"), MetricSpec(name="classes", when="num_classes"),
                                               MetricSpec(name="typo", when="num_clases")))
    with pytest.raises(PluginError, match=r"family 'cond': metric 'typo' has when='num_clases'.*CondConfig"):
        fam.metrics_for(CondConfig())
    fam = dataclasses.replace(fam, metrics=fam.metrics[:2])
    assert [m.name for m in fam.metrics_for(CondConfig())] == ["always", "classes"]
    assert [m.name for m in fam.metrics_for(CondConfig(num_classes=0))] == ["always"]
