"""`generate` and `chat`: text from a model, with its recurrence, adaptive exit, cache and speculative decoding."""

from __future__ import annotations

from .. import defaults
from .common import _placement, add_placement_arguments, console, positive_int, status


def add_parsers(commands) -> None:
    commands_help = (
        ("generate", "continue a prompt: its raw text, as a completion (--chat-template on: as a chat message)"),
        ("chat", "chat in the terminal, each turn through the tokenizer's chat template"),
    )
    for name, help_text in commands_help:
        p = commands.add_parser(name, help=help_text)
        p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model, retrofitted)")
        if name == "generate":
            p.add_argument("--prompt", required=True, help="the text to continue")
            p.add_argument(
                "--chat-template",
                choices=("on", "off"),
                default="off",
                help="off: the prompt's raw text, as vLLM's /v1/completions reads it; on: the prompt as a user "
                "message through the tokenizer's chat template, as /v1/chat/completions does (default: off)",
            )
            p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
        p.add_argument(
            "-r",
            "--recurrence",
            dest="recurrence",
            type=int,
            help="recurrences per token, 1 to 1024 (default: the model's mean recurrence r̄)",
        )
        p.add_argument("--exit", help="adaptive depth: kl:5e-4, state:0.01 or argmax:2 (at most --recurrence)")
        p.add_argument(
            "--min-recurrence",
            dest="min_recurrence",
            type=positive_int,
            default=2,
            help="no adaptive exit before this many recurrences",
        )
        p.add_argument(
            "--exit-check-every",
            dest="exit_check_every",
            type=positive_int,
            default=1,
            help="with --exit: ask whether every row has settled once every N recurrences; N > 1 keeps settled "
            "rows in the batch, frozen, so the GPU never waits between checks",
        )
        p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
        p.add_argument("--cache", choices=defaults.CACHE_POLICIES, default="all", help="KV-cache policy for the core")
        p.add_argument(
            "--warm-start", action="store_true", help="start each token's recurrence from the previous token's state"
        )
        p.add_argument(
            "--draft-steps",
            type=int,
            help="self-speculative decoding: draft at this recurrence, greedy (default: off)",
        )
        p.add_argument("--lookahead", type=int, default=4, help="with --draft-steps: tokens drafted per verification")
        p.add_argument(
            "--compile",
            action="store_true",
            help="decode through a compiled step (torch.compile; CUDA graphs on a GPU): faster per token after a "
            "one-time compile; with --exit, tokens stop where uncompiled decoding stops them",
        )
        add_placement_arguments(p)
        p.set_defaults(run=cmd_generate if name == "generate" else cmd_chat)


def _generation_model(args):
    """The model to talk to and its tokenizer, on --device in --dtype; without MODEL, the embedded SmolLM2
    retrofitted on the spot."""
    from ..model.loading import load_tokenizer
    from .common import load_recurrent_model

    if args.model is None:
        status.print(
            f"[dim]The embedded SmolLM2-135M-Instruct, retrofitted to {defaults.DEFAULT_SHAPE} and not trained (its "
            "outputs are rough). Pass a trained model folder (e.g. runs/NAME/final).[/]"
        )
    placement = _placement(args)
    return load_recurrent_model(args.model, placement.dtype, placement.device), load_tokenizer(args.model)


def _settings(args):
    from ..generation import GenerationSettings

    return GenerationSettings(
        recurrence=args.recurrence,
        exit=args.exit,
        min_steps=args.min_recurrence,
        exit_check_every=args.exit_check_every,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        cache_policy=args.cache,
        warm_start=args.warm_start,
        draft_steps=args.draft_steps,
        lookahead=args.lookahead,
        compile=args.compile,
    )


def _report(generation) -> None:
    """The statistics line, on stderr: stdout holds the text alone (`recurfit generate … > out.txt`)."""
    rate = generation.tokens / generation.seconds if generation.seconds else 0.0
    depth = ""
    if generation.steps_per_token:
        steps = generation.steps_per_token
        depth = f", recurrences per token: mean {sum(steps) / len(steps):.1f} (min {min(steps)}, max {max(steps)})"
    if generation.acceptance_rate is not None:
        depth = f", {generation.acceptance_rate:.0%} of drafted tokens accepted"
    status.print(f"[dim]{generation.tokens} tokens in {generation.seconds:.1f} s ({rate:.1f} tokens/s){depth}[/]")


def _note_missing_chat_template(tokenizer) -> None:
    """Chat prompts from a tokenizer without a chat template are its messages' plain text: say so once."""
    from ..generation.text import has_chat_template

    if not has_chat_template(tokenizer):
        status.print("[dim]This tokenizer has no chat template: the messages go in as plain text.[/]")


def cmd_generate(args) -> None:
    from ..generation import chat_ids, generate_text, prompt_ids

    settings = _settings(args)  # bad settings fail before the model loads
    model, tokenizer = _generation_model(args)
    if args.chat_template == "on":
        _note_missing_chat_template(tokenizer)
        ids = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        ids = prompt_ids(tokenizer, args.prompt)
    generation = generate_text(model, tokenizer, ids, settings, stream=args.stream)
    if not args.stream:
        console.print(generation.text, highlight=False, markup=False)
    _report(generation)


def cmd_chat(args) -> None:
    """A conversation; Ctrl-C stops the answer being written (the exchange is dropped), Ctrl-D or an empty line
    ends the chat."""
    from ..generation import chat_ids, generate_text

    settings = _settings(args)
    model, tokenizer = _generation_model(args)
    _note_missing_chat_template(tokenizer)
    messages: list[dict] = []
    status.print("[dim]Chat: Ctrl-C stops an answer; an empty line or Ctrl-D ends the chat.[/]")
    while True:
        try:
            line = console.input("[bold]you>[/] ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, as in a shell
            console.print()
            continue
        if not line:
            break
        messages.append({"role": "user", "content": line})
        console.print("[bold]model>[/] ", end="")
        try:
            generation = generate_text(model, tokenizer, chat_ids(tokenizer, messages), settings, stream=True)
        except KeyboardInterrupt:
            messages.pop()
            console.print()
            status.print("[dim](stopped; this question is left out of the conversation)[/]")
            continue
        messages.append({"role": "assistant", "content": generation.text})
        _report(generation)
