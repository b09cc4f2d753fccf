"""Tensor parallelism for the engine over torch.distributed: NCCL on CUDA, gloo on CPU.

Layout of the work (Megatron-style, one all-reduce after each row-parallel layer):
- attention: q/k/v rows split by heads (GQA: each rank keeps whole groups, so kv_heads % tp == 0,
  or, with more ranks than KV heads, each rank a copy of the one KV head its queries read),
  o_proj columns split the same way, then all-reduced; q_norm / k_norm act per head: replicated;
- Gated DeltaNet: key and value heads split together (the q, k and v parts of in_proj_qkv and of
  the depthwise conv's channels, z / a / b rows, A_log and dt_bias), out_proj row-parallel;
  its gated norm acts per head: replicated;
- MLP: gate/up column-parallel, down row-parallel;
- embeddings replicated; lm_head whole on rank 0 only (the default) or vocab-sharded and
  gathered to rank 0 (`lm_head="sharded"`). Why whole: the drafter borrows the target's lm_head,
  so rank 0 holds all of it anyway, and sharding gained nothing consistent when measured on the
  CPU (engine/NOTES.md). On GPUs at TP 8 the whole head is a large part of what rank 0 reads per
  verify (1.3 of 27 B parameters for Qwen3.6-27B): measure there with
  `python -m engine.tools.parallel_measure --device cuda`.

Control: rank 0, the leader, runs engine/decode.py's round loop unchanged over a
`TensorParallelTarget`. Every new_cache / forward / commit on it is first broadcast as a
`Command` carrying the decisions already made on rank 0 (the bonus and drafted tree tokens,
the tree's parents, the accepted path), then run by every rank on its shard; followers run
`follow`. So sampling, the drafter, tree building and the walk happen once, on rank 0, and
every rank commits the same path (what a command costs to broadcast is in engine/NOTES.md).
The drafter lives on rank 0 only: run on every rank at once it was slower on the CPU (the ranks
share it), and on GPUs it would cost its memory on each one and still need the broadcast for
identical state.

    target = launch_target(model_dir, torch.float32, "cpu", tp=2)  # spawns rank 1
    generate(target, drafter, prompt_ids, cfg)
    target.close()

Under torchrun (RANK / WORLD_SIZE set) nothing is spawned: `launch_target` returns None on the
followers once the leader has closed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from engine.models.common import SwiGLU
from engine.models.qwen3_5 import GatedAttention

log = logging.getLogger(__name__)
LM_HEAD_MODES = ("replicated", "sharded")
COMMAND_OPS = ("new_cache", "forward", "extend", "commit", "stop")
LEADER = 0
SPLIT_FIELDS = (  # config fields that count what the ranks share out
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
STARTUP_TIMEOUT = timedelta(minutes=30)  # rank 0 waits this long for every rank to load


# --- process group -------------------------------------------------------------------------


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """Rank r's device: cuda:r (of the visible GPUs) on CUDA, the CPU otherwise."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def init_group(rank: int, world: int, device: str, init_method: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method, world_size=world, rank=rank, timeout=STARTUP_TIMEOUT
    )


# --- sharding by heads and columns ----------------------------------------------------------


def owned(count: int, rank: int, world: int, what: str) -> range:
    """The contiguous block of `count` heads (or rows) rank `rank` keeps."""
    if count % world:
        raise ValueError(f"{what}: {count} is not divisible by --tp {world}")
    size = count // world
    return range(rank * size, (rank + 1) * size)


def head_rows(heads: range, width: int, offset: int = 0) -> torch.Tensor:
    """Row indices [len(heads) * width] of `heads`, each `width` rows, after `offset` rows."""
    starts = offset + torch.tensor(list(heads)) * width  # [h]
    return (starts[:, None] + torch.arange(width)).flatten()


def part_of(tensor: torch.Tensor, dim: int, indices: torch.Tensor) -> nn.Parameter:
    """A frozen parameter holding rows (dim 0) or columns (dim 1) `indices` of `tensor`.

    It remembers which (`selection`): a shard cut from a model built on meta reads only
    those from the checkpoint (`load_shard`).
    """
    part = nn.Parameter(tensor.data.index_select(dim, indices.to(tensor.device)), False)
    part.selection = (dim, indices)
    return part


