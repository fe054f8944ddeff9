"""Run by tests/test_train_memory.py under `torchrun --nproc-per-node 2`: the buffers FSDP2 allocates in one
training micro-batch of the plan's tiny retrofit (conftest.tiny_plan_model's shapes, with weights), sharded as the
trainer shards it in bf16 (weights gathered in bf16, gradients reduced in fp32).

`python fsdp_buffers_probe.py OUT.json` writes, from the main process, for each layout of LAYOUTS (`fsdp_units`, and
whether the head is tied to the token embeddings), in the order FSDP2 ran them:
- `gathers`: per foreach_all_gather, the unit's name and the bytes of its flat output, and `forward_gathers`, how
  many of them the forward ran;
- `reductions`: per foreach_reduce, the unit's name, the bytes and element size of the whole gradients it received
  and the element size of its reduce-scatter input (reduce_dtype), and whether the root's final callback ran it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import tiny_parent  # noqa: E402

from recurfit import retrofit  # noqa: E402
from recurfit.train.distributed import Processes  # noqa: E402
from recurfit.train.head import final_hidden_states  # noqa: E402
from recurfit.train.losses import HealingLoss  # noqa: E402


def record(gathers: list, reductions: list):
    """Patch FSDP2's collectives (looked up in their module at each call) to record what they receive; returns the
    undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    from torch.distributed.fsdp._fully_shard import _fsdp_state as state_module

    unit = {"name": None, "final": False}
    gather, reduce = group_module.foreach_all_gather, group_module.foreach_reduce
    group, state = group_module.FSDPParamGroup, state_module.FSDPState
    unshard, post_backward, final_callback = (
        group.unshard,
        group.post_backward,
        state._root_post_backward_final_callback,
    )

    def named(method):
        def call(self, *args, **kwargs):
            unit["name"] = self._module_fqn or "root"
            return method(self, *args, **kwargs)

        return call

    def in_final_callback(self):
        unit["final"] = True
        try:
            return final_callback(self)
        finally:
            unit["final"] = False

    def gathered(params, *args, **kwargs):
        result = gather(params, *args, **kwargs)
        output = result.all_gather_output
        gathers.append({"unit": unit["name"], "bytes": output.numel() * output.element_size()})
        return result

    def reduced(params, grads, *args, **kwargs):
        reduce_dtype = args[4] or grads[0].dtype  # foreach_reduce(params, grads, group, stream, comm, orig, reduce, …)
        reductions.append(
            {
                "unit": unit["name"],
                "gradient_bytes": sum(g.numel() * g.element_size() for g in grads),
                "gradient_itemsize": grads[0].element_size(),
                "reduce_itemsize": reduce_dtype.itemsize,
                "final": unit["final"],
            }
        )
        return reduce(params, grads, *args, **kwargs)

    group.unshard, group.post_backward = named(unshard), named(post_backward)
    state._root_post_backward_final_callback = in_final_callback
    group_module.foreach_all_gather, group_module.foreach_reduce = gathered, reduced

    def undo():
        group.unshard, group.post_backward = unshard, post_backward
        state._root_post_backward_final_callback = final_callback
        group_module.foreach_all_gather, group_module.foreach_reduce = gather, reduce

    return undo


LAYOUTS = {"recurrence": ("recurrence", False), "layer": ("layer", False), "tied": ("recurrence", True)}


def tiny_retrofit(tied: bool) -> torch.nn.Module:
    """conftest.tiny_plan_model's retrofit, with weights (a tied one: of a tied parent, left tied)."""
    parent = tiny_parent("llama", num_layers=6, place=False, tie_word_embeddings=tied)
    return retrofit(parent, (2, 2, 2), untie_embeddings=not tied).train()


def one_micro_batch(processes: Processes, units: str, tied: bool) -> dict:
    model = tiny_retrofit(tied)
    processes.wrap(model, "fsdp", bf16=True, layers=units == "layer")
    gathers, reductions = [], []
    undo = record(gathers, reductions)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's, as on a GPU
        hidden, weight = final_hidden_states(model, model, ids[:, :-1], num_steps=(2, 2))
        loss = HealingLoss(None, None)(hidden, weight, ids[:, 1:].flatten(), None, {})
    forward_gathers = len(gathers)
    loss.backward()
    undo()
    processes.sharded.clear()
    return {"gathers": gathers, "forward_gathers": forward_gathers, "reductions": reductions}


def main(out: str) -> None:
    processes = Processes.from_environment(timeout=120)
    found = {name: one_micro_batch(processes, *layout) for name, layout in LAYOUTS.items()}
    if processes.rank == 0:
        Path(out).write_text(json.dumps(found))
    processes.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
