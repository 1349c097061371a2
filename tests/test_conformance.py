"""The conformance suite over every installed family (the registry drives the tests), and proof
that the suite catches the faults it claims to."""

from __future__ import annotations

import pytest
from _core_helpers import MODEL_MODULE, plugin_module, registry_of

from zoo.testing.conformance import check_family, installed_families
from zoo.testing.plugins import fake_distribution

FAMILIES = installed_families()


def test_something_is_installed():
    # The example plugin is installed by the README's command; without it this suite checks nothing.
    assert "mixer" in FAMILIES


@pytest.mark.parametrize("name", FAMILIES)
def test_family_conforms(name):
    check_family(name)


def _family_with_model(root, pkg, model_source):
    fake_distribution(root, f"zoo-{pkg}", "1.0", plugins={pkg: pkg},
                      files={f"{pkg}.py": plugin_module(pkg), f"{pkg}_model.py": model_source})
    return registry_of(root)


def test_conforming_fake_family_passes(plugin_root):
    check_family("good", registry=_family_with_model(plugin_root, "good", MODEL_MODULE))


@pytest.mark.parametrize(
    ("fault", "replace", "message"),
    [
        ("nan", ('return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()), {}',
                 'return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()) * float("nan"), {}'),
         "loss is nan"),
        ("unused", ("self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)",
                    "self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size); self.unused = nn.Linear(2, 2)"),
         "received no gradient"),
        ("seedless", ("def build(cfg, spec):\n    return Tiny(cfg)",
                      "def build(cfg, spec):\n    torch.manual_seed(0)\n    return Tiny(cfg)"),
         "the seed does not change the initialisation"),
        ("metadiff", ("def build(cfg, spec):\n    return Tiny(cfg)",
                      "def build(cfg, spec):\n    m = Tiny(cfg)\n    if m.head.weight.is_meta:\n        m.extra = nn.Linear(3, 3)\n    return m"),
         "on the meta device"),
        # A forward that re-initialises its weights (a real bug) cannot learn.
        ("reinit", ("        x = self.embed(tokens)",
                    "        if not hasattr(self, 'snap'):\n            self.snap = [p.detach().clone() for p in self.parameters()]\n"
                    "        with torch.no_grad():\n            for p, s in zip(self.parameters(), self.snap):\n                p.copy_(s)\n"
                    "        x = self.embed(tokens)"),
         "did not lower the loss"),
        # A table of angles kept as a buffer: in bf16 it is rounded (RoPE's frequencies were such a table).
        ("rounded", [("self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)",
                      "self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)\n"
                      "        self.register_buffer('phase', torch.arange(cfg.hidden_size) * 97.3, persistent=False)"),
                     ("        x = self.embed(tokens)",
                      "        x = self.embed(tokens) + 10 * torch.sin(self.phase.float())")],
         "with bf16 parameters"),
    ],
)
def test_suite_catches_faults(plugin_root, fault, replace, message):
    source = MODEL_MODULE
    for old, new in replace if isinstance(replace, list) else [replace]:
        assert old in source
        source = source.replace(old, new)
    reg = _family_with_model(plugin_root, f"bad{fault}", source)
    with pytest.raises(AssertionError, match=message):
        check_family(f"bad{fault}", registry=reg)
