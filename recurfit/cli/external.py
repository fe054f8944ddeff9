"""`push`, `lm-eval` and `draft`: commands that hand the work to another tool (the Hugging Face Hub, lm-eval's own
CLI, vLLM's speculative decoding)."""

from __future__ import annotations

import argparse
import sys

from ..extras import require
from .common import console, positive_int, status


def add_parsers(commands) -> None:
    p = commands.add_parser("push", help="upload a saved model folder (weights, tokenizer, model card) to the Hub")
    p.add_argument("folder", help="a retrofit --out folder or runs/NAME/final")
    p.add_argument("repo_id", help="Hub repository, e.g. USER/NAME (created if needed; log in with `hf auth login`)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.set_defaults(run=cmd_push)

    p = commands.add_parser("lm-eval", help="lm-eval's own CLI with --model recurfit and the offline tasks")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="lm-eval arguments, e.g. --model recurfit …")
    p.set_defaults(run=cmd_lm_eval)

    p = commands.add_parser(
        "draft", help="a folder that serves the same retrofit at a low depth: vLLM's draft for speculative decoding"
    )
    p.add_argument("folder", help="a retrofit folder (runs/NAME/final, a surgery --out folder)")
    p.add_argument("--depth", type=positive_int, required=True, help="the draft's recurrence (1 or 2 are typical)")
    p.add_argument("--out", required=True, help="the draft folder (its weights and tokenizer link to FOLDER's)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=cmd_draft)


def cmd_push(args) -> None:
    from ..model.card import files_to_upload, push

    files = files_to_upload(args.folder)
    status.print(f"Uploading {len(files)} files of {args.folder} to {args.repo_id}: {', '.join(files)}")
    console.print(f"Done: {push(args.folder, args.repo_id, private=args.private)}")


def cmd_lm_eval(args) -> None:
    """lm-eval's own command line, with the `recurfit` model type registered and the offline tasks included."""
    require("`recurfit lm-eval`", "eval")
    from lm_eval.__main__ import cli_evaluate

    from ..evaluate import lm  # noqa: F401  (registers --model recurfit)
    from ..evaluate.suite import TASKS_DIR, quiet_git_hash

    argv = list(args.arguments)
    if not any(a.startswith("--include_path") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    with quiet_git_hash():
        cli_evaluate()


def cmd_draft(args) -> None:
    from ..serving.draft import write_draft

    out = write_draft(args.folder, args.depth, args.out, replace=args.force)
    console.print(
        f"Wrote {out}: {args.folder} at depth {args.depth}, its files linked. Serve with --speculative-config "
        f'\'{{"method": "draft_model", "model": "{out}", "num_speculative_tokens": 4}}\''
    )
