"""vLLM's piecewise CUDA graphs, emulated on the CPU: the contract a GPU holds recurfit's served model to.

vLLM compiles a model's code, splits the graph at its splitting ops (`vllm.compilation.backends.split_graph`) and
captures each segment between them as a CUDA graph per batch size, the splitting ops (attention) running eagerly
between segments. A captured graph replays the kernels it recorded on the addresses it recorded
(`compilation/cuda_graph.py`, `CUDAGraphWrapper.__call__`: nothing is copied in on replay, and in debug mode it
asserts the addresses): whatever tensors a replay is handed, it reads those of its capture, and it writes its
outputs into the same storage every time. All graphs share one memory pool, so what a replay wrote may be
overwritten by the next replay of another graph. vLLM captures graphs at its capture sizes only
(`cudagraph_capture_sizes`; a capture at another size fails outside its capture phase), and its runner pads a
batch to the next of them (`CudagraphDispatcher`); a larger batch runs without graphs.

`EmulatedGraph` does that on the CPU: at capture it keeps the tensors it was called with and its outputs; on replay
it checks it is handed the tensors of its capture (their addresses), runs the segment again on them (so it sees
what was written into them since, and nothing else) and copies the results into the kept outputs, which it returns,
after filling with NaN what other graphs' replays wrote since another graph last replayed (the shared pool).
`under_emulated_piecewise_graphs` compiles a served model's three pieces with a torch.compile backend that splits
each at the ops vLLM splits at on a GPU (its own defaults, and what the engine's worker added) and wraps every
segment so, sets the engine's capture sizes as vLLM's defaults up to `largest`, and runs every forward as vLLM
runs it under graphs (runtime mode PIECEWISE, a batch descriptor of the forward's token count; a forward of more
tokens than `largest` without graphs). The CPU runner does not pad a batch, so a graph is also captured at a
forward's own token count, where vLLM would have padded it to a capture size.

It counts the segment calls of each piece that run without graphs during a forward that runs under them
(`ungraphed`), and the replays at a capture size other than the forward's own (`padded`: steps over part of the
batch). A model that hands a segment a tensor allocated outside the graphs (a new address each forward), keeps a
graph's output past another graph's replay, or leaves an attention inside a segment, fails here.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.compilation.backends import split_graph
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.forward_context import BatchDescriptor, get_forward_context, override_forward_context
from vllm.model_executor.layers.attention import Attention

PIECES = ("prelude", "core_step", "coda")
# Ops that choose on the host what they compute each time they run (recurfit's core attention: which step's KV
# cache); a CUDA graph holding one would replay its choice at capture, so they must run between segments.
HOST_CHOICE_OPS = ("recurfit.stepped_attention",)


def capture_sizes(largest: int) -> list[int]:
    """vLLM's default capture sizes (`VllmConfig._set_cudagraph_sizes`: 1, 2, 4, then multiples of 8) up to
    `largest`."""
    return [size for size in [1, 2, 4, *range(8, largest + 1, 8)] if size <= largest]


class Emulation:
    """What the graphs of one engine share: the capture sizes, the counts, the forward running, the pool."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.counts = {"captures": 0, "replays": 0, "segments": 0, "padded": 0}
        self.counts["ungraphed"] = dict.fromkeys(PIECES, 0)
        self.forward_size: int | None = None  # the token count of the forward running under graphs, if one is
        self.written: list[tuple[tuple, list[torch.Tensor]]] = []  # outputs written since another graph's replay

    def graph(self, piece: str, size: int, outputs) -> None:
        """The graph of `piece` at `size` wrote `outputs`: what other graphs wrote since may be overwritten."""
        key = (piece, size)
        for other, tensors in self.written:
            if other != key:
                for tensor in tensors:
                    if tensor.is_floating_point():
                        tensor.fill_(float("nan"))
        self.written = [(other, tensors) for other, tensors in self.written if other == key]
        self.written.append((key, _tensors(outputs)))


