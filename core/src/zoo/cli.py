"""The `zoo` command line.

Exit codes: 0 success, 2 usage or configuration error, 1 failure while running. Every error is
one line on stderr; ``--debug`` shows the traceback instead. Plugins add commands through the
``zoo_commands`` hook; the core's commands cannot be shadowed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.errors import ConfigError, PluginError, UnknownNameError, UsageError, ZooError, at_least_one, suggest

if TYPE_CHECKING:  # the CLI imports no torch until a command needs it
    from zoo.config import RunConfig
    from zoo.parallel.layout import Layout
    from zoo.registry import FamilyEntry

CORE_COMMANDS = ("list", "info", "version", "train", "convert", "generate", "prepare", "data")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every error takes the same one-line path."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{self.prog}: {message}")


def _registry(args: argparse.Namespace) -> Any:
    from zoo.registry import get_registry

    return get_registry(only=getattr(args, "plugins", None))


# --------------------------------------------------------------------------------------------- list


def cmd_list(args: argparse.Namespace) -> int:
    reg = _registry(args)
    if args.json:
        print(json.dumps(_list_json(reg), indent=2))
        return 0
    rows = [("MODEL", "ALIASES", "FLAVORS", "TASK", "FROM")]
    for name in sorted(reg.families):
        e = reg.families[name]
        f = e.family
        rows.append((name, ",".join(f.aliases) or "-", ",".join(f.flavors), f.task, f"{e.plugin.distribution} {e.plugin.version}"))
    if len(rows) == 1:
        print("no model families installed (pip install zoo-gpt, or a third-party zoo plugin)")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if reg.datasets:
        print("\ndatasets: " + ", ".join(f"{n} ({info.distribution})" for n, (_, info) in sorted(reg.datasets.items())))
    plugin_commands = [(n, info) for n, (_, info) in sorted(reg.commands.items()) if n not in CORE_COMMANDS]
    if plugin_commands:
        print("\ncommands: " + ", ".join(f"zoo {n} ({info.distribution})" for n, info in plugin_commands))
    problems = _problems(reg)
    if problems:
        print("\nproblems:")
        for p in problems:
            print(f"  {p}")
    return 1 if problems and args.strict else 0


def _problems(reg: Any) -> list[str]:
    from zoo.registry import _conflict_message

    out = [f"BROKEN {b.plugin}: {b.error}" for b in reg.broken]
    out += [f"CONFLICT {_conflict_message(n, c)}" for n, c in sorted(reg.conflicts.items())]
    out += [f"SHADOWED command {n!r} from {info} (a core command)" for n, (_, info) in reg.commands.items() if n in CORE_COMMANDS]
    return out


def _list_json(reg: Any) -> dict[str, Any]:
    return {
        "families": [
            {
                "name": n,
                "aliases": list(e.family.aliases),
                "flavors": list(e.family.flavors),
                "task": e.family.task,
                "distribution": e.plugin.distribution,
                "version": e.plugin.version,
                "entry_point": e.plugin.name,
            }
            for n, e in sorted(reg.families.items())
        ],
        "broken": [{"entry_point": b.plugin.name, "distribution": b.plugin.distribution, "error": b.error} for b in reg.broken],
        "conflicts": {n: [c.distribution for c in cs] for n, cs in reg.conflicts.items()},
        "skipped": [s.name for s in reg.skipped],
    }


# --------------------------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    from zoo import spec as spec_mod

    entry = _registry(args).get(args.name)
    f = entry.family
    print(f"{f.name}: {f.description}")
    print(f"  from:        {entry.plugin.distribution} {entry.plugin.version} (entry point {entry.plugin.name!r})")
    print(f"  aliases:     {', '.join(f.aliases) or '-'}")
    print(f"  task:        {f.task}")
    print(f"  config:      {f.config.__module__}.{f.config.__qualname__}")
    print(f"  flavors:     {', '.join(f.flavors)}")
    print(f"  dataset:     {f.default_dataset or '-'}")
    print(f"  formats:     {', '.join(f.checkpoint_formats) or '-'}")
    print(f"  generation:  {'yes' if f.generate else 'no'}")
    if f.recipe:
        print("  recipe:      " + ", ".join(f"{k}={v}" for k, v in f.recipe.items()))
    for name, s in f.specs.items():
        print(f"  layer spec {name!r}: {spec_mod.describe(s, indent=2)}")
    return 0


# ------------------------------------------------------------------------------------------ version


def cmd_version(args: argparse.Namespace) -> int:
    import platform

    from zoo._version import __version__

    print(f"zoo-core {__version__}")
    print(f"python {platform.python_version()}")
    try:
        from importlib.metadata import version

        print(f"torch {version('torch')}")
    except Exception:
        print("torch not installed")
    reg = _registry(args)
    for info in reg.plugins:
        print(f"plugin {info.name}: {info.distribution} {info.version}")
    for b in reg.broken:
        print(f"plugin {b.plugin.name}: {b.plugin.distribution} {b.plugin.version} (broken)")
    from zoo.backends import report

    for name, provides, status, fallback in report():  # optional kernels, and what runs without them
        used = status.startswith("available")
        print(f"backend {name} ({provides}): {status}" + ("" if used else f"; zoo uses {fallback}"))
    from zoo import kernels
    from zoo.config import TrainConfig

    for name, p in kernels.providers().items():
        print(f"kernels {name}: {p.name} for {p.device}")
    for line in kernels.select("cpu", kernels.options(TrainConfig())).report():  # what `zoo train` takes here
        print(f"{line} (train.cpu_* defaults)")
    return 0


# -------------------------------------------------------------------------------------------- train


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every command that resolves a run config takes (train, and later ones)."""
    p.add_argument("--model", "-m", help="model family (see `zoo list`)")
    p.add_argument("--flavor", "-f", help="size of the family (default: tiny)")
    p.add_argument("--config", "-c", action="append", default=[], metavar="FILE", help="YAML config, may repeat; later wins")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides, applied last")


