"""vLLM's piecewise CUDA graphs, emulated on the CPU: the contract a GPU holds recurfit's served model to.

vLLM compiles a model's code, splits the graph at its splitting ops (`vllm.compilation.backends.split_graph`) and
captures each segment between them as a CUDA graph per batch size, the splitting ops (attention) running eagerly
between segments. A captured graph replays the kernels it recorded on the addresses it recorded
(`compilation/cuda_graph.py`: nothing is copied in on replay): whatever tensors a replay is handed, it reads
those of its capture, and it writes its outputs into the same storage every time, overwriting the last replay's.

`EmulatedGraph` does that on the CPU: at capture it keeps the tensors it was called with and its outputs; on replay
it runs the segment again on the kept inputs (so it sees what was written into them since, and nothing else) and
copies the results into the kept outputs, which it returns. `under_emulated_piecewise_graphs` compiles a served
model's three pieces with a torch.compile backend that splits each at the ops vLLM splits at on a GPU (its own
defaults, and what the engine's worker added) and wraps every segment so, and runs every forward as vLLM runs it
under graphs (runtime mode PIECEWISE, a batch descriptor of the forward's token count). A model that hands a
segment a tensor allocated outside the graphs (a new address each forward), or whose splitting ops leave an
attention inside a segment, gives other tokens under the emulation than eager.
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


class EmulatedGraph:
    """One graph segment under vLLM's piecewise CUDA graphs: captured per batch size on its first call there,
    replayed on the tensors of its capture, into the outputs of its capture."""

    def __init__(self, segment: torch.fx.GraphModule, counts: dict):
        frozen = [node for node in segment.graph.nodes if str(node.target).startswith(HOST_CHOICE_OPS)]
        if frozen:  # re-running the segment below would run them anew, which a CUDA graph never does
            raise AssertionError(f"a CUDA graph would freeze the host's choice of {frozen} at its capture")
        self.segment, self.counts = segment, counts
        self.captured: dict[int, tuple[tuple, object]] = {}

    def __call__(self, *args):
        context = get_forward_context()
        if context.cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            return self.segment(*args)  # vLLM runs the segment as it is (warm-up, steps on part of the batch)
        size = context.batch_descriptor.num_tokens
        if size not in self.captured:
            outputs = self.segment(*args)
            self.captured[size] = (args, outputs)
            self.counts["captures"] += 1
            return outputs
        inputs, outputs = self.captured[size]
        self.counts["replays"] += 1
        fresh = self.segment(*inputs)
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


def under_emulated_piecewise_graphs(model) -> None:
    """Applied in the engine's worker (`llm.apply_model`) to an eager engine's model: its pieces compiled and split
    as vLLM does on a GPU, each segment an `EmulatedGraph`, and every forward run under graphs. Attention layers
    call vLLM's opaque attention op, as on a GPU (on a CPU vLLM calls the backend directly, inside the graph)."""
    ops = gpu_splitting_ops(list(model.vllm_config.compilation_config.splitting_ops))
    model.graph_counts = counts = {"captures": 0, "replays": 0, "segments": 0}
    for module in model.modules():
        if isinstance(module, Attention):
            module.use_direct_call = False

    def backend(graph: torch.fx.GraphModule, example_inputs):
        split, items = split_graph(graph, ops)
        for item in items:
            if not item.is_splitting_graph:
                split.__dict__[item.submod_name] = EmulatedGraph(item.graph, counts)
                counts["segments"] += 1
        return split

    pieces = model.model.pieces
    for name in PIECES:
        piece = getattr(pieces, name)
        pieces.__dict__[name] = torch.compile(piece.forward, backend=backend, dynamic=True, fullgraph=True)
    forward = model.forward

    def forward_under_graphs(*args, **kwargs):
        num_tokens = kwargs["positions"].shape[-1] if "positions" in kwargs else args[1].shape[-1]
        context = dataclasses.replace(
            get_forward_context(),
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            batch_descriptor=BatchDescriptor(num_tokens=num_tokens),
        )
        with override_forward_context(context):
            return forward(*args, **kwargs)

    model.forward = forward_under_graphs


def graph_counts(model) -> dict:
    return dict(model.graph_counts)