def rows_of(tensor: torch.Tensor, rows: torch.Tensor) -> nn.Parameter:
    """A frozen parameter holding rows `rows` (dim 0) of `tensor`."""
    return part_of(tensor, 0, rows)


def keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Column-parallel: this rank computes only output features `rows`."""
    linear.weight = rows_of(linear.weight, rows)
    linear.out_features = len(rows)


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of input features; partial sums all-reduced over ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out


def row_parallel(linear: nn.Linear, columns: torch.Tensor) -> RowParallelLinear:
    """The rank's RowParallelLinear holding input features `columns` of `linear` (no bias)."""
    weight = part_of(linear.weight, 1, columns)
    sharded = RowParallelLinear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    sharded.weight = weight
    return sharded


def shard_mlp(mlp: SwiGLU, rank: int, world: int) -> None:
    columns = torch.tensor(owned(mlp.gate_proj.out_features, rank, world, "intermediate_size"))
    keep_rows(mlp.gate_proj, columns)
    keep_rows(mlp.up_proj, columns)
    mlp.down_proj = row_parallel(mlp.down_proj, columns)


def owned_kv_heads(kv_heads: int, rank: int, world: int) -> range:
    """The KV heads rank `rank` keeps: its share, or, when there are fewer KV heads than ranks,
    a copy of the one head its query heads read (Qwen3.6-27B's 4 KV heads over TP8: each
    head on two ranks)."""
    if world > kv_heads and world % kv_heads == 0:
        head = rank * kv_heads // world  # ranks split the query heads in order: group by group
        return range(head, head + 1)
    return owned(kv_heads, rank, world, "num_key_value_heads")


def shard_attention(attn: nn.Module, rank: int, world: int, q_width: int) -> None:
    """Dense or gated attention: q rows of `q_width` per head (2 * head_dim with a gate)."""
    heads = owned(attn.heads, rank, world, "num_attention_heads")
    kv_heads = owned_kv_heads(attn.kv_heads, rank, world)
    keep_rows(attn.q_proj, head_rows(heads, q_width))
    kv_rows = head_rows(kv_heads, attn.head_dim)
    keep_rows(attn.k_proj, kv_rows)
    keep_rows(attn.v_proj, kv_rows)
    attn.o_proj = row_parallel(attn.o_proj, head_rows(heads, attn.head_dim))
    attn.heads, attn.kv_heads = len(heads), len(kv_heads)


def shard_gated_deltanet(gdn: nn.Module, rank: int, world: int) -> None:
    """Key heads and the value heads they serve stay together on one rank."""
    s = gdn.shape
    key_heads = owned(s.key_heads, rank, world, "linear_num_key_heads")
    value_heads = owned(s.value_heads, rank, world, "linear_num_value_heads")
    qk = s.key_heads * s.key_dim
    channels = torch.cat(  # of the conv input [q | k | v]
        [
            head_rows(key_heads, s.key_dim),
            head_rows(key_heads, s.key_dim, offset=qk),
            head_rows(value_heads, s.value_dim, offset=2 * qk),
        ]
    )
    keep_rows(gdn.in_proj_qkv, channels)
    gdn.conv1d.weight = rows_of(gdn.conv1d.weight, channels)  # [C', 1, K] depthwise
    keep_rows(gdn.in_proj_z, head_rows(value_heads, s.value_dim))
    per_head = torch.tensor(value_heads)
    keep_rows(gdn.in_proj_a, per_head)
    keep_rows(gdn.in_proj_b, per_head)
    gdn.A_log, gdn.dt_bias = rows_of(gdn.A_log, per_head), rows_of(gdn.dt_bias, per_head)
    gdn.out_proj = row_parallel(gdn.out_proj, head_rows(value_heads, s.value_dim))
    gdn.shape = replace(s, key_heads=len(key_heads), value_heads=len(value_heads))


