"""zoo's key for the names users bring from Megatron-LM (its flags), Megatron-Bridge / NeMo DFM (their
``section.key=value`` overrides and YAML keys) and Hugging Face (``TrainingArguments``, model
configs). zoo keeps one name per setting; where a user writes another framework's name, the error
gives zoo's with their value in place (``train.train_iters=5`` -> ``train.steps=5``), as an
override they can paste.

`hint` serves unknown configuration keys (`zoo.config.layers.Layers.set`), `flag_hint` the command
line's unknown ``--flags`` (`zoo.cli.main`). A target that names a model key is offered only where
the family has that key (``model.num_heads`` is LLaMA's, not CLIP's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

# A foreign name, lowercase with "_" for "-" and without its section (Megatron-Bridge writes
# model.tensor_model_parallel_size, Megatron --tensor-model-parallel-size) -> zoo's form, ready to
# paste: a `section.key={}` template ({} the user's value; no {} where the flag itself is the value)
# or a command-line option.
NAMES: dict[str, str] = {
    # parallelism
    "tensor_model_parallel_size": "parallel.tp={}",
    "tp_size": "parallel.tp={}",
    "pipeline_model_parallel_size": "parallel.pp={}",
    "pp_size": "parallel.pp={}",
    "virtual_pipeline_model_parallel_size": "parallel.vpp={}",
    "context_parallel_size": "parallel.cp={}",
    "cp_size": "parallel.cp={}",
    "expert_model_parallel_size": "parallel.ep={}",
    "expert_tensor_parallel_size": "parallel.etp={}",
    "moe_token_dispatcher_type": "parallel.ep_dispatcher={}",
    "use_distributed_optimizer": "parallel.zero=1",
    "accumulate_allreduce_grads_in_fp32": "train.grad_dtype=fp32",
    "grad_reduce_in_fp32": "train.grad_dtype=fp32",
    "data_parallel_shard_degree": "parallel.fsdp={}",  # torchtitan's (its replicate degree is dp / fsdp here)
    "dp_shard": "parallel.fsdp={}",
    "sequence_parallel": "parallel.sequence_parallel=true",
    "distributed_backend": "parallel.backend={}",
    "ddp_bucket_size": "parallel.bucket_size={}",
    # training
    "train_iters": "train.steps={}",
    "max_steps": "train.steps={}",
    "per_device_train_batch_size": "train.micro_batch_size={}",
    "encoder_seq_length": "train.seq_length={}",
    "max_seq_length": "train.seq_length={}",
    "bf16": "train.precision=bf16",
    "fp16": "train.precision=fp16",
    "initial_loss_scale": "train.initial_loss_scale={}",
    "loss_scale_window": "train.loss_scale_window={}",
    "recompute_granularity": "train.recompute={}",
    "gradient_checkpointing": "train.recompute=full",
    "checkpoint_activations": "train.recompute=full",
    "recompute_method": "train.recompute=full",  # (every layer: zoo has no per-layer count)
    "recompute_num_layers": "train.recompute=full",
    "overlap_grad_reduce": "nothing to set: gradient buckets are always reduced while backward runs",
    "overlap_param_gather": "nothing to set: ZeRO-1's parameter gather always overlaps the next forward",
    "use_flash_attn": "nothing to set: flash-attn and Transformer Engine are used when installed (zoo version)",
    "transformer_impl": "nothing to set: flash-attn and Transformer Engine are used when installed (zoo version)",
    "data_parallel_size": "nothing to set: dp = world size / (tp x cp x pp)",
    "no_load_optim": "nothing more to set: checkpoint.load reads weights only (checkpoint.resume: a whole run)",
    "no_load_rng": "nothing more to set: checkpoint.load reads weights only (checkpoint.resume: a whole run)",
    "zero_stage": "parallel.zero={}",  # (stages 2 and 3: flag_hint)
    "eval_iters": "train.eval_steps={}",
    "use_cpu": "train.device=cpu",
    # optimizer and schedule
    "learning_rate": "optimizer.lr={}",
    "adam_beta1": "optimizer.beta1={}",
    "adam_beta2": "optimizer.beta2={}",
    "adam_eps": "optimizer.eps={}",
    "adam_epsilon": "optimizer.eps={}",
    "clip_grad": "optimizer.grad_clip={}",
    "max_grad_norm": "optimizer.grad_clip={}",
    "lr_warmup_iters": "schedule.warmup_steps={}",
    "lr_decay_style": "schedule.decay={}",
    "lr_scheduler_type": "schedule.decay={}",
    "lr_decay_iters": "schedule.decay_steps={}",
    "lr_wsd_decay_iters": "schedule.wsd_decay_steps={}",
    "lr_wsd_decay_style": "schedule.wsd_decay={}",
    # checkpoints
    "save": "--run-dir {}",
    "output_dir": "--run-dir {}",
    "checkpoint_dir": "checkpoint.dir={}",
    "save_dir": "checkpoint.dir={}",
    "load": "checkpoint.load={}",
    "load_dir": "checkpoint.load={}",
    "load_checkpoint": "checkpoint.load={}",
    "pretrained_checkpoint": "checkpoint.load={}",
    "save_interval": "checkpoint.interval={}",
    "save_steps": "checkpoint.interval={}",
    "save_total_limit": "checkpoint.keep_last={}",
    "async_save": "checkpoint.async_save=true",
    # logging
    "log_interval": "logging.interval={}",
    "logging_steps": "logging.interval={}",
    "tensorboard_dir": "logging.tensorboard=true",
    "wandb_project": "nothing to set: runs write TensorBoard events and metrics.jsonl (logging.tensorboard)",
    # data
    "data_path": "data.path={}",
    "dataset_path": "data.path={}",
    "train_data_path": "data.train_path={}",
    "valid_data_path": "data.valid_path={}",
    "test_data_path": "data.test_path={}",
    "tokenizer_model": "data.tokenizer={}",
    "data_cache_path": "data.cache_dir={}",
    "mock_data": "nothing to set: without data.path a family trains on its embedded dataset",
    "dataloader_num_workers": "data.num_workers={}",
    "sft": "data.dataset=sft",  # (Megatron-LM's --sft: conversations from .jsonl, the loss on answers; docs/sft.md)
    "chat_template": "data.chat_template={}",
    "config_file": "--config {}",
    # model (offered only where the family has the key)
    "num_hidden_layers": "model.num_layers={}",
    "num_attention_heads": "model.num_heads={}",
    "num_query_groups": "model.num_kv_heads={}",
    "num_key_value_heads": "model.num_kv_heads={}",
    "kv_channels": "model.head_dim={}",
    "intermediate_size": "model.ffn_hidden_size={}",
    "max_position_embeddings": "model.max_seq_length={}",
    "norm_epsilon": "model.norm_eps={}",
    "layernorm_epsilon": "model.norm_eps={}",
    "rms_norm_eps": "model.norm_eps={}",
    "rotary_base": "model.rope_theta={}",
    "tie_word_embeddings": "model.tie_embeddings={}",
    "untie_embeddings_and_output_weights": "model.tie_embeddings=false",
    "num_local_experts": "model.num_experts={}",
    "num_experts": "model.num_experts={}",
    "moe_router_num_groups": "model.router_groups={}",
    "n_group": "model.router_groups={}",
    "moe_router_group_topk": "model.router_group_topk={}",
    "topk_group": "model.router_group_topk={}",
    "moe_router_topk_scaling_factor": "model.router_scaling={}",
    "routed_scaling_factor": "model.router_scaling={}",
    "rope_scaling_factor": "model.rope_scaling={rope_type: llama3, factor: {}}",
    "moe_router_topk": "model.top_k={}",
    "num_experts_per_tok": "model.top_k={}",
    "moe_aux_loss_coeff": "model.aux_loss_coeff={}",
    "router_aux_loss_coef": "model.aux_loss_coeff={}",
    "moe_z_loss_coeff": "model.z_loss_coeff={}",
    "mamba_state_dim": "model.ssm_state_size={}",
    "state_size": "model.ssm_state_size={}",
    "mamba_head_dim": "model.ssm_head_dim={}",
    "mamba_num_groups": "model.ssm_groups={}",
    "n_groups": "model.ssm_groups={}",
    "hybrid_override_pattern": "model.pattern={}",
    # which layers are MoE: Megatron's, Qwen2-MoE's, DeepSeek's and Llama 4's ways of saying it
    **dict.fromkeys(("moe_layer_freq", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace",
                     "interleave_moe_layer_step"), "model.pattern=<a symbol per layer: E MoE, T dense>"),
    "num_embeds_ada_norm": "model.num_classes={}",
}


# Where the value, not only the name, decides zoo's form: (name, value) -> form.
BY_VALUE: dict[tuple[str, str], str] = {
    ("moe_router_load_balancing_type", "aux_loss"): "nothing to set: the Switch aux loss is on by default "
                                                    "(model.aux_loss_coeff)",
    ("moe_router_load_balancing_type", "none"): "model.aux_loss_coeff=0",
    ("moe_router_load_balancing_type", "seq_aux_loss"): "model.aux_loss_convention=sequence",
}


def _norm(name: str) -> str:
    return name.lstrip("-").lower().replace("-", "_")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _usable(form: str, keys: set[str]) -> bool:
    """Whether zoo's form names a key this run has (options and explanations always are)."""
    key = form.split("=", 1)[0]
    return not key.startswith("model.") or key in keys