def resolve_run(args: argparse.Namespace) -> tuple[FamilyEntry, RunConfig]:
    """Registry entry and `RunConfig` from --model/--flavor/--config/overrides."""
    from zoo import config as cfg_mod

    files = [(str(path), cfg_mod.read_yaml(path)) for path in args.config]
    model = args.model
    flavor = args.flavor
    for _, tree in files:  # a resolved config.yaml names its family and flavor
        model = model or tree.get("family")
        flavor = flavor or tree.get("flavor")
    if not model:
        raise UsageError("zoo train: --model is required (see `zoo list`)")
    entry = _registry(args).get(str(model))
    fam = entry.family
    flavor = str(flavor or "tiny")
    if flavor not in fam.flavors:
        raise UnknownNameError(
            f"family {fam.name!r} has no flavor {flavor!r}{suggest(flavor, fam.flavors)}; flavors: {', '.join(fam.flavors)}"
        )
    try:
        defaults = fam.flavors[flavor]()
    except Exception as e:
        raise PluginError(f"{entry.plugin}: flavor {flavor!r} of {fam.name!r} raised {type(e).__name__}: {e}") from e
    recipe = [(f"recipe of {fam.name}", fam.recipe), (f"recipe of {fam.name}/{flavor}", fam.flavor_recipes.get(flavor, {}))]
    run = cfg_mod.resolve(
        family=fam.name, flavor=flavor, model_cls=fam.config, model_defaults=defaults,
        recipe=recipe, files=files, overrides=args.overrides,
    )
    if run.model.layer_spec not in fam.specs:
        raise ConfigError(
            f"model.layer_spec={run.model.layer_spec!r} is not a layer spec of {fam.name!r}"
            f"{suggest(str(run.model.layer_spec), fam.specs)}; specs: {', '.join(fam.specs)}"
        )
    return entry, run


