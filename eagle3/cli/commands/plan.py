"""`eagle3 plan`: what a run will cost, from params (+ -S overrides) and a target's config.json:
eagle3/sweep/plan.py computes the plan, this module prints it as tables for people (or as JSON).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from eagle3.cli.subcommand import Subcommand, fail
from eagle3.core.params import Params, ParamsError, parse_params

GIB = 2**30


def _m(n: float) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 1e5 else f"{n / 1e3:,.1f}K"


def _g(n: float) -> str:
    return f"{n:,.1f} GiB"


def _b(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _flop(n: float) -> str:
    for unit, size in (("ZFLOP", 1e21), ("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 1e9:,.2f} GFLOP"


def print_transport(f: dict, console: Any) -> None:
    """Which bounds a server's rate: its forwards (assumed) or the transport of the aux rows."""
    ceilings = ", ".join(f"{name} {c:,.0f}" for name, c in f["transport_ceilings_tokens_per_s"].items())
    line = f"transport ceiling per server at this width (tokens/s, measured per number): {ceilings}"
    if f["transport"] is None:
        console.print(
            f"[yellow]note:[/] {line}; extract.backend hf moves no rows between processes", highlight=False
        )
        return
    bound = (
        f"the {f['transport']} transport binds: {f['effective_tokens_per_s']:,.0f} tokens/s a server"
        if f["binds"] == "transport"
        else f"the servers' forwards bind, not the {f['transport']} transport"
    )
    console.print(f"[yellow]note:[/] {line}; {bound}", highlight=False)


def print_features(f: dict, console: Any) -> None:
    """Stores (bf16, fp8) against online side by side (every FEATURE_MODES entry), the configured
    one marked."""
    from rich.table import Table

    modes, q = f["modes"], f["prefetch"]
    rate = f"{f['server_tokens_per_s']:,.0f} tokens/s"
    short = f"{f['effective_tokens_per_s']:,.0f} tok/s"
    table = Table(
        title=f"Features: store against online ({f['tokens']:,} tokens, {f['epochs']} epochs; "
        "* = extract.features)",
        title_justify="left",
    )
    table.add_column("")
    for name, m in modes.items():
        table.add_column(name + (" *" if m["configured"] else ""), justify="right")

    def target(m: dict) -> str:
        if not m["computed_while_training"]:
            return "at extraction only"
        if f["backend"] == "hf":
            return f"{_b(m['target_weights_bytes_in_trainer'])} beside the trainer"
        return "on the SGLang servers"

    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("disk: bytes/token", lambda m: f"{m['disk_bytes_per_token']:,}"),
        ("disk: all tokens", lambda m: _b(m["disk_bytes"])),
        (
            "target passes over the tokens",
            lambda m: (
                f"{m['target_passes']} ("
                + ("one per epoch" if m["computed_while_training"] else "extraction")
                + ")"
            ),
        ),
        ("target FLOPs", lambda m: _flop(m["target_flops"])),
        (f"server-hours at {short}", lambda m: f"{m['server_hours']:,.1f}"),
        (
            "in flight per process",
            lambda m: (
                f"{_b(m['in_flight_bytes_per_process'])} ({q['batches']} x {q['rows_per_process']} x "
                f"{q['seq_len']} tokens)"
                if m["computed_while_training"]
                else "0 (memory-mapped reads)"
            ),
        ),
        ("target weights", target),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(m) for m in modes.values()))
    console.print(table)
    console.print(
        f"[yellow]note:[/] server-hours assume {rate} per target server (an assumption, not a "
        "measurement: docs/features.md)",
        highlight=False,
    )
    print_transport(f, console)
    weights = max(m["target_weights_bytes_in_trainer"] for m in modes.values())
    if weights:
        console.print(
            f"[yellow]note:[/] online with extract.backend hf runs the target in-process: its "
            f"{_b(weights)} of weights must fit beside the trainer (extract.backend sglang keeps it "
            "on the servers)",
            highlight=False,
        )


