"""Processes and devices: torchrun's environment, DDP or FSDP2 applied from outside the model (torchtitan style).

One process (no torchrun) needs no process group. Under torchrun, gloo on CPU and NCCL on GPU, with DDP or FSDP2
applied even to a single process (`torchrun --nproc-per-node 1`), so that the distributed path can be checked on a
machine with one GPU.

FSDP2 and recurrence. Every call of an FSDP unit may be a collective (an all-gather before it runs, a
reduce-scatter after its backward), and collectives pair up across processes in the order they are issued. A
core layer runs n + k times per micro-batch, the coda once more per supervised depth, and with
`depth.draw: micro_batch` each process draws its own (n, k): were each core layer a unit, processes would issue
different numbers of collectives, and the run would hang or exchange the shards of unrelated layers. So the
units are the modules whose forward runs once per micro-batch whatever the depth: the token embeddings, each
prelude layer, the recurrent body (adapter, core, coda and final norm: what the recurrence calls) and the head
(the root; a head tied to the token embeddings is one unit with them). Every unit is sharded between
micro-batches, and its gradients are reduce-scattered after every micro-batch's backward, so that each process
holds 1/W of every weight, gradient and optimizer state; the recurrent body is gathered from its forward to the
end of its backward (the recurrence needs the whole core at every step), the other units for their own forward
and backward. Every process then issues the same collectives whatever depth it drew, and their number does not
grow with n + k.

`fsdp_units: layer` makes every decoder layer a unit instead (each core and coda layer too), gathered at each
use and resharded after it: no process holds more than two layers' weights whole, and the core is gathered once
per recurrence. FSDP2 reduce-scatters a unit used several times once, after its last use's backward, so the
core's gradients are whole through the recurrence's backward. Its gathers follow the depth, so the processes
must draw the same depths (`step_plan.draws_shared`, which every FSDP2 run does by default).

HSDP (`fsdp_shard_size`, by default a node's processes): the processes form a 2-D mesh, ("replicate", "shard").
Each group of `fsdp_shard_size` processes along "shard" holds one sharded copy of the model, as FSDP2 over them
alone would; the copies, one per group along "replicate", all-reduce their reduce-scattered gradients, so the
gathers stay within a node and only the gradients' shards cross nodes, once per step (`accumulating`).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..errors import RecurfitError


@dataclass
class Processes:
    """This process's place in the run. An entry point owns it, and the model and optimizers live in a function
    called inside its block, so that they are freed before the group is destroyed (`close`):

        with Processes.from_environment(timeout) as processes:
            result = run(config, processes)
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    grouped: bool = False  # in a process group: under torchrun, even with one process
    sharded: list = field(default_factory=list)  # FSDP2: (unit, reshard_after_forward) of every unit `wrap` made
    local_world: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)
    mesh: object = None  # FSDP2's DeviceMesh: HSDP's 2-D one, None for FSDP2's own over every process
    watch: ErrorWatch | None = None  # another process's error ends this one (grouped processes)

    @classmethod
    def from_environment(cls, timeout: float) -> Processes:
        """This process's place under torchrun (alone without it); collectives fail after `timeout` seconds (the
        config's `distributed_timeout`)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        grouped = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # torchrun sets it, also for one process
        if grouped and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                device_id=device if device.type == "cuda" else None,
                timeout=timedelta(seconds=timeout),
            )
        watch = ErrorWatch.start(world) if grouped else None
        return cls(rank, world, local_rank, device, grouped, local_world=local_world, watch=watch)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(
        self, model: nn.Module, strategy: str, bf16: bool = False, layers: bool = False, shard_size: int | None = None
    ) -> nn.Module:
        """DDP: a wrapper to call for forward/backward. FSDP2: `fully_shard` the model in place (see the module's
        docstring for its units; `layers`: every layer a unit) over groups of `shard_size` processes
        (`fsdp_shard_size`; HSDP across the groups); `bf16`: gathered and computed in bf16, gradients reduced in
        fp32."""
        if not self.grouped:
            return model
        if strategy == "fsdp":
            self.mesh = self.fsdp_mesh(shard_size)
            self.sharded += fsdp_units(model, mixed_precision=bf16, layers=layers, mesh=self.mesh)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def fsdp_mesh(self, shard_size: int | None):
        """FSDP2's mesh for groups of `shard_size` processes (None: this node's): None (FSDP2's own, one dimension
        over every process) when one group holds them all, else HSDP's ("replicate", "shard") mesh."""
        size = fsdp_shard_size(shard_size, self.world, self.local_world)
        if size == self.world:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world // size, size), mesh_dim_names=HSDP_MESH_DIMS)

    def accumulating(self, wrapped: nn.Module, last_micro_batch: bool):
        """DDP: gradients are all-reduced on the last micro-batch of a step only (its buckets hold whole
        gradients anyway). FSDP2 reduce-scatters every micro-batch's, so that no process holds whole gradients
        from one micro-batch into the next; under HSDP each group adds its reduced shards up over the step, and
        the groups all-reduce the sum on the last micro-batch only (the traffic across nodes, once per step)."""
        if self.sharded:
            if self.mesh is not None:
                wrapped.set_requires_all_reduce(last_micro_batch)
            return nullcontext()
        if last_micro_batch or not hasattr(wrapped, "no_sync"):
            return nullcontext()
        return wrapped.no_sync()

    def deal(self, count: int) -> list[int | None]:
        """This process's share of `count` items dealt in turn (item i to process i mod W). Under FSDP2 every
        forward gathers units, and the processes' gathers must pair up: a process with fewer items gets None in
        place of the missing ones, a forward to run and discard."""
        share: list[int | None] = list(range(self.rank, count, self.world))
        if self.sharded:
            share += [None] * (-(-count // self.world) - len(share))
        return share

    def reshard(self) -> None:
        """FSDP2: free every gathered unit (local; no collective), as after a forward without backward
        (validation) the recurrent body and the head stay gathered."""
        for unit, _ in self.sharded:
            unit.reshard()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.sum(value) / self.world

    def broadcast(self, value):
        """The main process's `value` (any picklable object), on every process."""
        if not self.grouped:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list:
        """Every process's `value` (any picklable object), in rank order, on every process."""
        if not self.grouped:
            return [value]
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def agree(self, decide, *args):
        """`decide(*args)` as the main process finds it, on every process; its RecurfitError is raised on every
        process. For checks of the file system that decide whether a process runs: each process asking its own
        (a node with a stale view of a shared folder) could answer otherwise."""
        if not self.grouped:
            return decide(*args)
        outcome = None
        if self.is_main:
            try:
                outcome = (None, decide(*args))
            except RecurfitError as error:
                outcome = (str(error), None)
        error, result = self.broadcast(outcome)
        if error is not None:
            raise RecurfitError(error)
        return result

    def barrier(self) -> None:
        if self.grouped:
            dist.barrier()

    def close(self) -> None:
        """Destroy the process group, last. Whoever owns the group (`with Processes.from_environment(…)`) has by
        now dropped the model and optimizers that hold it (DDP's reducer, FSDP2's parameters); this object drops
        its FSDP2 units, DTensor's caches (which keep FSDP2's mesh, and through it the group) are emptied, and
        `gc.collect()` frees what reference cycles held. The group's C++ object then ends here, joining its gloo
        worker threads while the interpreter runs. A group that outlives this call lives on into the
        interpreter's finalisation, where a gloo worker thread that drops the last reference to a finished
        collective's tensor must take the GIL, is stopped by `pthread_exit` inside C++ code, and aborts the
        process (`terminate called without an active exception`, SIGABRT): a failed exit after a finished run.
        tests/test_train_distributed.py checks that no gloo thread is left after `close`."""
        self.sharded.clear()  # the FSDP2 units, the model among them
        self.mesh = None
        if self.watch is not None:
            self.watch.close()
        if self.grouped and dist.is_initialized():
            _forget_dtensor_caches()
            gc.collect()
            dist.destroy_process_group()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """The group is destroyed after a block that ended normally. After an error it is left to the process's
        exit, which reports the error: another process may still be in a collective with this one, and
        destroying a group under a peer's collective can hang. The error is first told to the other processes
        (`ErrorWatch.fail`), which end: they may be waiting for this one in a collective."""
        if kind is None:
            self.close()
        elif self.watch is not None and isinstance(error, Exception):  # not Ctrl-C: every process gets its own
            self.watch.fail(self.rank, error)


# How often each process looks for another's error in the store: a failed process ends the others within this.
ERROR_WATCH_SECONDS = 1.0
# How long a failed process waits for the others to have read its error: the store may live in this process (the
# main one, launched without torchrun), and goes when it exits.
ERROR_READ_SECONDS = 5.0


class ErrorWatch:
    """The first error of any process, one line in the run's store, read by a thread in every other process,
    which prints it and ends its process (`os._exit`: its main thread may be blocked in a collective that only the
    failed process could complete). The thread has a store client of its own, so that it reads while the main
    thread waits in the store (a barrier, a group's creation)."""

    def __init__(self, store, world: int):
        self.store, self.world, self.stopped = store, world, threading.Event()
        # Keys of this attempt: torchrun's store outlives the workers it restarts (--max-restarts)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.error, self.read, self.told = (f"recurfit/{key}/{attempt}" for key in ("error", "error_read", "told"))
        self.thread = threading.Thread(target=self._watch, name="recurfit_error_watch", daemon=True)
        self.thread.start()
        # Stopped before the interpreter's finalisation even when no one closes the group: a daemon thread stopped
        # there inside the store's C++ code aborts the process
        atexit.register(self.close)

    @classmethod
    def start(cls, world: int) -> ErrorWatch | None:
        """A watch on the store at MASTER_ADDR:MASTER_PORT (torchrun's agent's, or the main process's when launched
        without torchrun); None for one process, or a group made otherwise."""
        if world < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
        )
        return cls(store, world)

    def _watch(self) -> None:
        while not self.stopped.wait(ERROR_WATCH_SECONDS):
            try:
                if not self.store.check([self.error]):
                    continue
                error = json.loads(self.store.get(self.error))
                self.store.add(self.read, 1)
            except Exception:  # the store is gone: the process that held it has ended (done, or failed and told)
                return
            try:  # until the failed process is done with the store, which may be this one's (ends with the process)
                self.store.wait([self.told], timedelta(seconds=ERROR_READ_SECONDS))
            except Exception:
                pass
            print(f"error: process {error['rank']} failed: {error['message']}", file=sys.stderr, flush=True)
            os._exit(2 if error["kind"] == RecurfitError.__name__ else 1)

    def fail(self, rank: int, error: Exception) -> None:
        """Tell the other processes of this process's `error` (unless another told its own first), and wait a few
        seconds for them to have read it."""
        self.close()  # this process's own watch would read its own error
        message = " ".join(str(error).split())  # one line
        if not isinstance(error, RecurfitError):
            message = f"{type(error).__name__}: {message}"
        try:
            told = json.dumps({"rank": rank, "kind": type(error).__name__, "message": message})
            if self.store.compare_set(self.error, "", told).decode() != told:
                self.store.add(self.read, 1)  # another process failed first: its error is the run's
                return
            deadline = time.monotonic() + ERROR_READ_SECONDS
            while self.store.add(self.read, 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            self.store.set(self.told, "")  # the others may end, the store's process among them
        except Exception:  # the store is gone: no one left to tell
            pass

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


def _forget_dtensor_caches() -> None:
    """Empty DTensor's caches (sharding propagation, redistribution plans, mesh topology: caches keyed on specs
    that hold FSDP2's device mesh), which would keep the process group alive after the model is gone. Each torch
    release has its own set: those it lacks are skipped, and the test of `Processes.close` fails on a release
    that adds one this misses."""
    import functools

    from torch.distributed.tensor import _redistribute, debug

    for clear in (
        getattr(debug, "_clear_sharding_prop_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ):
        if clear is not None:
            clear()
    for cache in gc.get_objects():
        # type(), not isinstance(): the heap holds weak proxies (torch.compile's) whose referent is gone, and
        # isinstance() of one raises ReferenceError
        if type(cache) is functools._lru_cache_wrapper and cache.__module__.startswith("torch.distributed"):
            cache.cache_clear()


# HSDP's mesh dimensions: copies of the model across the first (nodes), each sharded along the second (a node's
# processes). BatchedMuon (optim.py) deals its work along whichever dimension shards.
HSDP_MESH_DIMS = ("replicate", "shard")


def fsdp_shard_size(setting: int | None, world: int, local_world: int) -> int:
    """How many processes share one sharded copy of the model: `fsdp_shard_size` (None: the processes of a node,
    hence every process on one node); it must divide the processes."""
    size = setting or min(local_world, world)
    if size < 1 or world % size:
        raise RecurfitError(
            f"fsdp_shard_size={size} does not divide the run's {world} processes into groups of equal size; set "
            f"it to a divisor of {world} (the processes of a node: {local_world}), or drop it."
        )
    return size


def fill_from_main(model: nn.Module, built: nn.Module | None, processes: Processes) -> None:
    """Fill `model`, made on the meta device and sharded (FSDP2) or not yet placed (DDP), with the weights of the
    model the main process `built` (None elsewhere): each process receives its own shards of each tensor
    (`set_model_state_dict` with `broadcast_from_rank0`). Buffers, some of which no state dict holds (RoPE's
    frequencies), are sent whole. DDP's wrap sends them itself."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    model.to_empty(device=processes.device)
    if isinstance(model, FSDPModule):
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, built.state_dict() if built is not None else {}, options=options)
        for name, buffer in model.named_buffers():
            if built is not None:
                buffer.copy_(built.get_buffer(name))
            dist.broadcast(buffer, src=0)


def sharding_units(model: nn.Module, layers: bool = False) -> tuple[list[nn.Module], nn.Module | None]:
    """What FSDP2 shards as units of their own, besides the root (see the module's docstring), in forward order:
    the modules that run once per forward (the token embeddings, unless the head shares their weight, and each
    prelude layer; with `layers`, each core and coda layer too), and the recurrent body (`model.model`: what is
    left of it; None for a fixed-depth model, a baseline or a teacher, whose every decoder layer runs once)."""
    body = getattr(model, "model", None)
    if not hasattr(body, "core"):
        return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")], None
    embedding = model.get_input_embeddings()
    tied = embedding.weight is model.get_output_embeddings().weight
    units = ([] if tied else [embedding]) + list(body.prelude)
    if layers:  # the adapter stays in the body: its methods other than forward read its weight
        units += list(body.core) + list(body.coda)
    return units, body


def fsdp_units(
    model: nn.Module, mixed_precision: bool, trained: bool = True, layers: bool = False, mesh=None
) -> list[tuple[nn.Module, bool]]:
    """`fully_shard` the `sharding_units`, root last, over `mesh` (None: FSDP2's, every process); returns each with
    its reshard_after_forward. A `trained` model keeps its recurrent body and its root (the head) gathered from
    their forward to their backward; a distillation teacher has no backward: every unit, the root too, is
    resharded after its forward.

    `mixed_precision` (training runs it under bf16 autocast): weights are gathered in bf16, gradients reduced in
    fp32, and the numbers computed are DDP + autocast's: the residual stream, s₀, the adapter's input and RoPE's
    tables stay fp32 as they are when autocast computes with fp32 weights, because the token embeddings are upcast
    and no unit casts its inputs. What differs from DDP is the bf16 rounding of the weights autocast would leave in
    fp32 (embeddings, norms): tests/test_train_distributed.py bounds its effect on the loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    embedding = model.get_input_embeddings()
    if mixed_precision:
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False)
        embedding.register_forward_hook(_float32_output)
    once, body = sharding_units(model, layers)
    head, shared = model.get_output_embeddings(), []
    if body is not None and head.weight is embedding.weight:
        # One matrix for the token embeddings and the head: one unit of the two modules (torchtitan's grouping),
        # sharded before the body that holds the embeddings, and kept gathered from the forward's start (the
        # embeddings) to its backward, as the root keeps an untied head.
        fully_shard([embedding, head], mesh=mesh, mp_policy=policy, reshard_after_forward=not trained)
        shared = [(embedding, not trained)]
    units = [(layer, True) for layer in once]
    if body is not None:
        units.append((body, not trained))  # gathered once per forward, kept for its backward
    for module, reshard in units:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    if once and once[0] is embedding:
        embedding.set_unshard_in_backward(False)  # its backward reads the token ids, not the weight
    # The root (the head): FSDP2's default keeps it gathered from forward to backward
    fully_shard(model, mesh=mesh, mp_policy=policy, **({} if trained else {"reshard_after_forward": True}))
    return [*shared, *units, (model, not trained)]


def _float32_output(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """The token embeddings of bf16-gathered weights, in the fp32 of an embedding autocast leaves alone."""
    return output.float()
