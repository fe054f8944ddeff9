"""What part 1's decoding steps (correctness, decode, sweep) build and read: a random retrofit on the device and
random token rows, the CUDA graphs its compiled decoding captured and replayed, and the compile a batch size is
predicted to take."""

from __future__ import annotations

from .context import Context


def build_retrofit(ctx: Context, parent: dict, shape, dtype, perturb: float = 0.1):
    """A retrofit of a random Llama `parent` built on the device, adapter perturbed, s_0 = 0, in eval mode."""
    import torch
    from decode import perturb_adapter
    from transformers import AutoModelForCausalLM, LlamaConfig

    import recurfit

    torch.manual_seed(0)
    with ctx.device:
        model = recurfit.retrofit(AutoModelForCausalLM.from_config(LlamaConfig(**parent), dtype=torch.float32), shape)
    if perturb:
        perturb_adapter(model, perturb)
    model.config.state_init_std = 0.0  # every run, eager or compiled, starts from the same state
    return model.eval().to(dtype)


def random_rows(ctx: Context, batch: int, length: int, vocab: int):
    from decode import passages

    return passages(None, batch, length, vocab_size=vocab).to(ctx.device)


def graph_use(model, before: dict | None = None) -> dict:
    """The tokens `model`'s compiled decoding captured as CUDA graphs, replayed and ran without one (since
    `before`), and why captures failed."""
    from recurfit.model.compiled import graph_counts

    now = graph_counts(model)
    failures = {str(key): why for key, why in now["failures"].items()}
    if before is None:
        return {**now, "failures": failures}
    counts = {name: now[name] - before[name] for name in ("ran", "captured", "replayed", "exit runs")}
    return {**counts, "failures": {key: why for key, why in failures.items() if key not in before["failures"]}}


def graphs_text(use: dict) -> str:
    text = (
        f"CUDA graphs: {use['captured']} captured, {use['replayed']} token(s) replayed, {use['ran']} run "
        "without a graph"
    )
    if use.get("exit runs"):  # under an exit rule: the runs of `check_every` steps replayed past each token's first
        text += f" ({use['exit runs']} later run(s) of steps replayed under an exit rule)"
    failed = "; ".join(f"{key}: {why}" for key, why in use["failures"].items())
    return text + (f"; captures failed: {failed}" if failed else "")


def predicted_compile(compiles: dict, batch: int, earlier=()) -> float | None:
    """Seconds that compiling decoding at `batch` will take in this process (None: nothing to go by), from the
    compiles measured in it (batch size -> seconds) and in `earlier` steps: none at a batch size compiled here (a
    new r runs the same graphs, captured anew in well under a second); else as long as the longest measured (the
    same graphs at other shapes, or in another process)."""
    if batch in compiles:
        return 0.0
    measured = [*compiles.values(), *earlier]
    return max(measured) if measured else None