def translate(name: str, value: Any, keys: Iterable[str]) -> str | None:
    """zoo's form of a foreign ``name`` set to ``value``, or None. ``name`` may carry a section
    (``train.train_iters``); a name that is one of zoo's own leaves in another section (``train.lr``,
    ``lr``) gives that key. ``keys``: the run's dotted keys."""
    keys = set(keys)
    leaf = _norm(name.rsplit(".", 1)[-1])
    form = BY_VALUE.get((leaf, _show(value))) or NAMES.get(leaf)
    if form is None:
        owners = sorted(k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != name)
        if len(owners) != 1:
            return None
        form = owners[0] + "={}"
    if not _usable(form, keys) or ("{}" not in form and _show(value).lower() == "false"):
        return None  # (a flag's form turns something on: `bf16: false` asks for nothing)
    return form.replace("{}", _show(value)) if value is not None or "{}" not in form else form.replace("={}", "")


def hint(dotted: str, value: Any, keys: Iterable[str]) -> str:
    """`` (in zoo: train.steps=5)`` for another framework's name, `` (did you mean optimizer.lr=3?)``
    for zoo's own key under another section, else ''."""
    form = translate(dotted, value, keys)
    if not form:
        return ""
    own = _norm(dotted.rsplit(".", 1)[-1]) not in NAMES
    return f" (did you mean {form}?)" if own else f" (in zoo: {form})"