def count_parameters(entry: FamilyEntry, run: RunConfig, plan: Layout) -> tuple[int, list[int]]:
    """Build the model on the meta device (no memory); (total parameters, parameters one rank of
    each pipeline stage holds: its layers, TP-split where the family's plan splits them, routed
    experts over ep x etp)."""
    import torch

    from zoo.family import resolve
    from zoo.parallel.apply import parameters_per_rank, tensor_parallel_plan

    fam = entry.family
    build = resolve(fam.build, owner=str(entry.plugin))
    with torch.device("meta"):
        model = build(run.model, fam.spec_for(run.model))
    total = sum(p.numel() for p in model.parameters())
    shares, tp_plan = dict(ep=plan.ep, etp=plan.etp), tensor_parallel_plan(model, fam.tp_plan)[0]
    if plan.pp == 1 or fam.pipeline is None:
        return total, [parameters_per_rank(model, tp_plan, plan.tp, **shares)]
    from zoo.parallel.pipeline import build_stages

    per_stage = []
    for rank in range(plan.pp):
        stages = build_stages(model, fam.pipeline, pp=plan.pp, vpp=plan.vpp, rank=rank, sizes=run.parallel.pp_layers)
        per_stage.append(parameters_per_rank(stages.local, tp_plan, plan.tp, **shares))
    return total, per_stage


