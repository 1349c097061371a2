"""A checkpoint format's parity harness: a library's model with random weights through the user's
path (``save_pretrained``, ``zoo convert --from``, ``zoo.load_model``), judged against the library's
own model: outputs within 1e-5 (fp32), the loss and every gradient of one backward within 1e-4
relative; then ``zoo convert --to`` and the library's ``from_pretrained`` with no missing,
unexpected or resized key and bitwise the same tensors. Or zoo refuses the draw: exit code 1 or 2,
one ``zoo: error:`` line, nothing written. Anything else raises `SilentDifference` with the draw
that reproduces it. A float32 difference is computed again in float64, where the same computation
agrees far closer and a different one keeps its difference.

zoo's own draws of every architecture it converts are in its ``tests/conversion``; a plugin with a
format of its own draws its configurations as `Draw` objects and calls `run` (docs/plugins.md).
A `Probe` says how a draw's models are fed and compared; `CAUSAL_LM` (token ids -> logits, the
next-token loss) is the default.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import torch

LOGITS_TOL = 1e-5
GRAD_TOL = 1e-4
# In float64 what is left is the float32 the libraries keep on purpose (transformers' RoPE tables
# are float32 in any dtype: ~1e-7); a different computation stays far above these.
LOGITS_TOL_64 = 1e-6
GRAD_TOL_64 = 1e-6


@dataclass
class Outcome:
    status: str  # "equal" | "refused"
    detail: str = ""


class SilentDifference(AssertionError):
    pass


@dataclass(frozen=True)
class Probe:
    """How a draw's two models are fed and compared. ``inputs(draw, generator)``: a tuple of tensors
    (floating ones are cast to the models' dtype); ``theirs(model, draw, inputs)`` and
    ``ours(model, draw, inputs)``: the outputs to compare and, where the model computes its own
    (CLIP's contrastive one), its loss, else None and ``loss(outputs, draw, inputs, seed)`` gives
    both sides'. ``prepare(model)`` runs on the library's model after its weights are drawn (make
    copies a release keeps equal equal); ``grads(grads)`` turns the library's gradients into those
    of the tensors zoo holds (one tensor for several copies: their sum)."""

    inputs: Callable[..., tuple[torch.Tensor, ...]]
    theirs: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    ours: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    loss: Callable[..., torch.Tensor] | None = None
    prepare: Callable[[torch.nn.Module], None] | None = None
    grads: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None


def _lm_inputs(draw: Draw, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    v = draw.vocab_size
    return (torch.randint(0, v, (draw.batch, draw.seq), generator=g),
            torch.randint(0, v, (draw.batch, draw.seq), generator=g))


def next_token_loss(out: torch.Tensor, draw: Draw, inputs: tuple[torch.Tensor, ...], seed: int) -> torch.Tensor:
    """Cross entropy of the logits against ``inputs[1]`` (at least in float32)."""
    logits = out.flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                             inputs[1].flatten())


CAUSAL_LM = Probe(inputs=_lm_inputs,
                  theirs=lambda model, draw, inputs: (model(input_ids=inputs[0], use_cache=False).logits, None),
                  ours=lambda model, draw, inputs: (model(inputs[0]), None), loss=next_token_loss)


@dataclass
class Draw:
    """One configuration of ``architecture``, as the library that owns it builds it (``build(config)``,
    random weights follow), fed and compared as ``probe`` says."""

    architecture: str
    library: str  # "transformers" | "diffusers"
    config: Any  # the library's config object (diffusers: the model's init kwargs)
    build: Callable[[Any], torch.nn.Module]
    probe: Probe = dataclass_field(default_factory=lambda: CAUSAL_LM)
    seq: int = 8
    batch: int = 2
    # An image-text checkpoint zoo reads the language model of: transformers' in-memory name of a
    # parameter -> the name zoo's table gives it (None: not part of zoo's model), and the class its
    # export loads with, with the in-memory name each kept tensor has there.
    file_name: Callable[[str], str | None] | None = None
    export_class: str | None = None
    export_name: Callable[[str], str | None] | None = None

    @property
    def vocab_size(self) -> int:  # (a text config's, under an image-text config)
        return getattr(self.config, "vocab_size", None) or self.config.text_config.vocab_size

    def shown(self) -> str:
        cfg = self.config.to_dict() if hasattr(self.config, "to_dict") else dict(self.config)
        keep = {k: v for k, v in sorted(cfg.items()) if k not in _NOISE}
        return f"{self.architecture} seq={self.seq} config={keep}"


_NOISE = {"transformers_version", "_name_or_path", "id2label", "label2id", "return_dict", "output_hidden_states",
          "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "dtype", "architectures"}


def randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
            if name.endswith(("A_log", "dt_bias", ".D")) or "norm" in name:
                p.add_(0.1 * noise)  # off their init values (ones, zeros), so a swapped tensor shows
            else:
                p.copy_(0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _zoo(*argv: str) -> tuple[int, str]:
    from zoo.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(list(argv))
    return code, err.getvalue()


def _refusal(code: int, err: str, dst: Path, draw: Draw) -> Outcome:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Writing", "Loading"))
             and "it/s]" not in ln]
    if code not in (1, 2) or len(lines) != 1 or not lines[0].startswith("zoo: error:") or "Traceback" in err:
        raise SilentDifference(f"zoo convert --from exited {code} without a one-line error:\n{err}\n{draw.shown()}")
    if dst.exists():
        raise SilentDifference(f"zoo convert refused but wrote {dst}\n{draw.shown()}")
    return Outcome("refused", lines[0].removeprefix("zoo: error: "))


def _close(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """The difference of ``a`` from the reference ``b`` by norm, relative to ``b``'s norm or ``floor``."""
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), floor, 1e-30)).item()