def flag_hint(argv: Sequence[str], stray: Sequence[str], keys: Iterable[str]) -> str:
    """For the unrecognized ``--flags`` among ``stray`` that are another framework's, zoo's forms
    with the values that followed them in ``argv``: `` (in zoo: parallel.tp=2 train.steps=5)``."""
    keys = set(keys)
    given: dict[str, str | None] = {}
    for flag in stray:
        if not flag.startswith("--"):
            continue
        name, eq, value = flag.partition("=")
        if not eq:
            at = argv.index(flag) if flag in argv else -1
            nxt = argv[at + 1] if 0 <= at < len(argv) - 1 else None
            value = nxt if nxt is not None and (not nxt.startswith("-") or _number(nxt) or _PAIR.fullmatch(nxt)) \
                and "=" not in nxt else None
        given[_norm(name)] = value
    # Megatron's --save X --load X resumes from X: zoo resumes from its run directory by itself
    # (checkpoint.load is where a fresh run's first weights come from)
    if given.get("load") is not None and given.get("load") == given.get("save"):
        del given["load"]
    forms = []
    for name, value in given.items():
        if name in ("min_lr", "lr_warmup_init"):  # zoo's schedule gives both as fractions of optimizer.lr
            lr = given.get("lr")
            if value is not None and lr is not None and _number(value) and _number(lr) and float(lr) > 0:
                key = "min_lr_ratio" if name == "min_lr" else "warmup_init_ratio"
                forms.append(f"schedule.{key}={float(value) / float(lr):.6g}")
            continue
        if name == "lr_decay_style" and value is not None:  # Megatron's spellings of zoo's names
            value = {"WSD": "wsd", "inverse-square-root": "inverse_sqrt"}.get(value, value)
        if name == "moe_layer_freq" and value is not None and value.isdigit() and int(value) > 0 \
                and (given.get("num_layers") or "").isdigit():  # Megatron's rule: layer i is MoE iff i % N == 0
            forms.append("model.pattern=" + "".join("T" if i % int(value) else "E"
                                                    for i in range(int(given["num_layers"] or 0))))
            continue
        if name in ("moe_layer_freq", "window_attn_skip_freq") and value is not None \
                and (flags := int_list(value)) is not None:  # the list form, one 0/1 per layer
            forms.append("model.pattern=" + "".join("E" if f else "T" for f in flags) if name == "moe_layer_freq"
                         else "model.window_layers=[" + ",".join(str(i) for i, f in enumerate(flags) if f) + "]")
            continue
        if name == "rampup_batch_size":  # Megatron's three values: start, increment, samples
            at = next((i for i, a in enumerate(argv) if a.startswith("--") and _norm(a) == name), len(argv))
            values = argv[at + 1:at + 4]
            if len(values) == 3 and all(v.isdigit() for v in values):
                forms.append(f"train.rampup_batch_size=[{','.join(values)}]")
                continue
        if name == "window_size" and value is not None:  # Megatron's (left, right): keys i-left .. i+right
            sizes = [int(n) for n in re.findall(r"-?\d+", value)]
            if len(sizes) == 2 and sizes[1] == 0:
                forms.append("nothing to set: a left size of -1 is no window" if sizes[0] < 0
                             else f"model.sliding_window={sizes[0] + 1}")
                continue
            if len(sizes) == 2:
                forms.append("nothing like it: zoo's sliding windows are causal (model.sliding_window; right size 0)")
                continue
        if name == "window_attn_skip_freq" and value is not None and value.isdigit() and int(value) > 1 \
                and (given.get("num_layers") or "").isdigit():  # every N-th layer (1-based) attends to everything
            skip = int(value)
            forms.append("model.window_layers=[" + ",".join(str(i) for i in range(int(given["num_layers"] or 0))
                                                              if (i + 1) % skip) + "]")
            continue
        if name in _IN_SAMPLES and value is not None and value.isdigit() \
                and (given.get("global_batch_size") or "").isdigit():  # Megatron's sample counts: steps here
            steps = -(-int(value) // int(given["global_batch_size"] or 1))
            forms.append(_IN_SAMPLES[name].replace("{}", str(steps)))
            continue
        if name == "lr_warmup_fraction" and value is not None and _number(value):
            total = given.get("lr_decay_iters") or given.get("train_iters")
            if total is not None and total.isdigit():
                forms.append(f"schedule.warmup_steps={round(float(value) * int(total))}")
                continue
        if name == "zero_stage" and value in ("2", "3"):  # DeepSpeed's sharded gradients / parameters
            forms.append("parallel.fsdp=<data-parallel size>")
            continue
        form = translate(name, "VALUE" if value is None else value, keys)
        if form and form not in forms:
            forms.append(form)
    # Overrides ready to paste first, then what needs no setting (a sentence each).
    notes = [f for f in forms if f.startswith("nothing")]
    paste = [f for f in forms if f not in notes]
    return f" (in zoo: {'; '.join(filter(None, [' '.join(paste), *notes]))})" if forms else ""


# Megatron's sample-based lengths (--train-samples ...), as step counts with --global-batch-size
_IN_SAMPLES = {"train_samples": "train.steps={}", "lr_decay_samples": "schedule.decay_steps={}",
               "lr_warmup_samples": "schedule.warmup_steps={}", "lr_wsd_decay_samples": "schedule.wsd_decay_steps={}"}


def int_list(text: str) -> list[int] | None:
    """A list of integers Megatron's flags write as Python (``[1,0,1]``, ``([0]+[1]*23)``), read
    without evaluating anything: list literals of integers joined by ``+`` and repeated by ``* n``.
    None for anything else."""
    import ast

    def value(node: ast.AST) -> list[int]:
        if isinstance(node, (ast.List, ast.Tuple)) and all(
                isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
            return [e.value for e in node.elts]  # type: ignore[attr-defined]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return value(node.left) + value(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for items, times in ((node.left, node.right), (node.right, node.left)):
                if isinstance(times, ast.Constant) and type(times.value) is int and times.value >= 0:
                    part = value(items)
                    if len(part) * times.value > 100_000:  # (no model has that many layers)
                        raise ValueError(node)
                    return part * times.value
        raise ValueError(node)

    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return out if out and all(v in (0, 1) for v in out) else None


_PAIR = re.compile(r"[(\[]?\s*-?\d+\s*,\s*-?\d+\s*[)\]]?")  # a value such as --window-size's -1,0


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