def cmd_train(args: argparse.Namespace) -> int:
    from zoo.parallel import distributed, layout

    entry, run = resolve_run(args)
    world = args.world_size or distributed.world_size_from_env()
    plan = layout.plan(run, world_size=world, family=entry.family)
    from zoo.data.energon.training import check_reader

    check_reader(entry.family, run)
    if args.dry_run:
        print(run.to_yaml().rstrip())
        n, per_stage = count_parameters(entry, run, plan)
        print(f"# model: {run.family} ({run.flavor}) from {entry.plugin.distribution} {entry.plugin.version}")
        print(f"# parameters: {n:,} ({_human(n)})")
        print(f"# layout: {plan.describe()}")
        if plan.pp > 1:
            for stage, count in enumerate(per_stage):
                print(f"# parameters per rank of pipeline stage {stage}: {count:,} ({_human(count)})")
        elif plan.tp > 1 or plan.ep > 1 or plan.etp > 1:
            what = "tensor-parallel rank" if plan.ep == plan.etp == 1 else "rank (experts over ep x etp)"
            print(f"# parameters per {what}: {per_stage[0]:,} ({_human(per_stage[0])})")
        return 0
    from zoo.training.trainer import Trainer

    run_dir = Path(args.run_dir or os.path.join("runs", f"{run.family}-{run.flavor}"))
    return Trainer(entry.family, run, plan, run_dir=run_dir, owner=str(entry.plugin)).fit()


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from zoo.checkpoint.inspect import cmd_checkpoint as run

    return run(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from zoo.checkpoint import external

    if bool(args.from_format) == bool(args.to_format):
        raise UsageError("zoo convert: give exactly one of --from FORMAT (import) or --to FORMAT (export)")
    if args.from_format:
        out = external.import_external(args.from_format, args.src, args.dst)
    else:
        from zoo.checkpoint.state import resolve_checkpoint

        out = external.export_external(args.to_format, resolve_checkpoint(args.src), args.dst,
                                       max_shard_bytes=external.parse_size(args.max_shard_size), dtype=args.dtype,
                                       weights=args.weights)
    print(f"wrote {out}")
    return 0


def cmd_prepare_text(args: argparse.Namespace) -> int:
    from zoo.data.prepare import check_megatron_tokenizer, prepare_text

    if args.on_error not in ("fail", "skip"):
        raise UsageError("--on-error: fail or skip")
    check_megatron_tokenizer(args.tokenizer_type, args.tokenizer, args.vocab_file, args.merge_file)
    if args.train_bpe and (args.tokenizer or args.vocab_file):
        raise UsageError("--train-bpe trains the tokenizer: give it without --tokenizer, --vocab-file or --merge-file")
    totals = prepare_text(inputs=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer,
                          json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
                          on_error=args.on_error, train_bpe_vocab=args.train_bpe, progress=not args.quiet,
                          vocab_file=args.vocab_file, merge_file=args.merge_file, batch_docs=args.chunk_size)
    skipped = f", {totals['skipped']:,} bad lines skipped" if totals["skipped"] else ""
    print(f"wrote {', '.join(o + '.{bin,idx}' for o in totals['outputs'])}: {totals['docs']:,} documents, "
          f"{totals['tokens']:,} tokens in {totals['seconds']:.1f}s{skipped}")
    return 0


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------- main


def build_parser(registry: Any | None) -> _Parser:
    parser = _Parser(prog="zoo", description="zoo: train, convert and sample models of any installed family.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--plugins", metavar="A,B", help="load only these plugins (overrides ZOO_PLUGINS)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("list", help="installed model families, flavors and where they come from")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--strict", action="store_true", help="exit 1 when a plugin is broken or conflicts")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("info", help="everything a family declares")
    p.add_argument("name")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("version", help="versions of zoo, torch and the plugins")
    p.set_defaults(func=cmd_version)

    p = sub.add_parser("train", help="train a model (run under torchrun for several processes)")
    add_run_arguments(p)
    p.add_argument("--run-dir", help="where config, metrics and checkpoints go (default runs/<model>-<flavor>)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config, parameter count and layout")
    p.add_argument("--world-size", type=at_least_one, help="plan the layout for this many processes (dry runs)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("convert", help="convert checkpoints to and from other formats (hf, diffusers, and those "
                                       "installed families declare: zoo info FAMILY)")
    p.add_argument("--from", dest="from_format", metavar="FORMAT", help="import SRC in FORMAT into a zoo directory DST")
    p.add_argument("--to", dest="to_format", metavar="FORMAT", help="export the zoo checkpoint SRC to FORMAT in DST")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--max-shard-size", default="5GB", help="split exported weights into files of at most this size")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="cast exported weights")
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="export the moving average of the weights (train.ema) or the raw ones; auto: the average if kept")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("checkpoint", help="inspect a checkpoint, verify its checksums, diff two")
    p.add_argument("what", choices=["inspect"])
    p.add_argument("path", help="a checkpoint directory, or a run or checkpoint root (its newest checkpoint)")
    p.add_argument("--verify", action="store_true", help="read every piece back against its size and checksum")
    p.add_argument("--diff", metavar="OTHER", help="list the tensors that differ from checkpoint OTHER")
    p.set_defaults(func=cmd_checkpoint)

    from zoo.cli_generate import add_generate_parser

    add_generate_parser(sub)

    p = sub.add_parser("prepare", help="prepare datasets (Megatron .bin/.idx, Energon WebDataset, chats)")
    prep = p.add_subparsers(dest="what", metavar="KIND", parser_class=_Parser, required=True)
    t = prep.add_parser("text", help="tokenize JSONL/text into <prefix>_<key>_document.{bin,idx}")
    t.add_argument("--input", nargs="+", required=True, help="JSONL (.gz), .txt files or directories of them")
    t.add_argument("--output-prefix", required=True)
    t.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer",
                   help="a local HF tokenizer dir (tokenizer.json, or vocab.json + merges.txt), tokenizer.json, "
                        ".tiktoken file or 'bytes' (--tokenizer-model: Megatron's name)")
    t.add_argument("--vocab-file", help="GPT-2's vocab.json (with --merge-file; Megatron's GPT2BPETokenizer)")
    t.add_argument("--merge-file", help="GPT-2's merges.txt")
    t.add_argument("--tokenizer-type", metavar="TYPE",
                   help="Megatron's: HuggingFaceTokenizer, GPT2BPETokenizer or TikTokenizer, checked against the files "
                        "(zoo needs none: the files say their kind)")
    t.add_argument("--train-bpe", type=at_least_one, metavar="VOCAB_SIZE", help="train a byte-level BPE on the input first")
    t.add_argument("--json-keys", nargs="+", default=["text"])
    t.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    t.add_argument("--workers", type=at_least_one, default=1)
    t.add_argument("--chunk-size", type=at_least_one, default=256, metavar="DOCS",
                   help="documents a worker tokenizes at once (Megatron's flag; speed only, the output is the same)")
    t.add_argument("--on-error", default="fail", help="fail (default) or skip malformed lines")
    t.add_argument("--quiet", action="store_true", help="no progress line")
    t.set_defaults(func=cmd_prepare_text)
    from zoo.data.chats import add_prepare_parser
    from zoo.data.energon.cli import add_data_parser, add_prepare_parsers

    add_prepare_parsers(prep)
    add_prepare_parser(prep)  # (chats: built-in conversations for the sft dataset)
    add_data_parser(sub)

    if registry is not None:
        from zoo.family import resolve

        for name, (cmd, info) in sorted(registry.commands.items()):
            if name in CORE_COMMANDS:
                continue
            p = sub.add_parser(name, help=f"{cmd.help} [{info.distribution}]")
            try:
                resolve(cmd.add_arguments, owner=str(info))(p)
            except Exception as e:  # a broken plugin command must not break the others
                p.set_defaults(func=_broken_command(f"{info}: command {name!r} is broken: {e}"))
                continue
            p.set_defaults(func=_plugin_command(cmd, info))
    return parser


