"""The recurrence's three pieces as vLLM compiles them (prelude, one core step, coda), and the rules their piecewise
CUDA graphs need: inputs at addresses fixed at capture, and no graphs for a step over part of the batch."""

from __future__ import annotations

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
    """Within the block, compiled pieces run without CUDA graphs: a graph is captured per batch size (vLLM's
    batch descriptor), and a step over some of the batch's tokens has another size than the batch."""
    if not cuda_graphs_replay():
        yield
        return
    context = dataclasses.replace(get_forward_context(), cudagraph_runtime_mode=CUDAGraphMode.NONE)
    with override_forward_context(context):
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
    previous step's output, so every piece reads its state from a buffer of fixed address, and each output is
    copied there before the next piece runs (`fixed`; on a CPU, without graphs, nothing is copied)."""

    def __init__(self, recurrence: nn.Module, vllm_config: VllmConfig):
        super().__init__()
        self.size = vllm_config.scheduler_config.max_num_batched_tokens
        self.buffers: dict[str, torch.Tensor] = {}
        for name, cls in (("prelude", CompiledPrelude), ("core_step", CompiledCoreStep), ("coda", CompiledCoda)):
            # Its compiled artifacts cached apart from the other pieces' and, under vLLM's own tag (a speculative
            # draft's "draft_model"), from another model's in the same engine.
            with set_model_tag(f"{backends.model_tag}_recurfit_{name}"):
                setattr(self, name, cls(vllm_config=vllm_config, recurrence=recurrence))

    def fixed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the first rows of the buffer `name` while CUDA graphs run, else `tensor` itself."""
        if not cuda_graphs_replay():
            return tensor
        buffer = self.buffers.get(name)
        if buffer is None:  # vLLM's batches hold at most max_num_batched_tokens tokens: allocated once
            size = max(self.size, tensor.shape[0])
            buffer = self.buffers[name] = tensor.new_empty((size, *tensor.shape[1:]))
        view = buffer[: tensor.shape[0]]
        return view if view.data_ptr() == tensor.data_ptr() else view.copy_(tensor)