class VocabParallelHead(nn.Module):
    """This rank's rows of the lm_head; rank 0 gathers the full logits, the others get none."""

    def __init__(self, head: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.vocab = head.out_features
        size = -(-self.vocab // world)  # ceil: every rank the same size, the last one padded
        rows = torch.arange(rank * size, (rank + 1) * size)
        self.weight = rows_of(head.weight, rows.clamp(max=self.vocab - 1))  # [V/tp, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V] on rank 0
        local = F.linear(x, self.weight)  # [T, V/tp]
        if dist.get_rank() != LEADER:
            dist.gather(local, None, dst=LEADER)
            return local[:, :0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.gather(local, parts, dst=LEADER)
        return torch.cat(parts, dim=-1)[:, : self.vocab]


class NoHead(nn.Module):
    """Followers with a replicated head: rank 0 alone turns hidden states into logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :0]


def shard_model(model: nn.Module, rank: int, world: int, lm_head: str = "replicated") -> nn.Module:
    """Cut a loaded dense or hybrid target down to rank `rank`'s shard, in place.

    The model's config is replaced by the shard's (local head and column counts), so
    `new_cache` allocates only this rank's K/V heads.
    """
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, not {lm_head!r}")
    cfg = model.config
    for layer in model.layers:
        shard_mlp(layer.mlp, rank, world)
        if hasattr(layer, "linear_attn"):
            shard_gated_deltanet(layer.linear_attn, rank, world)
        else:
            attn = layer.self_attn
            gated = isinstance(attn, GatedAttention)  # q_proj holds [query | gate] per head
            shard_attention(attn, rank, world, (2 if gated else 1) * attn.head_dim)
    if lm_head == "sharded":
        model.lm_head = VocabParallelHead(model.lm_head, rank, world)
    elif rank != LEADER:
        model.lm_head = NoHead()
    split = {name: getattr(cfg, name) // world for name in SPLIT_FIELDS if hasattr(cfg, name)}
    split["num_key_value_heads"] = len(owned_kv_heads(cfg.num_key_value_heads, rank, world))
    model.config = replace(cfg, **split)
    return model


# --- leader and followers --------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One step every rank runs on its shard, carrying the decisions rank 0 made for it."""

    op: str  # one of COMMAND_OPS
    max_len: int = 0  # new_cache
    ids: list[int] | None = None  # forward: [bonus, drafted tree tokens...]; extend: a chunk
    parents: list[int] | None = None  # forward: the tree's parents; None = a chain
    accepted: list[int] | None = None  # commit: the accepted root-to-node path
    score: bool = False  # extend: every position's logits too (a sharded head gathers them)


def broadcast_command(command: Command | None) -> Command:
    """Rank 0 sends `command`; every other rank passes None and gets it."""
    box = [command]
    dist.broadcast_object_list(box, src=LEADER)
    return box[0]


def follow(shard: nn.Module) -> None:
    """A follower's life: run rank 0's commands on this rank's shard until "stop"."""
    cache = None
    while (command := _next_command()) is not None and command.op != "stop":
        if command.op not in COMMAND_OPS:
            raise ValueError(f"unknown tensor-parallel command {command.op!r}")
        if command.op == "new_cache":
            cache = None  # one live sequence: free the previous one before allocating
        try:
            cache = run_command(shard, command, cache)
        except ValueError as error:
            # The shapes and paths a step checks (cache room, root-to-node path) are the same on
            # every rank, and checked before any collective: rank 0 refused this step too.
            log.debug("step refused on every rank: %s", error)


def _next_command() -> Command | None:
    """Rank 0's next command, or None once rank 0 is gone (killed: its connection closed)."""
    try:
        return broadcast_command(None)
    except RuntimeError as error:
        log.info("rank 0 is gone, this rank stops: %s", error)
        return None


def run_command(shard: nn.Module, command: Command, cache):
    """Run one command on this rank's shard; returns the (new) live cache."""
    device = shard.embed_tokens.weight.device
    if command.op == "new_cache":
        return shard.new_cache(command.max_len)
    if command.op == "forward":
        ids = torch.tensor(command.ids, dtype=torch.long, device=device)
        parents = None if command.parents is None else torch.tensor(command.parents)
        shard.forward(ids, cache, parents)
    elif command.op == "extend":
        ids = torch.tensor(command.ids, dtype=torch.long, device=device)
        shard.extend(ids, cache, score=_discard if command.score else None)
    elif command.op == "commit":
        shard.commit(cache, torch.tensor(command.accepted, dtype=torch.long, device=device))
    return cache


def _discard(first: int, logits) -> None:
    """A follower's `score`: the leader alone keeps the logits."""


class TensorParallelTarget:
    """Rank 0's sharded target with the engine's target interface (see engine/decode.py).

    Serves one sequence at a time: a new cache replaces the previous one on every rank.
    `lm_head` is the whole head (the drafter borrows it); `config` is the whole model's.
    """

    def __init__(
        self,
        shard: nn.Module,
        config,
        lm_head: nn.Module,
        followers: Sequence[mp.Process] = (),
        rendezvous: tempfile.TemporaryDirectory | None = None,
    ) -> None:
        self.shard, self.config, self.lm_head = shard, config, lm_head
        self.embed_tokens = shard.embed_tokens
        self._followers = list(followers)
        self._rendezvous = rendezvous  # the spawned ranks' file store, removed on close
        self._cache = None

    def new_cache(self, max_len: int):
        broadcast_command(Command("new_cache", max_len=max_len))
        self._cache = None
        self._cache = self.shard.new_cache(max_len)
        return self._cache

    def forward(
        self,
        ids: torch.Tensor,  # [T]
        cache,
        parents: torch.Tensor | None = None,  # [T]
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [T, V], hidden [T, n*H]
        self._check_live(cache)
        tree = None if parents is None else parents.tolist()
        broadcast_command(Command("forward", ids=ids.tolist(), parents=tree))
        return self.shard.forward(ids, cache, parents, hidden_layers)

    def extend(
        self, ids: torch.Tensor, cache, hidden_layers: Sequence[int] = (), score=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [1, V], hidden [T, n*H]
        self._check_live(cache)
        broadcast_command(Command("extend", ids=ids.tolist(), score=score is not None))
        return self.shard.extend(ids, cache, hidden_layers, score)

    def commit(self, cache, accepted: torch.Tensor) -> None:
        self._check_live(cache)
        broadcast_command(Command("commit", accepted=accepted.tolist()))
        self.shard.commit(cache, accepted)

    def close(self) -> None:
        """Stop the followers and leave the process group."""
        broadcast_command(Command("stop"))
        for process in self._followers:
            process.join()
        dist.destroy_process_group()
        if self._rendezvous is not None:
            self._rendezvous.cleanup()

    def _check_live(self, cache) -> None:
        if cache is not self._cache:
            raise ValueError("a tensor-parallel target decodes one sequence: its latest cache")


# --- launching -------------------------------------------------------------------------------


def load_shard(
    model_dir: str | Path, dtype: torch.dtype, device: str, rank: int, world: int, lm_head: str
) -> tuple[nn.Module, nn.Module | None, object]:
    """This rank's shard on `device`, the whole lm_head (rank 0's, for the drafter; None on the
    other ranks) and the whole model's config.

    The model is built and cut on the meta device, then materialised on `device`; each rank
    reads from the checkpoint only its own rows and columns of each tensor.
    """
    from engine.models import target_checkpoint
    from engine.models.common import finish_loading

    model, rename = target_checkpoint(model_dir)
    whole_config = model.config
    shard_model(model, rank, world, lm_head)
    selections = {n: p.selection for n, p in model.named_parameters() if hasattr(p, "selection")}
    shard = finish_loading(
        model, model_dir, _shard_rename(rename, model), dtype, device, selections.get
    )
    if rank != LEADER:
        return shard, None, whole_config
    whole_head = shard.lm_head if lm_head == "replicated" else _whole_head(model_dir, dtype, device)
    return shard, whole_head, whole_config


def _shard_rename(rename, shard: nn.Module):
    """`rename` for a shard: a follower without a head reads no lm_head; a vocab-sharded head
    of a tied model reads its rows from the embeddings."""
    params = dict(shard.named_parameters())
    tied_head = shard.config.tie_word_embeddings and "lm_head.weight" in params

    def renamed(tensor_name: str):
        name = rename(tensor_name)
        if name == "embed_tokens.weight" and tied_head:
            return (name, "lm_head.weight")
        return name if name in params else None

    return renamed


def _whole_head(model_dir: str | Path, dtype: torch.dtype, device: str) -> nn.Linear:
    """The whole lm_head on its own: an untied model's head tensor, else the embeddings."""
    from engine.models import target_checkpoint
    from engine.models.common import finish_loading

    model, rename = target_checkpoint(model_dir)
    source = "embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    vocab, hidden = model.embed_tokens.weight.shape
    head = nn.Linear(hidden, vocab, bias=False, device="meta")
    return finish_loading(
        head, model_dir, lambda name: "weight" if rename(name) == source else None, dtype, device
    )


def launch_target(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str,
    tp: int,
    lm_head: str = "replicated",
) -> TensorParallelTarget | None:
    """Load the target over `tp` ranks and return rank 0's view of it.

    Under torchrun (WORLD_SIZE set) this process is one rank: followers serve rank 0 until it
    closes, then get None. Otherwise rank 0 is this process and spawns ranks 1..tp-1.
    """
    if "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ValueError(f"--tp {tp} but torchrun started {world} ranks")
        local = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        init_group(rank, world, local, "env://")
        if rank != LEADER:
            _serve_as_follower(model_dir, dtype, local, rank, world, lm_head)
            return None
        followers, rendezvous = [], None
    else:
        rendezvous = tempfile.TemporaryDirectory(prefix="ddops-tp-")
        init_method = "file://" + os.path.join(rendezvous.name, "store")
        followers = _spawn_followers(model_dir, dtype, device, tp, lm_head, init_method)
        local = rank_device(device, LEADER)
        init_group(LEADER, tp, local, init_method)
    try:
        shard, whole_head, whole_config = load_on_every_rank(
            model_dir, dtype, local, LEADER, tp, lm_head
        )
    except BaseException:  # leave the group so a retry can join one
        dist.destroy_process_group()
        raise
    return TensorParallelTarget(shard, whole_config, whole_head, followers, rendezvous)


def load_on_every_rank(model_dir, dtype, device: str, rank: int, world: int, lm_head: str):
    """`load_shard` on this rank, then every rank hears whether every other one loaded: a
    failure anywhere (a missing file, out of memory on one GPU) ends all of them, each with the
    failing ranks' messages, instead of leaving the others waiting on a dead rank."""
    try:
        loaded, failure = load_shard(model_dir, dtype, device, rank, world, lm_head), None
    except Exception as error:
        loaded, failure = None, f"rank {rank}: {type(error).__name__}: {error}"
    agree_loaded(failure)
    return loaded


def agree_loaded(failure: str | None) -> None:
    """Gather every rank's load failure (None: loaded); raise RuntimeError naming any."""
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, failure)
    if failed := [report for report in reports if report]:
        raise RuntimeError("tensor-parallel load failed: " + "; ".join(failed))


def _spawn_followers(
    model_dir, dtype: torch.dtype, device: str, tp: int, lm_head: str, init_method: str
) -> list[mp.Process]:
    """Start ranks 1..tp-1 (fresh interpreters), with as many torch threads as this one."""
    context = mp.get_context("spawn")
    followers = []
    for rank in range(1, tp):
        args = (str(model_dir), dtype, device, rank, tp, lm_head, init_method)
        process = context.Process(
            target=_spawned_follower, args=(*args, torch.get_num_threads()), daemon=True
        )
        process.start()
        followers.append(process)
    return followers


def _spawned_follower(model_dir, dtype, device, rank, world, lm_head, init_method, threads):
    _exit_with_parent()
    torch.set_num_threads(threads)
    local = rank_device(device, rank)
    init_group(rank, world, local, init_method)
    _serve_as_follower(model_dir, dtype, local, rank, world, lm_head)


def _exit_with_parent() -> None:
    """End this spawned rank when rank 0's process ends, even mid-collective (NCCL waits on)."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve_as_follower(model_dir, dtype, device: str, rank: int, world: int, lm_head: str):
    try:
        shard, _, _ = load_on_every_rank(model_dir, dtype, device, rank, world, lm_head)
    except BaseException:
        dist.destroy_process_group()
        raise
    try:
        with torch.inference_mode():
            follow(shard)
    finally:
        dist.destroy_process_group()


def open_target(
    model_dir: str | Path, dtype: torch.dtype, device: str, tp: int = 1
) -> nn.Module | TensorParallelTarget | None:
    """The target for the command line: whole (tp 1) or over `tp` ranks (see launch_target)."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, not {tp}")
    if tp == 1:
        from engine.models import load_target

        return load_target(model_dir, dtype, device)
    return launch_target(model_dir, dtype, device, tp)


def close_target(target) -> None:
    """Stop a tensor-parallel target's followers; a whole target needs nothing."""
    if isinstance(target, TensorParallelTarget):
        target.close()
