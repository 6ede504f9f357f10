"""Apply the layout to the model, in one fixed order (torchtitan's): split into pipeline chunks
first, then per chunk tensor parallelism -> activation checkpointing -> torch.compile of each
block -> data parallelism (FSDP2 / DDP), and finally the pipeline stages and their schedule.

TP must see whole modules before FSDP shards them; activation checkpointing wraps the blocks
before FSDP so that FSDP's per-block units contain the checkpointed region; the pipeline stage
wraps the finished chunk so its schedule can drive FSDP/DDP's gradient synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from fleetwise.compat import BATCH_NORMS
from fleetwise.config.engine import Engine, dp_engine, reshard_after_forward
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.families import ModelSpec, family_of
from fleetwise.models.moe import GroupedExperts, MoE
from fleetwise.models.pipeline import pipeline_chunk
from fleetwise.plan.pipeline import chunk_ranks, split_layers
from fleetwise.runtime.context_parallel import SeqShard, apply_context_parallel
from fleetwise.runtime.expert_parallel import (
    ExpertGrads,
    expert_mesh,
    expert_placement,
    fully_shard_experts,
    keep_from_ddp,
    shard_experts,
)
from fleetwise.runtime.mesh import process_group
from fleetwise.runtime.modeling import build_meta_model, materialize, model_spec
from fleetwise.runtime.recompute import apply_recompute

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelModel:
    parts: list[nn.Module]  # this rank's model chunks (one without pipelining)
    chunk_ids: list[int]  # pipeline chunk index of each part
    num_chunks: int
    engine: Engine
    spec: ModelSpec
    schedule: object | None = None  # torch.distributed.pipelining schedule when pp > 1
    stages: list = field(default_factory=list)
    scaler: object | None = None  # fp16's GradScaler: the pipeline scales the loss it back-propagates
    expert_grads: object | None = None  # expert parallelism: runtime/expert_parallel.py ExpertGrads
    sequence: SeqShard | None = None  # context parallelism: this rank's chunks of every sequence
    expert_mesh: DeviceMesh | None = None  # expert parallelism: [edp, ep] (runtime/expert_parallel.py)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss, in fp32 on every engine: FSDP's mixed precision runs without
        autocast (which would upcast the cross entropy), so its 16-bit logits are upcast here.

        The 16-bit logits die at the upcast (rebinding `out` drops this frame's reference; the
        upcast's backward needs only their dtype), so they are not alive beside the fp32 copy and
        the log-softmax output: half a logit-sized fp32 tensor off the loss's forward (ERNIE large
        mp2 bf16: 125 MB). That needs the caller to hold no reference either: the trainer passes
        the model's output straight in (a pipeline stage keeps its output anyway, for backward)."""
        out = out.float()
        return self.spec.loss(out, target)

    def pipeline_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: it runs the backward itself, so fp16's loss scaling must
        happen here -- otherwise unscale_ divides unscaled gradients by the scale (2^16)."""
        loss = self.loss(out, target)
        return self.scaler.scale(loss) if self.scaler is not None else loss

    @property
    def has_first(self) -> bool:
        return 0 in self.chunk_ids

    @property
    def has_last(self) -> bool:
        return self.num_chunks - 1 in self.chunk_ids

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


def parallelize(
    cfg: RunConfig,
    mesh: DeviceMesh,
    device: torch.device,
    allocate: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """allocate(part): turns a meta-built part into real tensors -- by default `materialize` (this
    rank's shards on `device`, with the layout-invariant initial values); the dry run passes one
    that allocates fake tensors (fleetwise.dryrun.fake)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    layout = Layout.of(cfg)
    spec = model_spec(cfg)
    engine = dp_engine(layout, s.sharding_stage)
    if allocate is None:
        # FSDP's CPU offload keeps the sharded parameters on the host (it refuses them anywhere
        # else at its first forward); buffers still belong on the device
        host = engine == Engine.FSDP and s.offload
        allocate = lambda part: materialize(  # noqa: E731
            part, device, cfg.train.seed, params_on_host=host, load_weights=spec.load_weights
        )
    # On `meta`: the structure of the whole model, no memory. Every rank keeps only its pipeline
    # chunks and allocates only its shards, after TP/FSDP have decided what they are.
    model = build_meta_model(cfg)
    # 1. pipeline: keep only this rank's chunks
    if layout.pp > 1:
        v = s.virtual_stages
        num_chunks = layout.pp * v
        owners = chunk_ranks(s.schedule, layout.pp, v)
        pp_rank = mesh["pp"].get_local_rank()
        chunk_ids = [c for c in range(num_chunks) if owners[c] == pp_rank]
        counts = split_layers(len(model.layers), num_chunks, s.layer_split)
        starts = [sum(counts[:c]) for c in range(num_chunks)]
        parts = [
            pipeline_chunk(model, list(range(starts[c], starts[c] + counts[c])), c == 0, c == num_chunks - 1)
            for c in chunk_ids
        ]
        del model
    else:
        num_chunks, chunk_ids, parts = 1, [0], [model]
    # 1a. context parallel: attention and position tables learn this rank's place in the sequence
    # (after the pipeline split, which deep-copies the chunks: a SeqShard holds a process group).
    # Under tensor parallelism attention sees its mp rank's heads as plain local tensors (and,
    # with sequence parallelism, the cp rank's whole chunks, gathered by the q/k/v projections):
    # the cp group is the ranks of the same mp coordinate, so each mp rank's heads meet their own.
    sequence = apply_context_parallel(parts, mesh["cp"].get_group(), s.cp_method) if layout.cp > 1 else None
    # 1b. expert parallelism: each rank keeps its experts only (a DTensor shard, still on meta)
    ep_mesh = expert_mesh(layout, s.ep_degree, mesh.device_type) if s.ep_degree > 1 else None
    experts = [shard_experts(part, ep_mesh) if ep_mesh is not None else [] for part in parts]

    for i, part in enumerate(parts):
        part.to(memory_format=memory_format(cfg, device))  # on meta: the layout its shards inherit
        # 2. tensor parallel (Megatron plan; vocab-parallel embedding and LM head)
        if layout.mp > 1:
            parallelize_module(part, mesh["mp"], _existing(part, spec.tp_plan(s.sequence_parallel)))
            if engine != Engine.FSDP:  # (FSDP makes every parameter a DTensor itself)
                replicate_rest(part, mesh["mp"])
        # 3. activation checkpointing of each block
        if s.recompute != "none":
            apply_recompute(part, s.recompute)
        # 4. compile each block: after TP and AC, so one graph holds the block's DTensor ops and its
        # checkpointed region; before FSDP/DDP, whose hooks stay outside the graph
        if cfg.train.compile:
            compile_blocks(part)
        # 5. data parallel. FSDP shards meta parameters (each rank then allocates 1/n of them);
        # DDP broadcasts real values when it is built, so its part is allocated before.
        if engine != Engine.FSDP:
            allocate(part)
        if experts[i] and engine == Engine.DDP:
            keep_from_ddp(part, experts[i])  # reduced by ExpertGrads
        parts[i] = _data_parallel(part, cfg, mesh, engine, device, ep_mesh)
        if engine == Engine.FSDP:
            allocate(parts[i])

    pm = ParallelModel(parts, chunk_ids, num_chunks, engine, spec, sequence=sequence, expert_mesh=ep_mesh)
    if ep_mesh is not None and engine == Engine.DDP:  # (FSDP reduces the experts' gradients itself)
        pm.expert_grads = ExpertGrads(parts, ep_mesh, layout.dp)
    if layout.pp > 1:
        _build_pipeline(pm, cfg, mesh, device)
    return pm


def replicate_rest(part: nn.Module, mesh: DeviceMesh) -> None:
    """The parameters the tensor-parallel plan left whole -- a learned position embedding, the
    norms outside sequence parallelism, ERNIE's head transform -- as Replicate DTensors on the mp
    mesh, so that every parameter of the part is a DTensor (what torch's SequenceParallel does to
    the norms it takes). Plain tensors beside DTensors break every multi-tensor op over the
    gradients: fp16's GradScaler unscales them in one call per device and dtype, and failed at the
    first step of an mp job without FSDP ("got mixed torch.Tensor and DTensor").

    Each such module takes its tensor inputs as Replicate DTensors and hands back local tensors,
    so its neighbours see what they saw before. A replicated parameter computes on replicated
    inputs: the same local arithmetic as the plain module, with no communication in forward or
    backward (its gradient is whole on every mp rank, as before), so the losses and updates equal
    one process's exactly as much as before. (Unscaling per kind of tensor instead would keep
    the mixed model and patch one consumer; the next multi-tensor op would meet it again.)"""
    for module in list(part.modules()):
        own = list(module.named_parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for _, p in own):
            continue
        for name, p in own:
            replicated = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=p.requires_grad))
        if isinstance(module, GroupedExperts):
            # the routed experts compute on their local weights (models/moe.py `_local`): their
            # inputs (rows and int64 counts) stay plain
            continue
        # (the parameters are done above, this module's own only: distribute_module would visit
        # its submodules too)
        distribute_module(module, mesh, _leave, _inputs_replicated, _outputs_local)