def _judge(theirs: torch.nn.Module, ours: torch.nn.Module, draw: Draw, seed: int, fmt, logits_tol: float,
           grad_tol: float) -> str | None:
    """What differs between the library's model and zoo's (outputs, loss, one step's gradients), or None."""
    from zoo.checkpoint.mapping import to_external

    dtype = next(theirs.parameters()).dtype
    inputs = draw.probe.inputs(draw, torch.Generator().manual_seed(seed + 1))
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    want, loss_theirs = draw.probe.theirs(theirs, draw, inputs)
    got, loss_ours = draw.probe.ours(ours, draw, inputs)
    scale = max(1.0, want.abs().max().item())
    worst = (got - want).abs().max().item()
    if not worst <= logits_tol * scale:
        return f"outputs differ by {worst:.3g} (scale {scale:.3g})"

    if loss_theirs is None or loss_ours is None:  # (the probe's loss of the outputs, on both sides)
        loss_theirs, loss_ours = (draw.probe.loss(out, draw, inputs, seed) for out in (want, got))
    rel = abs(loss_ours.item() - loss_theirs.item()) / max(abs(loss_theirs.item()), 1e-12)
    if not rel <= grad_tol:
        return f"losses differ: {loss_ours.item()} vs {loss_theirs.item()}"
    loss_theirs.backward()
    loss_ours.backward()
    grads_theirs = {k: p.grad for k, p in theirs.named_parameters(remove_duplicate=False) if p.grad is not None}
    params = dict(theirs.named_parameters(remove_duplicate=False))
    if draw.file_name is not None:  # (an image-text model: its language model's, under its files' names)
        params = {draw.file_name(k): p for k, p in params.items() if draw.file_name(k) is not None}
        grads_theirs = {draw.file_name(k): g for k, g in grads_theirs.items() if draw.file_name(k) is not None}
    if draw.probe.grads is not None:
        grads_theirs = draw.probe.grads(grads_theirs)
    table = fmt.table_for(ours.cfg, list(grads_theirs))
    state = {k: torch.zeros_like(v) for k, v in ours.state_dict().items()}  # (buffers: no gradient)
    state.update({k: p.grad if p.grad is not None else torch.zeros_like(p)
                  for k, p in ours.named_parameters(remove_duplicate=False)})
    grads_ours = to_external(table, state, ours.cfg)
    # A gradient that is zero in exact arithmetic (a key bias under softmax, a top-1 renormalised
    # gate) is rounding noise on both sides: differences are judged against the model's largest
    # gradient too.
    floor = 1e-3 * max(g.double().norm().item() for g in grads_theirs.values())
    seen: set[int] = set()
    for key, ref in grads_theirs.items():
        if id(params[key]) in seen:  # (a tied weight: compared under its first name)
            continue
        seen.add(id(params[key]))
        mine = grads_ours.get(key)
        for ours_prefix, theirs_prefix in table.import_prefixes:  # (transformers' in-memory names)
            if mine is None and key.startswith(theirs_prefix):
                mine = grads_ours.get(ours_prefix + key[len(theirs_prefix):])
        if mine is None:
            if ref.abs().max() == 0:
                continue
            return f"no gradient of zoo's maps to {key}"
        rel = _close(mine.reshape(ref.shape), ref, floor)
        if not rel <= grad_tol:
            return f"gradient of {key} differs by {rel:.3g} relative"

    return None


