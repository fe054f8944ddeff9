"""The recurrence's three pieces as vLLM compiles them (prelude, one core step, coda), and the rules their piecewise
CUDA graphs need: inputs at addresses fixed at capture, and a step over part of the batch padded to a captured size."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from vllm.compilation import backends
from vllm.compilation.backends import set_model_tag
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available, override_forward_context

from .attention import STEPPED_ATTENTION


def split_at_stepped_attention(compilation) -> None:
    """The core's attention op (`STEPPED_ATTENTION`) added to the ops vLLM's piecewise graphs split at, after the
    ones vLLM chose (its attention ops, and the KV-cache updates it keeps out of graphs): called in the worker, on
    the engine's final config, before any piece compiles. Left out, every core step would replay the attention of
    the step it was captured at. The final mode is checked here too: vLLM turns PIECEWISE into FULL after recurfit's
    config hook has run when asked to fuse attention with quantization (`set_splitting_ops_for_v1`)."""
    mode = compilation.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        raise ValueError(
            f"recurfit on vLLM: cudagraph_mode is {mode.name} on the final config (vLLM sets FULL for "
            "-cc.pass_config.fuse_attn_quant=true), which replays whole forwards at the depth captured: drop "
            "fuse_attn_quant, or set -cc.cudagraph_mode=NONE."
        )
    ops = compilation.splitting_ops or []
    if STEPPED_ATTENTION not in ops:
        compilation.splitting_ops = [*ops, STEPPED_ATTENTION]


def cuda_graphs_replay() -> bool:
    """Whether this forward runs under vLLM's CUDA graphs (captured or replayed; never on a CPU)."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


@contextlib.contextmanager
def without_cuda_graphs() -> Iterator[None]:
    """Within the block, compiled pieces run without CUDA graphs (a step over more tokens than vLLM captured)."""
    if not cuda_graphs_replay():
        yield
        return
    context = dataclasses.replace(get_forward_context(), cudagraph_runtime_mode=CUDAGraphMode.NONE)
    with override_forward_context(context):
        yield


@contextlib.contextmanager
def graphs_of(size: int | None) -> Iterator[None]:
    """Within the block, compiled pieces replay their graphs of `size` tokens (None: run without graphs).

    vLLM's `CUDAGraphWrapper.__call__` (compilation/cuda_graph.py) replays the graph of the forward context's
    `batch_descriptor` when its `cudagraph_runtime_mode` is the wrapper's (PIECEWISE here), and trusts both; its
    runner's `CudagraphDispatcher.dispatch` (v1/cudagraph_dispatcher.py) chose them for the batch, padded to a
    captured size. A step over fewer tokens names another captured size the same way: the descriptor's `num_tokens`
    only, its other fields (LoRA) as the dispatcher set them."""
    if size is None:
        with without_cuda_graphs():
            yield
        return
    context = get_forward_context()
    if context.batch_descriptor.num_tokens == size:
        yield
        return
    descriptor = dataclasses.replace(context.batch_descriptor, num_tokens=size)
    with override_forward_context(dataclasses.replace(context, batch_descriptor=descriptor)):
        yield


