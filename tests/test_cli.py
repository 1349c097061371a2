"""The `zoo` command line as a user meets it: exit codes, one-line errors, dry runs, a real
training run of the third-party example, and the frozen command surface."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import yaml
from _core_helpers import run_zoo

from zoo.cli import build_parser


@pytest.fixture
def here(capsys):
    """`zoo` in the test's process: the same `zoo.cli.main`, exit status and output without an
    interpreter start and torch import per command (~3 s each); the real training run, the help
    test and tests/test_packaging.py run it as a process."""
    import functools

    from zoo.testing import run_zoo as run_here

    return functools.partial(run_here, capsys)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_megatron_flags_are_answered_with_the_overrides_that_work(here):
    """A Megatron-LM training command's flags: one line giving zoo's overrides with their values,
    and those overrides, pasted, are a valid run."""
    out = here("train", "--model", "llama", "--tensor-model-parallel-size", "2", "--train-iters", "5", "--lr", "1e-3",
                  "--min-lr=1e-4", "--bf16", "--num-layers", "4", "--micro-batch-size=2", "--save", "ck", "--load", "ck",
                  "--dry-run")
    forms = ("parallel.tp=2 train.steps=5 optimizer.lr=1e-3 schedule.min_lr_ratio=0.1 train.precision=bf16 "
             "model.num_layers=4 train.micro_batch_size=2 --run-dir ck")  # (--load of --save's directory: resumed)
    line = _one_line(out.stderr)
    assert out.returncode == 2 and line.endswith(f"(in zoo: {forms})"), line
    assert line.startswith("zoo: error: zoo train: unrecognized arguments: --tensor-model-parallel-size")
    out = here("train", "--model", "llama", "--dry-run", "--world-size", "2", *forms.split())
    assert out.returncode == 0, out.stderr
    assert "tp: 2" in out.stdout and "steps: 5" in out.stdout and "num_layers: 4" in out.stdout
    assert "min_lr_ratio: 0.1" in out.stdout
    # A WSD schedule with Megatron's spellings, a warmup start, and flags zoo needs nothing for: the
    # overrides first (pasted, a valid run), then one sentence per flag that needs no setting.
    out = here("train", "--model", "llama", "--lr", "2e-3", "--lr-warmup-init", "2e-4", "--lr-warmup-iters", "10",
               "--lr-decay-style", "WSD", "--lr-decay-iters", "90", "--lr-wsd-decay-iters", "30",
               "--lr-wsd-decay-style", "minus_sqrt", "--overlap-grad-reduce", "--recompute-method", "uniform",
               "--recompute-num-layers", "1", "--dry-run")
    forms = ("optimizer.lr=2e-3 schedule.warmup_init_ratio=0.1 schedule.warmup_steps=10 schedule.decay=wsd "
             "schedule.decay_steps=90 schedule.wsd_decay_steps=30 schedule.wsd_decay=minus_sqrt train.recompute=full")
    line = _one_line(out.stderr)
    assert line.endswith(f"(in zoo: {forms}; nothing to set: gradient buckets are always reduced while backward runs)")
    out = here("train", "--model", "llama", "--dry-run", *forms.split())
    assert out.returncode == 0, out.stderr
    assert "decay: wsd" in out.stdout and "wsd_decay_steps: 30" in out.stdout and "warmup_init_ratio: 0.1" in out.stdout
    out = here("train", "--model", "clip", "--num-layers", "4", "--dry-run")  # CLIP has no model.num_layers
    assert out.returncode == 2 and "in zoo" not in _one_line(out.stderr)
    out = here("train", "--model", "clip", "--run_dir", "x", "--dry-run")  # a misspelt option of zoo's own
    assert out.returncode == 2 and _one_line(out.stderr).endswith("--run_dir (did you mean --run-dir?)")


def test_exit_codes_and_one_line_errors(here):
    assert here("version").returncode == 0
    out = here("frobnicate")
    assert out.returncode == 2 and "invalid choice" in _one_line(out.stderr)
    out = here("train", "--model", "mixer", "train.steps=0", "--dry-run")
    assert out.returncode == 2 and _one_line(out.stderr).startswith("zoo: error: train: steps=0 must be at least 1")
    out = here("train", "--model", "mixer", "--flavor", "tinny", "--dry-run")
    assert out.returncode == 2 and "did you mean tiny?" in _one_line(out.stderr)
    out = here("train", "--model", "mixer", "model.layer_spec=mixr", "--dry-run")
    assert out.returncode == 2 and "did you mean mixer?" in _one_line(out.stderr)
    out = here("train", "--dry-run")
    assert out.returncode == 2 and "--model is required" in _one_line(out.stderr)
    out = here("train", "--model", "mixer", "--config", "/nonexistent/x.yaml")
    assert out.returncode == 2 and "/nonexistent/x.yaml: config file not found" in _one_line(out.stderr)
    out = here("train", "--model", "mixer", "--dry-run", "--world-size", "0")  # (0 was the default 1, silently)
    assert out.returncode == 2 and "argument --world-size: 0: must be at least 1" in _one_line(out.stderr)


def test_debug_shows_the_traceback():
    out = run_zoo("--debug", "train", "--model", "mixer", "train.steps=x", "--dry-run")
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_a_reader_that_leaves_early_is_not_an_error():
    """`zoo list | head -1`: the pipe closes before zoo has written everything; zoo stops quietly
    with SIGPIPE's status instead of printing a BrokenPipeError."""
    import subprocess
    import sys

    # (the reading end is closed before the child starts: every write meets a broken pipe)
    proc = subprocess.Popen([sys.executable, "-m", "zoo", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_help_does_not_load_plugins_and_list_does_not_import_model_code(tmp_path):
    probe = (
        "import sys\n"
        "from zoo.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('acme_mixer')))\n"
        "print('torch' in sys.modules)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    import subprocess
    import sys

    def loaded(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True)
        return out.stdout.strip().splitlines()

    help_out = loaded("--help")
    assert help_out[-2:] == ["[]", "False"]  # no plugin module at all, and no torch
    list_out = loaded("list")
    assert list_out[-2] == "['acme_mixer', 'acme_mixer.plugin']"  # declarations only, no model
    assert list_out[-1] == "False"


def test_dry_run_prints_config_parameters_and_layout(here):
    out = here("train", "--model", "mixer", "--dry-run", "train.steps=7", "--world-size", "4", "parallel.pp=1")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["family"] == "mixer" and cfg["train"]["steps"] == 7 and cfg["parallel"]["pp"] == 1
    assert cfg["optimizer"]["lr"] == 3e-3  # from the family's recipe

    # Independent count: build the tiny flavor for real and count its parameters.
    from acme_mixer.model import build
    from acme_mixer.plugin import MIXER, tiny

    expected = sum(p.numel() for p in build(tiny(), MIXER).parameters())
    assert f"# parameters: {expected:,}" in out.stdout
    assert "# layout: world 4 = tp=1 x cp=1 x dp=4 x pp=1" in out.stdout
    # A dry run validates the layout against the family exactly as training does.
    refused = here("train", "--model", "mixer", "--dry-run", "--world-size", "4", "parallel.tp=2")
    assert refused.returncode == 2 and "family 'mixer' declares no tp_plan" in _one_line(refused.stderr)


def _unigram_entropy_nats() -> float:
    from pydoc_data.topics import topics

    data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_train_writes_run_directory_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    out = run_zoo("train", "--model", "mixer", "--run-dir", str(run_dir), "train.steps=60",
                  "train.eval_interval=60", "logging.interval=20", "train.seed=3")
    assert out.returncode == 0, out.stderr
    # what runs is said before the first step: family, size, data, layout and where it writes
    head = out.stdout.splitlines()[0]
    assert head.startswith("training mixer (tiny, ") and " on acme-pydoc-bytes to step 60; world 1 = " in head, head
    assert head.endswith(f"; run directory {run_dir}"), head
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["family"] == "mixer" and resolved["train"]["steps"] == 60 and resolved["train"]["seed"] == 3
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r)
        assert r["tokens_per_s"] > 0
    # Far below what a model that ignores context can reach: the corpus's byte unigram entropy.
    entropy = _unigram_entropy_nats()
    assert records[-1]["val_loss"] < entropy - 0.4, (records[-1], entropy)
    # The resolved config reruns as it is.
    again = run_zoo("train", "--config", str(run_dir / "config.yaml"), "--dry-run")
    assert again.returncode == 0, again.stderr
    assert yaml.safe_load(again.stdout) == resolved


def test_nan_loss_is_reported_with_the_step(tmp_path, here):
    out = here("train", "--model", "mixer", "--run-dir", str(tmp_path), "train.steps=30", "optimizer.lr=1e30",
                  "optimizer.grad_clip=0", "schedule.warmup_steps=0", "logging.progress=false")
    assert out.returncode == 1
    # Diverged: each non-finite step is skipped with a warning (train.skip_nonfinite=3), the fourth
    # in a row stops the run with one error line naming it.
    *warnings, error = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(warnings) == 3 and all(w.startswith("zoo: warning: step ") for w in warnings), out.stderr
    assert error.startswith("zoo: error: step ") and "4 non-finite step(s) in a row" in error, out.stderr


def test_layouts_a_family_cannot_run_are_refused_before_training(tmp_path, capsys):
    cases = [
        (("--model", "mixer", "parallel.tp=2", "--world-size", "2"), "family 'mixer' declares no tp_plan"),
        (("--model", "mixer", "parallel.pp=2", "--world-size", "2"), "family 'mixer' declares no pipeline spec"),
        (("--model", "mixer", "parallel.cp=2", "--world-size", "2"), "family 'mixer' does not support context parallelism"),
        (("--model", "llama", "parallel.ep=2", "--world-size", "2"), "ep=2 but the model has no experts"),
        (("--model", "llama", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "--world-size", "2"),
         "needs the micro-batches per step (1) to be a multiple of pp=2"),
        (("--model", "llama", "parallel.pp=2", "parallel.pp_layers=[1,2]", "--world-size", "2"),
         "pp_layers=[1, 2] sums to 3, the model has 2 layers"),
    ]
    from zoo.cli import main

    for args, message in cases:  # in this process: refused before any training, so no start-up cost
        capsys.readouterr()
        rc = main(["train", "--run-dir", str(tmp_path), *args])
        err = capsys.readouterr().err
        assert rc == 2 and message in _one_line(err), (args, err)


# The command surface is frozen here on purpose: adding a command or option is a deliberate act
# that updates this list, the README and docs/plugins.md together (torchtitan does the same).
SURFACE = {
    "list": ["--json", "--strict"],
    "info": ["name"],
    "version": [],
    "checkpoint": ["--diff", "--verify", "path", "what"],
    "train": ["--config", "--dry-run", "--flavor", "--model", "--run-dir", "--world-size", "overrides"],
    "convert": ["--dtype", "--from", "--max-shard-size", "--to", "--weights", "dst", "src"],
    "prepare": ["what"],
    "data": ["what"],
    "generate": ["--checkpoint", "--greedy", "--max-new-tokens", "--no-cache", "--prompt", "--seed", "--temperature",
                 "--tokenizer", "--top-k", "--top-p", "--weights", "--model", "--device", "--dtype",
                 # a conversation's turn (sft checkpoints' chat template)
                 "--chat", "--chat-template",
                 # image-text models (CLIP, LLaVA)
                 "--image", "--labels",
                 # diffusion models (DFM's snake_case spellings are the aliases listed last)
                 "--class", "--num_steps", "--guidance", "--guidance-form", "--solver", "--guidance-channels",
                 "--height", "--width",
                 "--num_video_frames", "--num-samples", "--nrow", "--output", "--video_save_path", "--text-encoder"],
}


def test_cli_surface_is_frozen():
    parser = build_parser(None)
    sub = next(a for a in parser._actions if a.dest == "command")
    surface = {}
    for name, p in sub.choices.items():
        surface[name] = sorted(
            (a.option_strings[-1] if a.option_strings and a.option_strings[-1].startswith("--") else
             (a.option_strings[0] if a.option_strings else a.dest))
            for a in p._actions if a.dest != "help"
        )
    assert surface == {k: sorted(v) for k, v in SURFACE.items()}
    top = sorted(a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help")
    assert top == ["--debug", "--plugins"]