def run(draw: Draw, seed: int, tmp: Path) -> Outcome:
    import zoo
    from zoo.checkpoint.external import _formats

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = draw.build(draw.config).float().eval()
    randomise(theirs, seed)
    if draw.probe.prepare is not None:
        draw.probe.prepare(theirs)
    src, dst, back = tmp / "theirs", tmp / "zoo", tmp / "back"
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        theirs.save_pretrained(src, safe_serialization=True)
    fmt_name = "diffusers" if draw.library == "diffusers" else "hf"
    code, err = _zoo("convert", "--from", fmt_name, str(src), str(dst))
    if code != 0:
        return _refusal(code, err, dst, draw)

    ours = zoo.load_model(str(dst)).eval()
    fmt = next(f for _, f in _formats(fmt_name) if draw.architecture in f.architectures)
    problem = _judge(theirs, ours, draw, seed, fmt, LOGITS_TOL, GRAD_TOL)
    if problem is not None:
        # A float32 difference is either a different computation or rounding in an ill-conditioned
        # draw (a gradient that is zero in exact arithmetic, a LayerNorm over two features): in
        # float64 the same computation agrees far closer, a different one keeps its difference.
        import copy

        theirs64, ours64 = copy.deepcopy(theirs).double(), zoo.load_model(str(dst)).eval().double()
        for p in (*theirs64.parameters(), *ours64.parameters()):
            p.grad = None
        again64 = _judge(theirs64, ours64, draw, seed, fmt, LOGITS_TOL_64, GRAD_TOL_64)
        if again64 is not None:
            raise SilentDifference(f"{problem}; in float64: {again64}\n{draw.shown()}")

    code, err = _zoo("convert", "--to", fmt_name, str(dst), str(back))
    if code != 0:
        raise SilentDifference(f"zoo convert --to failed on a model it imported:\n{err}\n{draw.shown()}")
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        import transformers

        cls = getattr(transformers, draw.export_class) if draw.export_class else type(theirs)
        again, info = cls.from_pretrained(back, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SilentDifference(f"from_pretrained of the export: {problems}\n{draw.shown()}")
    sd_theirs, sd_again = theirs.state_dict(), again.state_dict()
    if draw.export_name is not None:  # (an image-text model's language model, exported alone)
        sd_theirs = {draw.export_name(k): v for k, v in sd_theirs.items() if draw.export_name(k) is not None}
    if sd_theirs.keys() != sd_again.keys():
        raise SilentDifference(f"the export's keys differ: {sorted(sd_theirs.keys() ^ sd_again.keys())}\n{draw.shown()}")
    for k, v in sd_theirs.items():
        if not torch.equal(v, sd_again[k]):
            raise SilentDifference(f"the export's {k} is not bitwise the original\n{draw.shown()}")
    return Outcome("equal")


__all__ = ["CAUSAL_LM", "Draw", "Outcome", "Probe", "SilentDifference", "next_token_loss", "randomise", "run"]
