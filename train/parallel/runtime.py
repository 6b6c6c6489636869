"""The process group and device mesh of a run launched on several processes (torchrun, accelerate launch).

`start_distributed` reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), checks the
`parallel` section against the world size, opens the process group (gloo for CPU tensors, NCCL for CUDA tensors)
and builds the DeviceMesh; `Distributed` carries them with the few collectives the trainer needs, each wrapped so
that a lost or stalled peer ends every rank with one clear error instead of a backend traceback. docs/parallel.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from k3.model.config import ConfigError

from ..config import ParallelConfig
from ..loop import TrainingError

T = TypeVar("T")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class PeerError(TrainingError):
    """A collective failed: another rank died, raised an error of its own or stalled past parallel.timeout_s."""


def launched_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from a launcher's environment, or None when none set WORLD_SIZE."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ConfigError(f"the launcher's RANK / WORLD_SIZE / LOCAL_RANK are not integers ({e})") from None
    return rank, world, local


@dataclass
class Distributed:
    """One process's place in a multi-process run: rank, world size, its device, the data-parallel mesh.

    Example: d = start_distributed(cfg.parallel, "auto", "k3 pretrain"); d.all_reduce(torch.tensor([1.0]), "sum")
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # torch.distributed.device_mesh.DeviceMesh: 1-D ("dp",) or ("ep",) (experts sharded over all ranks) of
    # world_size ranks, or 2-D ("dp", "ep") of dp x ep ranks (experts dispatched within each EP group)
    mesh: Any
    timeout_s: float
    patient_group: Any = None  # gloo group with a 24 h timeout: ranks waiting while rank 0 tokenizes a corpus

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes the run directory's own files."""
        return self.rank == 0

    def collective(self, what: str, fn: Callable[[], T]) -> T:
        """fn() (one or more collectives); a failure becomes PeerError with the message every rank prints."""
        try:
            return fn()
        except (dist.DistError, RuntimeError) as e:  # gloo reports a closed peer as a RuntimeError
            raise PeerError(lost_peer_message(self.rank, self.world_size, what, e, self.timeout_s)) from e

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """x summed ("sum"), averaged ("mean") or maxed ("max") elementwise over the ranks; a new tensor, on x's
        device (CPU tensors go through gloo, CUDA ones through NCCL)."""
        y = x.clone()
        self.collective(f"all_reduce({op})", lambda: dist.all_reduce(y, op=_OPS["sum" if op == "mean" else op]))
        return y / self.world_size if op == "mean" else y

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] of every rank (equal shapes) -> [world x N, ...], rank 0's rows first."""
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name from 2.12
        self.collective("all_gather", lambda: gather(out, x.contiguous()))
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """all_to_all_single of flat buffers: rank r's inp[in_splits...] piece s goes to rank s's out piece r."""
        self.collective("all_to_all", lambda: dist.all_to_all_single(out, inp, out_splits, in_splits))

    def broadcast(self, obj: T, patient: bool = False) -> T:
        """Rank 0's `obj` (picklable) on every rank; patient: wait up to 24 h, not parallel.timeout_s."""
        box, group = [obj], self.patient_group if patient else None
        self.collective("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=group))
        return box[0]

    def barrier(self) -> None:
        # a CPU tensor all-reduce: gloo's own barrier, and safe with NCCL before any CUDA work
        self.collective("barrier", lambda: dist.all_reduce(torch.zeros(1), group=None))

    def main_first(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0, then on the others (a cache rank 0 filled: data preparation); rank 0's error, if any,
        is raised there and the other ranks stop with a message that points to it instead of waiting."""
        if self.is_main:
            try:
                out = fn()
            except BaseException as e:
                self.broadcast(f"{type(e).__name__}: {e}", patient=True)
                raise
            self.broadcast(None, patient=True)
            return out
        failed = self.broadcast(None, patient=True)
        if failed is not None:
            raise PeerError(f"rank {self.rank}: rank 0 failed before this rank could start ({failed})")
        return fn()


def is_collective_failure(e: BaseException) -> bool:
    """True for an error raised by a torch.distributed collective (NCCL raises DistError; gloo raises a RuntimeError
    from `work.wait()` such as "Connection reset by peer"): the innermost frame is torch.distributed's."""
    if isinstance(e, dist.DistError):
        return True
    if not isinstance(e, RuntimeError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename


def lost_peer_message(rank: int, world: int, what: str, e: BaseException, timeout_s: float) -> str:
    """The one message every surviving rank prints when a collective fails."""
    return (f"rank {rank} of {world}: {what} failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}): "
            f"another rank stopped (its own output names why), was killed, or did not answer within "
            f"parallel.timeout_s={timeout_s:g}; the last complete checkpoint under RUN_DIR/checkpoints is intact: "
            f"relaunch with --resume")


def start_distributed(pcfg: ParallelConfig | None, device_name: str, command: str, *,
                      num_experts: int | None = None, seq_len: int | None = None) -> Distributed | None:
    """The run's Distributed when launched on several processes, None on one (parallel sizes all 1).

    pcfg: the command's `parallel` section, None for a command that runs on one process only. Raises ConfigError
    (before anything is written) when the sizes do not multiply to the world size or do not divide it or the
    experts, when a layout that is not built yet is asked for (cp > 1; redundant experts), or when a one-process
    command is launched on several.
    """
    world = launched_world()
    rank, size, local = world if world is not None else (0, 1, 0)
    if pcfg is None:
        if size > 1:
            raise ConfigError(f"`{command}` runs on one process; it was launched on {size} (WORLD_SIZE={size}). "
                              f"Multi-process training is built for `k3 pretrain --set parallel.dp=N`; run this "
                              f"command without torchrun")
        return None
    ep = pcfg.ep if isinstance(pcfg.ep, int) and not isinstance(pcfg.ep, bool) and pcfg.ep >= 1 else None
    if ep is not None and size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the world size {size}: the ranks form parallel.dp groups "
                          f"of parallel.ep ranks each; launch a multiple of {ep} processes or pick an ep that "
                          f"divides {size}")
    try:
        pcfg.validate(world_size=size, num_experts=num_experts, seq_len=seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if pcfg.cp > 1:
        raise ConfigError(f"parallel.cp={pcfg.cp}: context parallelism (KDA state passing, MLA ring) is not built "
                          f"yet; set parallel.cp=1 (with parallel.dp x parallel.ep = {size})")
    if pcfg.ep > 1 and pcfg.dp > 1 and num_experts is not None and num_experts % size:
        raise ConfigError(f"parallel.dp={pcfg.dp} x parallel.ep={pcfg.ep}: the expert weights are stored sharded over "
                          f"all {size} ranks, so model.num_experts ({num_experts}) must be divisible by {size}; pick "
                          f"dp and ep whose product divides it (or parallel.dp=1, parallel.ep={size})")
    if pcfg.ep > 1 and pcfg.redundant_experts:
        raise ConfigError(f"parallel.redundant_experts={pcfg.redundant_experts}: the dynamic placement of redundant "
                          f"experts is planned (k3.train.parallel.planner) but not wired into the EP dispatch yet; "
                          f"set parallel.redundant_experts=0")
    if size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={device_name} but CUDA is not available; use train.device=cpu or auto")
        if local >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local} but this machine shows {torch.cuda.device_count()} GPU(s); "
                              f"launch at most that many processes per node")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    elif device_name not in ("auto", "cpu"):
        raise ConfigError(f"train.device={device_name}: use auto, cpu or cuda under a multi-process launch (each "
                          f"rank takes the GPU of its LOCAL_RANK)")
    else:
        device = torch.device("cpu")
    # gloo carries the CPU tensors (metrics, the data-preparation handshake) on GPUs too
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = timedelta(seconds=pcfg.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                                device_id=device if cuda else None)
    # every rank is a data-parallel rank (its own batch rows, the non-expert parameters FSDP2-sharded over all
    # ranks); under EP a 1-D mesh named "ep" when the experts are dispatched over all ranks, else the 2-D
    # ("dp", "ep") mesh, row-major: each EP group is parallel.ep consecutive ranks (one node's, on GPUs)
    if pcfg.ep > 1 and pcfg.dp > 1:
        mesh = init_device_mesh(device.type, (pcfg.dp, pcfg.ep), mesh_dim_names=("dp", "ep"))
    else:
        mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("ep" if pcfg.ep > 1 else "dp",))
    patient = dist.new_group(backend="gloo", timeout=timedelta(hours=24))
    return Distributed(rank, size, local, device, mesh, pcfg.timeout_s, patient)


def stop_distributed(d: Distributed | None, finished: bool = True) -> None:
    """Close the process group opened by start_distributed (no-op for None). finished: every rank got here
    normally, so a barrier first lets each finish its last exchange before any tears its gloo pairs down (a rank
    destroying the group while its peer still sent aborted with "terminate called without an active exception",
    now and then on a loaded machine); after a failure no barrier, which a lost peer would hold for the timeout."""
    if d is not None and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