def _leave(*_args) -> None:
    """distribute_module's partition_fn when the parameters are distributed already."""


def _inputs_replicated(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _outputs_local(_module: nn.Module, outputs, _mesh: DeviceMesh):
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def compile_blocks(part: nn.Module) -> None:
    """torch.compile every block of `part.layers`, in place (`Module.compile`: parameter and state-dict
    names stay those of eager). Per block rather than the whole model: the blocks are alike, so dynamo
    traces one and reuses its code for the others (the graph guards on the block's shapes, not on its
    parameters' identity: inline_inbuilt_nn_modules), and the embedding and head stay eager; fullgraph:
    a graph break inside a block is an error, not a silently slower run."""
    for block in part.layers.values():
        block.compile(fullgraph=True)


def memory_format(cfg: RunConfig, device: torch.device) -> torch.memory_format:
    """channels_last for convolutions in 16-bit on a GPU: tensor-core convolution kernels are NHWC,
    and NCHW tensors would be transposed around every one. (FSDP's flat shards return NCHW.)"""
    convolutional = family_of(cfg.model).convolutional
    if device.type == "cuda" and cfg.train.precision != "fp32" and convolutional:
        return torch.channels_last
    return torch.preserve_format


def _existing(module: nn.Module, plan: dict) -> dict:
    """Drop plan entries whose module this pipeline chunk does not hold (e.g. the head of stage 0),
    and keep a MoE block's MLP out of the plan (`_dense_mlps`)."""
    kept = {}
    for path, style in _dense_mlps(module, plan).items():
        head = path.split(".")[0]
        if getattr(module, head, None) is None:
            continue
        if "*" not in path:
            try:
                module.get_submodule(path)
            except AttributeError:
                continue
        elif head == "layers" and len(module.layers) == 0:
            continue
        kept[path] = style
    return kept


def _dense_mlps(module: nn.Module, plan: dict) -> dict:
    """The plan with its `layers.*.mlp…` entries for the dense blocks only, when `module` holds MoE
    blocks: a MoE layer (models/moe.py) runs whole on every mp rank -- its inputs plain, the tokens
    the same on every mp rank, its experts not split (config/rules/moe.py says why) -- so neither the
    dense MLP's column/row styles nor its input preparation may touch it."""
    layers = getattr(module, "layers", None)
    if layers is None or not any(isinstance(m, MoE) for m in module.modules()):
        return plan
    out = {}
    for path, style in plan.items():
        if not path.startswith("layers.*.mlp"):
            out[path] = style
            continue
        for name, block in layers.items():
            if not isinstance(getattr(block, "mlp", None), MoE):
                out[f"layers.{name}{path[len('layers.*') :]}"] = style
    return out


def _data_parallel(
    part: nn.Module,
    cfg: RunConfig,
    mesh: DeviceMesh,
    engine: Engine,
    device: torch.device,
    ep_mesh: DeviceMesh | None = None,
) -> nn.Module:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    if engine == Engine.NONE:
        return part
    if (
        engine == Engine.ZERO1
    ):  # no wrapper: runtime/zero1.py hooks the gradients (the optimizer is built later)
        return part
    if engine == Engine.DDP:
        group = process_group(mesh, Layout.of(cfg).grad_sync_dims(engine))
        # gradient_as_bucket_view: grads live in DDP's buckets, no second copy of the gradients
        return DistributedDataParallel(
            part,
            process_group=group,
            gradient_as_bucket_view=True,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    # FSDP2: shard each block, then the root (embedding, head). A pipelined chunk keeps its
    # parameters gathered across micro-batches (re-gathering per micro-batch would multiply traffic).
    layout = Layout.of(cfg)
    pipelined = layout.pp > 1
    reshard = reshard_after_forward(s.sharding_stage) and not pipelined
    precision = cfg.train.precision
    if len(layout.fsdp_shard_dims) > 1:
        process_group(mesh, layout.fsdp_shard_dims)  # flattens sharding × cp into the mesh's "sharding_cp"
    kwargs = {"mesh": mesh[layout.fsdp_dims]}
    if precision != "fp32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    if s.offload:
        # the default policy pins host memory (its copies to and from the device then run beside
        # the kernels), which needs an accelerator: not for a job on the CPU itself
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    if "mp_policy" in kwargs:
        # BatchNorm keeps fp32 parameters, in units of their own: FSDP casts a unit's parameters
        # but not its buffers, and batch_norm wants weight and running statistics in one dtype
        # (fp32 with a 16-bit input is what autocast runs too; cf. torchtitan#674)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False)
        for bn in [m for m in part.modules() if isinstance(m, BATCH_NORMS)]:
            fully_shard(bn, reshard_after_forward=reshard, **{**kwargs, "mp_policy": fp32})
    if ep_mesh is not None:  # the experts first: units of their own over "edp" (runtime/expert_parallel.py)
        rest = {k: v for k, v in kwargs.items() if k != "mesh"}
        fully_shard_experts(part, ep_mesh, layout.sharding * layout.dp, reshard_after_forward=reshard, **rest)
    degree = layout.sharding * layout.cp  # (the mesh's shard dim: dp replicates)
    for block in part.layers.values():
        # its routed experts along their rows where the experts are fewer than the ranks
        # (runtime/expert_parallel.py `expert_placement`)
        placement = expert_placement(block, degree) if ep_mesh is None else None
        fully_shard(block, reshard_after_forward=reshard, shard_placement_fn=placement, **kwargs)
    fully_shard(part, reshard_after_forward=reshard, **kwargs)
    return part


def _build_pipeline(pm: ParallelModel, cfg: RunConfig, mesh: DeviceMesh, device: torch.device) -> None:
    from torch.distributed import pipelining as P

    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    from fleetwise.runtime.pipeline_stage import make_stage

    group = mesh["pp"].get_group()
    # receive buffers for the micro-batches in flight only, reused (torch's stage: one per micro-batch)
    pm.stages = [
        make_stage(part, c, pm.num_chunks, device, group=group)
        for part, c in zip(pm.parts, pm.chunk_ids, strict=True)
    ]
    classes = {
        "GPipe": P.ScheduleGPipe,
        "1F1B": P.Schedule1F1B,
        "interleaved_1F1B": P.ScheduleInterleaved1F1B,
        "looped_BFS": P.ScheduleLoopedBFS,
        "interleaved_zero_bubble": P.ScheduleInterleavedZeroBubble,
        "ZBV_zero_bubble": P.ScheduleZBVZeroBubble,
    }
    cls = classes[s.schedule]
    n = cfg.train.accumulate_steps
    # scale_grads divides by the micro-batch count, so gradients are the mean over micro-batches
    # (the same objective as one process averaging the same micro-batches).
    # (ZeRO-1 accumulates gradients in its own buffers, out of the schedule's sight: it divides there)
    stage = pm.stages if s.schedule not in ("GPipe", "1F1B") else pm.stages[0]
    pm.schedule = cls(
        stage, n_microbatches=n, loss_fn=pm.pipeline_loss, scale_grads=pm.engine != Engine.ZERO1
    )