def _print_drafter(result: dict, console: Any) -> None:
    """The target and drafter lines, the drafter's parameters by part and by draft vocabulary size."""
    from rich.table import Table

    t, d = result["target"], result["drafter"]
    n, shape = d["params"], d["shape"]
    console.print(
        f"[bold]target[/] {t['model_type'] or '?'}: hidden {t['hidden_size']:,}, "
        f"{t['num_hidden_layers']} layers, vocabulary {t['vocab_size']:,}, aux layers {t['aux_layers']}",
        highlight=False,
    )
    console.print(
        f"[bold]drafter[/]: {shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, "
        f"head_dim {shape['head_dim']}, MLP {shape['intermediate_size']:,}, "
        f"draft vocabulary {d['draft_vocab_size']:,}",
        highlight=False,
    )
    params = Table(title="Drafter parameters", title_justify="left")
    params.add_column("part")
    params.add_column("params", justify="right")
    rows = [
        ("draft lm_head", n["draft_lm_head"]),
        ("fc (3H -> H)", n["fc"]),
        ("attention (q, k, v read 2H)", n["attention"]),
        ("MLP", n["mlp"]),
        ("norms", n["layer_norms"] + n["final_norm"]),
        ("[bold]trainable", n["trainable"]),
        ("frozen: embedding (the target's)", n["frozen_embedding"]),
        ("frozen: the target's lm_head rows (teacher)", n["frozen_teacher_head_rows"]),
        ("[bold]frozen", n["frozen"]),
        ("[bold]total", n["total"]),
    ]
    for name, value in rows:
        params.add_row(name, _m(value))
    console.print(params)
    sizes = Table(title="By draft vocabulary size (vocab.coverage_grid)", title_justify="left")
    for col in ("draft vocab", "draft lm_head", "trainable", "total"):
        sizes.add_column(col, justify="right")
    for row in result["by_draft_vocab_size"]:
        mark = " *" if row["draft_vocab_size"] == d["draft_vocab_size"] else ""
        sizes.add_row(
            f"{row['draft_vocab_size']:,}{mark}",
            _m(row["draft_lm_head"]),
            _m(row["trainable"]),
            _m(row["total"]),
        )
    console.print(sizes)


def _print_store(s: dict, console: Any) -> None:
    from rich.table import Table

    store = Table(title="Feature store", title_justify="left")
    for col in (
        "format",
        "bytes/token",
        f"{s['tokens']:,} tokens{' (estimate)' if s['tokens_estimated'] else ''}",
    ):
        store.add_column(col, justify="right")
    for kind, per in s["bytes_per_token"].items():
        mark = " *" if kind == s["selected"] else ""
        store.add_row(kind + mark, f"{per:,}", _g(s["total_gib"][kind]))
    console.print(store)


def _print_training(tr: dict, console: Any) -> None:
    from rich.table import Table

    mem = tr["memory_gib_per_device"]
    train = Table(title=f"Training ({tr['world_size']} device(s))", title_justify="left")
    train.add_column("")
    train.add_column("", justify="right")
    for name, value in (
        ("samples: train / held-out", f"{tr['train_samples']:,} / {tr['heldout_samples']:,}"),
        (
            "steps (batches per epoch x epochs)",
            f"{tr['steps']:,} ({tr['batches_per_epoch']:,} x {tr['epochs']})",
        ),
        ("weights: trainable / frozen", f"{_g(mem['weights_trainable'])} / {_g(mem['weights_frozen'])}"),
        ("grads", _g(mem["grads"])),
        ("optimizer (AdamW moments)", _g(mem["optimizer"])),
        ("activations (calibrated on an H200)", _g(mem["activations"])),
        ("runtime (interpreter, allocator, CUDA context)", _g(mem["runtime"])),
        ("[bold]per device, DDP", _g(mem["total_ddp"])),
        ("per device, FSDP-sharded", _g(mem["total_fsdp"])),
    ):
        train.add_row(name, value)
    console.print(train)