class EmulatedGraph:
    """One graph segment of a piece under vLLM's piecewise CUDA graphs: captured per batch size on its first call
    there, replayed on the tensors of its capture, into the outputs of its capture."""

    def __init__(self, segment: torch.fx.GraphModule, piece: str, emulation: Emulation):
        frozen = [node for node in segment.graph.nodes if str(node.target).startswith(HOST_CHOICE_OPS)]
        if frozen:  # re-running the segment below would run them anew, which a CUDA graph never does
            raise AssertionError(f"a CUDA graph would freeze the host's choice of {frozen} at its capture")
        self.segment, self.piece, self.emulation = segment, piece, emulation
        self.captured: dict[int, tuple[tuple, object]] = {}

    def __call__(self, *args):
        context, emulation = get_forward_context(), self.emulation
        counts = emulation.counts
        if context.cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            if emulation.forward_size is not None:  # a forward vLLM runs under graphs: this segment runs without
                counts["ungraphed"][self.piece] += 1
            return self.segment(*args)
        size = context.batch_descriptor.num_tokens
        if size != emulation.forward_size and size not in emulation.sizes:
            raise AssertionError(f"no graph of {size} tokens: vLLM captures {emulation.sizes} only")
        counts["padded"] += size != emulation.forward_size
        if size not in self.captured:
            outputs = self.segment(*args)
            self.captured[size] = (args, outputs)
            counts["captures"] += 1
            emulation.graph(self.piece, size, outputs)
            return outputs
        inputs, outputs = self.captured[size]
        # (0-dim tensors are the Python numbers dynamo passes as tensors, which a captured graph holds as constants)
        tensors = [(new, old) for new, old in zip(_tensors(list(args)), _tensors(list(inputs))) if new.dim()]
        moved = [(i, tuple(new.shape)) for i, (new, old) in enumerate(tensors) if new.data_ptr() != old.data_ptr()]
        if moved:  # CUDAGraphWrapper's debug-mode check
            raise AssertionError(f"{self.piece} graph of {size} tokens replayed on other addresses, inputs {moved}")
        counts["replays"] += 1
        fresh = self.segment(*inputs)
        emulation.graph(self.piece, size, outputs)
        for kept, new in zip(_tensors(outputs), _tensors(fresh)):
            kept.copy_(new)
        return outputs


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def gpu_splitting_ops(engine_ops: list[str]) -> list[str]:
    """The ops vLLM splits at on a GPU (its defaults under VLLM_COMPILE with piecewise graphs; a CPU engine splits
    at none), and those the engine's worker added."""
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    return [*compilation.splitting_ops, *(op for op in engine_ops if op not in compilation.splitting_ops)]


def under_emulated_piecewise_graphs(model, largest: int = 32) -> None:
    """Applied in the engine's worker (`llm.apply_model`) to an eager engine's model, after its warm-up: its pieces
    compiled and split as vLLM does on a GPU, each segment an `EmulatedGraph`, the engine's capture sizes vLLM's
    defaults up to `largest`, and every forward of at most `largest` tokens run under graphs. Attention layers call
    vLLM's opaque attention op, as on a GPU (on a CPU vLLM calls the backend directly, inside the graph)."""
    compilation = model.vllm_config.compilation_config
    compilation.cudagraph_capture_sizes = sizes = capture_sizes(largest)
    compilation.max_cudagraph_capture_size = largest
    ops = gpu_splitting_ops(list(compilation.splitting_ops))
    model.graphs = emulation = Emulation(sizes)
    for module in model.modules():
        if isinstance(module, Attention):
            module.use_direct_call = False

    def backend_of(piece: str):
        def backend(graph: torch.fx.GraphModule, example_inputs):
            split, items = split_graph(graph, ops)
            for item in items:
                if not item.is_splitting_graph:
                    split.__dict__[item.submod_name] = EmulatedGraph(item.graph, piece, emulation)
                    emulation.counts["segments"] += 1
            return split

        return backend

    pieces = model.model.pieces
    for name in PIECES:
        piece = getattr(pieces, name)
        pieces.__dict__[name] = torch.compile(piece.forward, backend=backend_of(name), dynamic=True, fullgraph=True)
    forward = model.forward

    def forward_under_graphs(*args, **kwargs):
        num_tokens = kwargs["positions"].shape[-1] if "positions" in kwargs else args[1].shape[-1]
        if num_tokens > largest:  # vLLM's dispatcher: no graph holds the batch
            return forward(*args, **kwargs)
        context = dataclasses.replace(
            get_forward_context(),
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            batch_descriptor=BatchDescriptor(num_tokens=num_tokens),
        )
        emulation.forward_size = num_tokens
        try:
            with override_forward_context(context):
                return forward(*args, **kwargs)
        finally:
            emulation.forward_size = None

    model.forward = forward_under_graphs


def graph_counts(model) -> dict:
    counts = dict(model.graphs.counts)
    counts["ungraphed"] = dict(counts["ungraphed"])
    return counts