def _plugin_command(cmd: Any, info: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        from zoo.family import resolve

        return int(resolve(cmd.run, owner=str(info))(args) or 0)

    return run


def _broken_command(message: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise PluginError(message)

    return run


def _wants_plugin_commands(argv: Sequence[str]) -> bool:
    """Plugin commands are only loaded when the first word is not a core command or --help."""
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] not in CORE_COMMANDS


def _options(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The long options of ``command`` (the top-level ones without)."""
    chosen = parser
    for action in parser._actions:  # argparse keeps its subparsers in a private list only
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            chosen = action.choices[command]
    return [o for o in chosen._option_string_actions if o.startswith("--")]


def _foreign_flags(args: argparse.Namespace, argv: Sequence[str], stray: Sequence[str]) -> str:
    """zoo's overrides for the Megatron / Hugging Face flags among ``stray`` (`zoo.config.foreign`),
    model keys included where --model names an installed family."""
    from zoo.config import SECTIONS, foreign
    from zoo.config.layers import dotted_keys

    keys = [k for name, cls in SECTIONS.items() for k in dotted_keys(cls, name)]
    if getattr(args, "model", None):
        with contextlib.suppress(ZooError):  # an unknown family is reported once the flags are right
            keys += dotted_keys(_registry(args).get(str(args.model)).family.config, "model")
    return foreign.flag_hint(argv, stray, keys)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("ZOO_DEBUG") == "1"
    try:
        registry = None
        if _wants_plugin_commands(argv):
            from zoo.registry import get_registry

            only = None
            if "--plugins" in argv and argv.index("--plugins") + 1 < len(argv):
                only = argv[argv.index("--plugins") + 1]
            registry = get_registry(only=only)
        parser = build_parser(registry)
        # Overrides may sit anywhere among the options (`--dry-run a.b=1 --flavor x c.d=2`):
        # argparse stops collecting a positional list at the first option, so collect the rest here.
        args, extra = parser.parse_known_args(argv)
        stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
        if stray:
            prog = f"zoo {args.command}" if getattr(args, "command", None) else "zoo"
            hint = _foreign_flags(args, argv, stray) if hasattr(args, "overrides") else ""
            flags = [x.split("=", 1)[0] for x in stray if x.startswith("--")]
            if not hint and flags:  # a misspelt option of the command itself (--flavour, --run_dir)
                hint = suggest(flags[0], _options(parser, getattr(args, "command", None)))
            raise UsageError(f"{prog}: unrecognized arguments: {' '.join(stray)}{hint}")
        if extra:
            args.overrides = [*args.overrides, *extra]
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except ZooError as e:
        if debug:
            raise
        print(f"zoo: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("zoo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`zoo list | head`): nothing is wrong with the command. Point stdout at
        # nothing so that the interpreter's last flush does not fail again, and exit as SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as e:
        if debug:
            raise
        print(f"zoo: error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1