class Piece(nn.Module):
    """A piece of `RecurrentModel` for vLLM to compile: each subclass has a forward (a code object, hence a compiled
    graph) of its own, and its token dimension, which vLLM compiles as dynamic, in its decorator."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", recurrence: nn.Module):
        super().__init__()
        self.__dict__["recurrence"] = recurrence  # outside the module tree: the recurrence holds the pieces


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class CompiledPrelude(Piece):
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None):
        return self.recurrence.prelude(input_ids, positions, inputs_embeds)


@support_torch_compile(dynamic_arg_dims={"positions": -1, "state": 0, "part": 0})
class CompiledCoreStep(Piece):
    def forward(self, positions: torch.Tensor, state: torch.Tensor, part: torch.Tensor):
        return self.recurrence.core_step(positions, state, part)


@support_torch_compile(dynamic_arg_dims={"positions": -1, "state": 0})
class CompiledCoda(Piece):
    def forward(self, positions: torch.Tensor, state: torch.Tensor):
        return self.recurrence.coda(positions, state)


class Pieces(nn.Module):
    """The recurrence's three pieces as vLLM compiles them (each once, on its first call, whatever the depths served;
    under `--enforce-eager` they run as they are), and the buffers whose addresses their CUDA graphs read.

    Under vLLM's piecewise CUDA graphs a piece's graph replays reading the input addresses it was captured with,
    and its outputs live in a pool later graphs reuse. The core step runs several times per forward on the
    previous step's output, so the core step and the coda read their inputs from buffers of fixed address (the core
    step's state, adapter part and positions; the coda's state and positions), and each output is copied there
    before the next piece runs (`fixed`; on a CPU, without graphs, nothing is copied).

    A step over fewer tokens than the batch replays the graph of the next size vLLM captured (`graph_size`), as
    vLLM's runner pads a batch between capture sizes: its tokens fill the first rows of the same buffers, and the
    padding rows hold whatever the buffers held (their outputs are never read)."""

    def __init__(self, recurrence: nn.Module, vllm_config: VllmConfig):
        super().__init__()
        self.size = vllm_config.scheduler_config.max_num_batched_tokens
        self.compilation = vllm_config.compilation_config
        self.buffers: dict[str, torch.Tensor] = {}
        for name, cls in (("prelude", CompiledPrelude), ("core_step", CompiledCoreStep), ("coda", CompiledCoda)):
            # Its compiled artifacts cached apart from the other pieces' and, under vLLM's own tag (a speculative
            # draft's "draft_model"), from another model's in the same engine.
            with set_model_tag(f"{backends.model_tag}_recurfit_{name}"):
                setattr(self, name, cls(vllm_config=vllm_config, recurrence=recurrence))

    def graph_size(self, tokens: int) -> int | None:
        """The captured size a step over `tokens` tokens replays under graphs: the smallest of vLLM's capture sizes
        that holds them, as `CudagraphDispatcher._compute_bs_to_padded_graph_size` pads a batch; None above the
        largest (the step runs without graphs, as vLLM runs such a batch)."""
        sizes = sorted(self.compilation.cudagraph_capture_sizes or ())
        index = bisect.bisect_left(sizes, tokens)
        return sizes[index] if index < len(sizes) else None

    def fixed(self, name: str, tensor: torch.Tensor, size: int | None = None, dim: int = 0) -> torch.Tensor:
        """`tensor` in the first rows (along `dim`, its tokens) of the buffer `name`, and the buffer's first `size`
        rows returned (default: as many as `tensor` has), while CUDA graphs run; else `tensor` itself."""
        if not cuda_graphs_replay():
            return tensor
        rows = tensor.shape[dim]
        size = rows if size is None else size
        buffer = self.buffers.get(name)
        if buffer is None:  # vLLM's batches hold at most max_num_batched_tokens tokens: allocated once
            shape = list(tensor.shape)
            shape[dim] = max(self.size, size)
            buffer = self.buffers[name] = tensor.new_zeros(shape)  # padding rows read before written: finite
        head = buffer.narrow(dim, 0, rows)
        if head.data_ptr() != tensor.data_ptr():
            head.copy_(tensor)
        return buffer.narrow(dim, 0, size)

    def step(self, positions: torch.Tensor, state: torch.Tensor, part: torch.Tensor, size: int | None = None):
        """One core step over `state`'s tokens through the graph of `size` tokens (None: as many), its output in
        the state buffer (a replay's output is overwritten by the next graph that replays)."""
        tokens = state.shape[0]
        inputs = self.fixed("positions", positions, size, -1), self.fixed("state", state, size)
        output = self.core_step(*inputs, self.fixed("part", part, size))
        return self.fixed("state", output[:tokens])

    def final(self, positions: torch.Tensor, state: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """The coda over `state`'s tokens through the graph of `size` tokens (None: as many), those tokens' rows."""
        tokens = state.shape[0]
        output = self.coda(self.fixed("coda_positions", positions, size, -1), self.fixed("coda", state, size))
        return output[:tokens]