def print_dflash(d: dict, target_flops: float, console: Any) -> None:
    """The DFlash block drafter of the dflash section for this target, beside the EAGLE-3 one."""
    from rich.table import Table

    c, n, mem, f = d["config"], d["params"], d["memory_gib_per_device"], d["flops"]
    mark = " (drafter.kind: dflash, trained)" if d["active"] else " (drafter.kind: dflash would train it)"
    table = Table(
        title=f"DFlash drafter{mark}: {c['num_layers']} layers, blocks of {c['block_size']}, target "
        f"layers {c['target_layer_ids']}",
        title_justify="left",
    )
    table.add_column("")
    table.add_column("", justify="right")
    drafts = c["block_size"] - 1
    for name, value in (
        ("fc + hidden_norm (target layers -> H)", _m(n["fc"])),
        ("attention (q/k norms)", _m(n["attention"])),
        ("MLP", _m(n["mlp"])),
        ("norms", _m(n["layer_norms"])),
        ("[bold]trainable", _m(n["trainable"])),
        ("frozen: the target's embedding and whole lm_head", _m(n["frozen"])),
        ("store bytes/token (target layers + last_hidden, bf16)", f"{d['store_bytes_per_token']:,}"),
        (f"training per device, DDP ({c['anchors']} anchors a sample)", _g(mem["total_ddp"])),
        ("training per device, FSDP-sharded", _g(mem["total_fsdp"])),
        ("training FLOPs per token (samples of data.max_length)", _flop(f["train_per_token"])),
        (
            f"one draft step ({drafts} drafts)",
            f"{_flop(f['draft_step'])} ({f['draft_step_over_target']:.1%} of a target token)",
        ),
        (f"EAGLE-3 steps for {drafts} drafts", f"{_flop(f['eagle3_steps_same_drafts'])}"),
        ("context per verified token", _flop(f["context_per_verified_token"])),
    ):
        table.add_row(name, value)
    console.print(table)


def print_plan(result: dict, console: Any) -> None:
    """The plan as rich tables, for people."""
    _print_drafter(result, console)
    _print_store(result["store"], console)
    print_features(result["features"], console)
    _print_training(result["training"], console)
    f = result["flops"]
    console.print(
        f"[bold]FLOPs[/]: one draft step {f['draft_step'] / 1e9:,.2f} GFLOP against the target's "
        f"{f['target_per_token'] / 1e9:,.1f} GFLOP per token ({f['draft_step_over_target']:.2%}); "
        f"fc {f['fc_per_verified_token'] / 1e9:,.2f} GFLOP per verified token",
        highlight=False,
    )
    if "dflash" in result:
        print_dflash(result["dflash"], f["target_per_token"], console)
    for note in result["notes"]:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print("assumes: " + "; ".join(result["assumptions"]), style="dim", highlight=False)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "-S", "--set-param", action="append", default=[], metavar="K=V", help="override a param, as dvc"
    )
    parser.add_argument("--target", help="packaged name, HF folder or config.json (default: target.source)")
    parser.add_argument("--tokens", type=int, help="tokens stored (default: data.num_samples x max_length)")
    parser.add_argument("--world", type=int, help="training devices (default: train.num_processes)")
    parser.add_argument(
        "--server-tokens-per-s",
        type=float,
        help="tokens/s one target server computes features for, for the server-hours of the "
        "features (default 10,000: an assumption, measure yours)",
    )
    parser.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")


def _params(args: argparse.Namespace) -> Params:
    """params.yaml (if there) with the -S overrides, validated."""
    import yaml

    raw = (yaml.safe_load(Path(args.params).read_text()) if Path(args.params).exists() else None) or {}
    for item in args.set_param:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and name):
            raise ParamsError("-S", [f"{item}: expected section.key=value (e.g. vocab.size=32000)"])
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    return parse_params(raw, f"{args.params} + -S" if args.set_param else args.params)


def _run(args: argparse.Namespace) -> int:
    from eagle3.core.inputs import InputError
    from eagle3.sweep.plan import plan, read_target_config

    try:
        params = _params(args)
        target = read_target_config(args.target or params.target.source)
        throughput = {"server_tokens_per_s": args.server_tokens_per_s} if args.server_tokens_per_s else {}
        result = plan(params, target, args.tokens, args.world, **throughput)
    except (ParamsError, InputError, ValueError) as err:
        return fail(err)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_plan(result, Console())
    return 0


SUBCOMMAND = Subcommand(
    "plan",
    "what a run will cost: drafter params, store bytes, training memory and steps, FLOPs",
    _arguments,
    _run,
)
