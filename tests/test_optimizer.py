"""The trainer's AdamW kernels (`optimizer.implementation`): each computes the update of
Loshchilov & Hutter's AdamW written out here (bias-corrected moments, decoupled weight decay), and
``fused`` falls back to ``foreach`` with one note where torch has no fused kernel."""

from __future__ import annotations

import pytest
import torch

from zoo.config.sections import OptimizerConfig
from zoo.training.optim import adamw_factory


def _paper_adamw(p: torch.Tensor, grads: list[torch.Tensor], *, lr: float, b1: float, b2: float, eps: float,
                 wd: float) -> torch.Tensor:
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_each_implementation_follows_the_papers_update(impl):
    cfg = OptimizerConfig(implementation=impl, lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(16, 8, generator=gen), torch.randn(8, generator=gen)
    grads = [[torch.randn(16, 8, generator=gen), torch.randn(8, generator=gen)] for _ in range(5)]
    params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    opt = adamw_factory(cfg)([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
    assert opt.defaults["fused"] is (True if impl == "fused" else None)
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()
    kw = dict(lr=1e-2, b1=0.8, b2=0.9, eps=1e-6)
    torch.testing.assert_close(params[0].double(), _paper_adamw(w, [g[0] for g in grads], wd=0.1, **kw), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params[1].double(), _paper_adamw(b, [g[1] for g in grads], wd=0.0, **kw), rtol=1e-5, atol=1e-6)


def test_fused_falls_back_to_foreach_with_a_note(monkeypatch):
    real = torch.optim.AdamW

    def no_fused(*args, fused=None, **kw):  # what torch raises for a device without the kernel
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices\nmore")
        return real(*args, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    notes = []
    opt = adamw_factory(OptimizerConfig(), note=notes.append)([{"params": [torch.nn.Parameter(torch.ones(2))]}])
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert notes == ["note: optimizer.implementation=fused unavailable here, using foreach "
                     "(`fused=True` requires all the params to be floating point Tensors of supported devices)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sum_of_squares_matches_a_float64_sum(dtype):
    """The gradient norm's one-pass sum of squares (float32 rows, float64 total) against the float64
    sum, for sizes below, at and across its row length, and empty."""
    from zoo.parallel.apply import sum_of_squares

    gen = torch.Generator().manual_seed(0)
    for shape in [(7,), (2048,), (3, 2048), (1536, 513), (4096, 1024), (0,)]:
        x = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        exact = float(x.double().pow(2).sum())
        got = sum_of_squares(x)
        assert got.dtype == torch.float64
        assert abs(float(got) - exact) <= 1e-6 * exact + 1e-30, (shape, float(got), exact)
    # a transposed (non-contiguous) gradient reads the same elements
    x = torch.randn(300, 4100, generator=gen).to(dtype).t()
    assert float(sum_of_squares(x)) == pytest.approx(float(x.double().pow(2).sum()), rel=1e-6)


@pytest.mark.parametrize("kind", ["fused", "capturable", "foreach"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_loaded_state_is_placed_as_torchs_own_load_state_dict_places_it(kind, device):
    """A resumed run's optimizer state (`optimizer_state`) lands where torch's load_state_dict puts
    it for the same kernel: moments in the parameter's device and dtype, the step count on the device
    as float32 for fused and capturable AdamW (which read it there) and left as saved otherwise."""
    from zoo.parallel.sharding import optimizer_state

    p = torch.nn.Parameter(torch.randn(4, 3, device=device))
    saved = {"step": torch.tensor(7.0, dtype=torch.float64), "exp_avg": torch.randn(4, 3, dtype=torch.float64),
             "exp_avg_sq": torch.rand(4, 3, dtype=torch.float64)}
    theirs = torch.optim.AdamW([p], **{kind: True})
    theirs.load_state_dict({"state": {0: {k: v.clone() for k, v in saved.items()}},
                            "param_groups": [{**theirs.state_dict()["param_groups"][0], "params": [0]}]})
    ours = torch.optim.AdamW([p], **{kind: True})
    for field, value in saved.items():
        got, want = optimizer_state(ours.param_groups[0], p, field, value.clone()), theirs.state[p][field]
        assert (got.device, got.dtype) == (want.device, want.dtype), field
        assert torch.equal(got, want), field


SCHEDULES = [
    dict(warmup_steps=10, decay="cosine"),
    dict(warmup_steps=10, decay="linear", decay_steps=60),  # Megatron's --lr-decay-iters: the floor after it
    dict(warmup_steps=0, decay="cosine"),
    dict(warmup_steps=5, decay="constant", warmup_init_ratio=0.2),  # --lr-warmup-init
    dict(warmup_steps=8, decay="inverse_sqrt"),
    *(dict(warmup_steps=10, decay="wsd", decay_steps=90, wsd_decay_steps=30, wsd_decay=s)
      for s in ("exponential", "linear", "cosine", "minus_sqrt")),
]


@pytest.mark.parametrize("kw", SCHEDULES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_schedules_equal_megatron_cores_scheduler(kw):
    """Every step of zoo's schedule against megatron-core's OptimizerParamScheduler: the same lr at
    num_steps = step, except in warmup where zoo is one step ahead (Megatron takes its first update
    at the warmup's initial lr, 0 by default)."""
    import warnings

    from zoo.config.sections import ScheduleConfig
    from zoo.training.optim import lr_at

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (megatron-core warns that Transformer Engine and Apex are missing)
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = ScheduleConfig(**kw, min_lr_ratio=0.1)
    peak, total = 3e-3, 100

    class Opt:
        param_groups = [{}]

    ref = OptimizerParamScheduler(
        Opt(), init_lr=peak * s.warmup_init_ratio, max_lr=peak, min_lr=peak * s.min_lr_ratio,
        lr_warmup_steps=s.warmup_steps, lr_decay_steps=s.decay_steps or total,
        lr_decay_style={"wsd": "WSD", "inverse_sqrt": "inverse-square-root"}.get(s.decay, s.decay),
        start_wd=0.1, end_wd=0.1, wd_incr_steps=total, wd_incr_style="constant",
        wsd_decay_steps=s.wsd_decay_steps or None, lr_wsd_decay_style=s.wsd_decay)
    got, want = [], []
    for step in range(total + 20):  # past the decay's end as well
        got.append(lr_at(step, peak=peak, warmup=s.warmup_steps, total=total, decay=s.decay, min_ratio=s.min_lr_ratio,
                         decay_steps=s.decay_steps, warmup_init_ratio=s.warmup_init_ratio,
                         wsd_decay_steps=s.wsd_decay_steps, wsd_decay=s.wsd_decay))
        ref.num_steps = step + 1 if step < s.warmup_steps else step
        want.append(ref.get_lr({}))
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert len(set(got)) > 2 or s.decay == "constant"


def test_bad_schedules_fail_with_one_clear_line():
    from zoo.config.sections import ScheduleConfig

    with pytest.raises(ValueError, match="decay=wsd needs wsd_decay_steps"):
        ScheduleConfig(decay="wsd")
    with pytest.raises(ValueError, match="decay_steps=5 ends the decay before warmup_steps=10"):
        ScheduleConfig(warmup_steps=10, decay_steps=5)
