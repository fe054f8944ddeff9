"""`data prepare`: tokenise and pack sources into a token store."""

from __future__ import annotations

import argparse
import os

from .. import defaults
from .common import console, status


def add_parsers(commands) -> None:
    p = commands.add_parser("data", help="prepare training data (tokenise and pack into a token store)")
    data = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = data.add_parser("prepare", help="tokenise sources with the model's tokenizer into packed rows")
    p.add_argument("--tokenizer", help="model folder or Hub id whose tokenizer to use (default: the embedded model)")
    p.add_argument(
        "--source",
        action="append",
        required=True,
        help="a .jsonl/.parquet/.txt file or folder, hf:DATASET[:CONFIG][@SPLIT], embedded:prose or "
        "embedded:math[:N] (repeat for several)",
    )
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence (rows hold one more)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for validation")
    p.add_argument(
        "--text-field",
        help="JSON/parquet field holding the text, or conversations as lists of {role, content} messages "
        "(default: text, content, document or messages)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of generated sources (embedded:math)")
    _add_filter_arguments(p)
    p.add_argument(
        "--decontaminate",
        default=defaults.DECONTAMINATE,
        metavar="SETS",
        help="drop every document sharing a 13-word n-gram (8 words for short questions) with a test or "
        f"validation item of these evaluation sets: all, none, or names separated by commas from "
        f"{', '.join(defaults.EVAL_SETS)} (default: {defaults.DECONTAMINATE})",
    )
    _add_store_arguments(p)
    p.add_argument("--out", required=True, help="token-store folder")
    p.add_argument("--force", action="store_true", help="replace --out if it holds other data")
    p.set_defaults(run=cmd_data_prepare)


def _add_filter_arguments(p) -> None:
    """--filter and the options that tune it."""
    p.add_argument(
        "--filter",
        choices=["nemotron-sft"],
        help="nemotron-sft: drop rows written by RL-trained reasoning models (DeepSeek-R1, QwQ, Qwen3 Thinking, "
        "gpt-oss) and remove <extra_id_N>User/Assistant tags, as in the paper's §4.5 (docs/how-to/data.md)",
    )
    p.add_argument("--generator-field", help="with --filter: field naming each row's model (default: detected)")
    p.add_argument(
        "--exclude-generator",
        action="append",
        metavar="PATTERN",
        help="with --filter: a model name or pattern to drop, e.g. 'deepseek-r1*'; replaces the default list, "
        "which 'default' stands for (repeat for several)",
    )


def _add_store_arguments(p) -> None:
    """How much is read, how it is packed, and how the store is split into shards and tasks."""
    p.add_argument(
        "--max-tokens",
        type=_token_count,
        help="stop reading the sources once the training split holds this many tokens, e.g. 26.2B "
        "(default: read them all)",
    )
    p.add_argument(
        "--packing",
        choices=defaults.PACKINGS,
        default=defaults.DEFAULT_PACKING,
        help="bos-eos: the tokenizer's special tokens (its BOS) around each stripped document, then EOS, as the "
        "paper authors packed; eos: the document and EOS only (default: bos-eos)",
    )
    p.add_argument("--workers", type=int, default=_cores(), help="tokenising processes (default: this machine's cores)")
    p.add_argument(
        "--task",
        type=_task,
        default=(0, 1),
        metavar="I/N",
        help="make only shards j with j %% N == I, for N tasks on many machines writing one store on a shared "
        "file system, e.g. --task $SLURM_ARRAY_TASK_ID/8 (default: 0/1, the whole store)",
    )
    p.add_argument(
        "--shard-documents",
        type=int,
        default=defaults.SHARD_DOCUMENTS,
        help=f"documents per shard, the unit of resume and of --task (default: {defaults.SHARD_DOCUMENTS})",
    )


EMBEDDED_TOKENIZER = "embedded SmolLM2-135M-Instruct"


def cmd_data_prepare(args) -> None:
    from ..data import prepare
    from ..data.decontaminate import summary as decontamination_summary
    from ..data.filters import make_filter, summary
    from ..data.shards import Layout
    from ..model.loading import load_tokenizer

    row_filter = make_filter(args.filter, args.generator_field, args.exclude_generator)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.tokenizer is None:  # the store only suits models with this tokenizer: say so before the work
        status.print(
            f"Tokenising with the tokenizer of the {EMBEDDED_TOKENIZER} (no --tokenizer): the store suits models with "
            "this tokenizer only; pass --tokenizer PARENT for another parent."
        )
    result = prepare(
        tokenizer,
        args.source,
        args.seq_len,
        args.out,
        tokenizer_name=args.tokenizer or EMBEDDED_TOKENIZER,
        val_fraction=args.val_fraction,
        text_field=args.text_field,
        seed=args.seed,
        force=args.force,
        row_filter=row_filter,
        max_tokens=args.max_tokens,
        workers=args.workers,
        task=args.task,
        packing=args.packing,
        layout=Layout(args.shard_documents, min(args.shard_documents, defaults.BLOCK_DOCUMENTS)),
        decontaminate=args.decontaminate,
        say=lambda line: status.print(line, markup=False, highlight=False),  # progress: stderr
    )
    meta = result.meta
    if meta is None:
        index, count = args.task
        missing = ", ".join(map(str, result.missing[:10])) + (" …" if len(result.missing) > 10 else "")
        console.print(
            f"Task {index}/{count} has made its shards; {args.out} is written by the task that makes the last one "
            f"(shards still missing: {missing})."
        )
        return
    if result.skipped:
        console.print(f"{args.out} already holds this data (same sources, tokenizer and settings): nothing to do.")
    if "filter" in meta:
        console.print(summary(meta["filter"]), markup=False, highlight=False)
    if "decontamination" in meta:
        console.print(decontamination_summary(meta["decontamination"]), markup=False, highlight=False)
    if meta.get("loss_mask"):
        console.print(
            "Conversations rendered with the tokenizer's chat template; the assistant's tokens are kept as a mask "
            f"(found by {meta['assistant_tokens']}): train on them alone with data.assistant_only_loss=true."
        )
    if meta.get("packing") == "bos-eos" and meta.get("bos_token_id") is None:
        status.print("The tokenizer adds no BOS token: each document is packed as its text and EOS.")
    console.print(
        f"[bold]{args.out}[/]: {meta['documents']:,} documents → {meta['rows']['train']:,} training rows and "
        f"{meta['rows']['val']:,} validation rows of {meta['seq_len'] + 1} tokens ({meta['tokens']['train']:,} "
        f"training tokens, {meta['dtype']}, {len(meta.get('shards', [])) or 1} shard(s))."
    )


def _token_count(text: str) -> int:
    """A token count as 26200000000, 26_200_000_000, 26.2e9 or 26.2B (also k, M, T)."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text.strip()[-1:].lower(), 1)
    number = text.strip()[:-1] if scale != 1 else text.strip()
    try:
        value = float(number.replace("_", "")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 26.2B or 26200000000, got {text!r}") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a positive whole number of tokens, got {text!r}")
    return int(value)


def _task(text: str) -> tuple[int, int]:
    """`I/N`: this is task I of N (0-based), e.g. --task $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT."""
    index, _, count = text.partition("/")
    try:
        parsed = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/8, got {text!r}") from None
    if not (parsed[1] >= 1 and 0 <= parsed[0] < parsed[1]):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return parsed


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
