"""The served recurrence's step loop: each token runs to its own depth (its request's, or the step its exit rule
stopped it at), and the steps past a token's depth compute only the others.

Steps 1..max(depths), each on the tokens not yet at their depth only: the batch pays each request's own depth,
attention included where the backend's metadata narrows (`RecurringRequests`), else attention for every token up to
the deepest. Each time some tokens reach their depth, or stop by their exit rule (`recurfit.serving.exit`), the
others (`rows`) are gathered with their adapter parts and positions, and the states of all scattered back. The host
learns of exits once every `exit_check_every` steps; in between, a stopped token stays in the rows, frozen: its
state kept, and its attention given its stopping step's keys and values (`SteppedAttention.frozen`).

Under CUDA graphs every step replays one (`recurfit.serving.pieces`): a step over the whole batch replays the graph
vLLM chose for the batch; a step over fewer tokens replays the graph of the next size vLLM captured, its tokens in
the first rows of the pieces' buffers and the padding rows' outputs never read, with the attention, which runs
between graph segments, over its tokens only (narrowed metadata whose `num_actual_tokens` are the rows, the
padding's cache slots vLLM's `PAD_SLOT_ID`, as for a batch vLLM's runner pads). The exit rules' probe (the coda at a
step) replays the coda's graph the same way. Only a batch larger than vLLM's largest capture size runs without
graphs, as vLLM runs it.

A token that stopped by its rule at step k is read by later tokens at step k at every deeper step, as recurfit's
`generate` reads it (the latest-step rule of recurfit.model.cache): under the `all` cache policy, once the loop has
run, its step-k keys and values (each core layer's, kept as it ran: `SteppedAttention.keep`) are written into the
caches of steps k+1..cap by those steps' vLLM `Attention`, with the metadata narrowed to the stopped tokens (on the
backends that narrow; on others, attention over every token writes each one's kept keys, as its steps past a
request's depth do).
"""

from __future__ import annotations

import contextlib

import torch

from .pieces import cuda_graphs_replay, graphs_of


def recur(model, positions, state, part, depths, stops: tuple[int, ...], exits=None) -> torch.Tensor:
    """The states after each token's steps (`model`: the served `RecurrentModel`; see the module docstring)."""
    P, R, C = model.shape
    pieces, requests = model.pieces, model.requests
    core = [model.body.layers[P + i].self_attn.attn for i in range(R)]
    layers = [[attention.layer_name for attention in stepped.steps] for stepped in core]
    coda = [model.body.layers[P + R + i].self_attn.attn.layer_name for i in range(C)]
    narrow = requests.narrowable(layers[0][0])
    graphs = cuda_graphs_replay()  # the buffers then hold a step's inputs, overwritten by the next step's
    if exits is not None:
        depths = exits.depths
    rows = size = None  # the running tokens (None: all), and the captured size their steps replay
    running, running_part, ran = state, part, 0
    running_positions = pieces.fixed("positions", positions, dim=-1)
    try:
        for stepped in core:
            stepped.tracking = exits is not None or not narrow
            stepped.owned = graphs
        for step in range(stops[-1]):
            if step in stops or (exits is not None and exits.changed):
                if rows is None:
                    state = running.clone() if graphs else running
                else:
                    state = state.index_copy(0, rows, running)
                kept = ((depths if rows is None else depths[rows]) > step).nonzero().squeeze(1)
                rows = kept if rows is None else rows[kept]
                running, running_part = running[kept], running_part[kept]
                if rows.numel() == 0:
                    break
                size = pieces.graph_size(rows.numel()) if graphs else None
                running, running_part = pieces.fixed("state", running), pieces.fixed("part", running_part)
                running_positions = pieces.fixed("positions", positions[..., rows], dim=-1)
                if narrow:
                    requests.narrow_to(depths, step, rows, size)
                if exits is not None:
                    exits.follow(rows)
            slot = step if model.policy == "all" else 0
            frozen = None if exits is None else exits.frozen()
            for stepped in core:
                stepped.step, stepped.frozen = slot, frozen
                stepped.rows = None if narrow else rows
                stepped.tracked = rows if narrow else None
            kept_before = exits is not None and (exits.reads_state or frozen is not None)
            previous = running.clone() if kept_before and (graphs or rows is None) else running
            if rows is None:
                running = pieces.step(running_positions, running, running_part)
            else:
                names = [names[slot] for names in layers]
                with requests.only(names) if narrow else contextlib.nullcontext(), graphs_of(size):
                    running = pieces.step(running_positions, running, running_part, size)
            if frozen is not None:  # tokens stopped since the last check keep their state (`generate`'s frozen rows)
                running = pieces.fixed("state", torch.where(frozen[:, None], previous, running))
            ran = step + 1
            if exits is not None:
                probe = _probe(pieces, requests, coda, narrow, positions, state, rows, running, running_positions, size)
                exits.check(ran, previous, running, probe)
        if exits is not None and model.policy == "all":
            _write_stopped_tokens(core, layers, requests, narrow, exits, ran)
    finally:
        for stepped in core:
            stepped.step, stepped.tracking, stepped.rows, stepped.keep, stepped.tracked = 0, False, None, None, None
            stepped.frozen = None
    return running if rows is None else state.index_copy(0, rows, running)


def _probe(pieces, requests, coda: list[str], narrow: bool, positions, state, rows, running, running_positions, size):
    """`probe(local)`: the final hidden states of `local` (indices into `rows`) were the recurrence to stop at
    `running`, as `generate`'s exit probe reads them (the coda's keys it writes are overwritten by the forward's
    last coda), through the coda's graph of the step's size."""

    def probe(local: torch.Tensor) -> torch.Tensor:
        if rows is None:
            return pieces.final(positions, running)[local]
        if narrow:
            with requests.only(coda), graphs_of(size):
                return pieces.final(running_positions, running, size)[local]
        return pieces.final(positions, state.index_copy(0, rows, running))[rows[local]]

    return probe


def _write_stopped_tokens(core, layers, requests, narrow: bool, exits, ran: int) -> None:
    """Under the `all` policy, each token that stopped at step k gets its step-k keys and values (kept as it ran)
    in the caches of steps k+1..cap, each written by that step's `Attention` (its output unused)."""
    stopped = exits.stopped()
    if not bool(stopped.any()):
        return
    caps, depths = exits.caps, exits.depths
    last = int(caps[stopped].max())
    if not narrow:  # every token attends at every step the loop ran, each with its kept keys: the rest of the steps
        for step in range(ran, last):
            for stepped in core:
                key, value = stepped.keep
                stepped.steps[step](_queries(stepped, key, key.shape[0]), key, value)
        return
    chosen = None
    for step in range(int(depths[stopped].min()), last):
        writes = stopped & (depths <= step) & (caps > step)
        if chosen is None or not torch.equal(writes, chosen):
            chosen, rows = writes, writes.nonzero().squeeze(1)
            requests.narrow_to(writes.long(), 0, rows)
        if rows.numel() == 0:  # the tokens stopped before `step` all had caps below it, the others stop after it
            continue
        with requests.only([names[step] for names in layers]):
            for stepped in core:
                key, value = stepped.keep
                stepped.steps[step](_queries(stepped, key, rows.numel()), key[rows], value[rows])


def _queries(stepped, like: torch.Tensor, count: int) -> torch.Tensor:
    attention = stepped.steps[0]
    return like.new_zeros((count, attention.num_heads * attention.head_size))
