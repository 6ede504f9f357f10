"""A corpus of invalid configs: each is rejected by `fleetwise train` with exit 2, the right
location, a message and a fix, no traceback, nothing spawned or written, and without hanging.

Table-driven so that it keeps growing with every new rule (target: >= 250 cases), including the
adversarial classes of issue 17: absurd sizes that used to hang the planner, inf/nan, more ranks
than the machine holds, names MLflow refuses, hydra.* overrides, unsafe server addresses; and of
issue 44: Hugging Face model directories, your own model (model=custom), every section's fields,
JSONL fine-tuning files, expert and context parallelism.
In-process (one Python for the corpus); a sample of 20 also runs as `fleetwise` processes, each
within 2 CPU-seconds (what an idle machine answers in), however loaded the machine is.
"""

import json
import signal
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO
from helpers.timing import LOADED_FACTOR, run_timed, timed_here

MYNET = REPO / "examples" / "mynet" / "my_conf"

HYB = ("strategy=hybrid",)
PP2 = ("strategy=hybrid", "strategy.pp_degree=2")

CASES = [
    # --- degrees and world size
    (("strategy.dp_degree=3",), "strategy"),
    (("strategy=sharding", "strategy.sharding_degree=3"), "strategy"),
    (("strategy=hybrid", "strategy.mp_degree=auto", "strategy.pp_degree=auto"), "strategy"),
    (("strategy=hybrid", "strategy.mp_degree=3"), "strategy.dp_degree"),
    (("strategy=hybrid", "strategy.dp_degree=2", "strategy.mp_degree=2", "strategy.pp_degree=4"), "strategy"),
    (("strategy=dp", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (
        ("strategy=mp", "strategy.pp_degree=2", "strategy.mp_degree=2", "strategy.dp_degree=2"),
        "strategy.pp_degree",
    ),
    (("strategy=pp", "strategy.sharding_degree=2"), "strategy.sharding_degree"),
    (("strategy.dp_degree=0",), "strategy.dp_degree"),
    (("strategy.dp_degree=x",), "strategy.dp_degree"),
    (("hardware.devices_per_node=0",), "hardware.devices_per_node"),
    (("hardware.nodes=0",), "hardware.nodes"),
    # --- tensor parallel
    (("strategy=mp", "strategy.mp_degree=8"), "strategy.mp_degree"),  # mp=8 does not divide 4 heads
    (
        (
            "strategy=mp",
            "strategy.mp_degree=4",
            "strategy.dp_degree=2",
            "model.ffn_hidden_size=258",
            "model.hidden_size=64",
        ),
        "strategy.mp_degree",
    ),
    (("recipe=resnet/tiny", "strategy=hybrid", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (("recipe=ctr/tiny", "strategy=hybrid", "strategy.mp_degree=2"), "strategy.mp_degree"),
    (("strategy=hybrid", "strategy.sequence_parallel=true"), "strategy.sequence_parallel"),
    (
        ("strategy=hybrid", "strategy.mp_degree=2", "strategy.sequence_parallel=true", "model.seq_len=33"),
        "strategy.sequence_parallel",
    ),
    (("model.hidden_size=66",), "model.hidden_size"),
    (("model.vocab_size=1",), "model.vocab_size"),
    (("model.num_attention_heads=0",), "model.num_attention_heads"),
    (("model.dropout=1.5",), "model.dropout"),
    # --- pipeline
    (("strategy=pp", "strategy.pp_degree=8"), "strategy.pp_degree"),
    (
        ("recipe=ctr/tiny", "strategy=pp", "strategy.pp_degree=2", "strategy.dp_degree=4"),
        "strategy.pp_degree",
    ),
    ((*PP2, "strategy.virtual_stages=2", "strategy.schedule=1F1B"), "strategy.schedule"),
    ((*PP2, "strategy.schedule=interleaved_1F1B"), "strategy.virtual_stages"),
    ((*PP2, "strategy.schedule=looped_BFS"), "strategy.virtual_stages"),
    (
        (
            "strategy=hybrid",
            "strategy.pp_degree=4",
            "strategy.virtual_stages=2",
            "strategy.schedule=interleaved_1F1B",
            "strategy.dp_degree=2",
        ),
        "strategy.pp_degree",
    ),
    ((*PP2, "model.num_layers=3"), "strategy.pp_degree"),
    ((*PP2, "strategy.layer_split=[1,2]"), "strategy.layer_split"),
    ((*PP2, "strategy.layer_split=[4]"), "strategy.layer_split"),
    (("strategy.layer_split=[2,2]",), "strategy.layer_split"),
    (("strategy.layer_split=[0,4]", *PP2), "strategy.layer_split.0"),
    (
        (
            *PP2,
            "strategy.virtual_stages=2",
            "strategy.schedule=interleaved_1F1B",
            "train.global_batch_size=24",
        ),
        "train.accumulate_steps",
    ),
    (("strategy=hybrid", "strategy.pp_degree=4", "train.global_batch_size=8"), "train.accumulate_steps"),
    (("strategy.virtual_stages=2",), "strategy.virtual_stages"),
    (
        (
            *PP2,
            "model.num_layers=6",
            "strategy.virtual_stages=3",
            "strategy.schedule=ZBV_zero_bubble",
            "train.global_batch_size=32",
        ),
        "strategy.virtual_stages",
    ),
    ((*PP2, "strategy.schedule=2F2B"), "strategy.schedule"),
    (("strategy.virtual_stages=0",), "strategy.virtual_stages"),
    # --- sharding, offload, recompute
    ((*HYB, "strategy.sharding_stage=2"), "strategy.sharding_stage"),
    ((*HYB, "strategy.sharding_degree=2"), "strategy.sharding_stage"),
    (("strategy=sharding", "strategy.sharding_stage=null"), "strategy.sharding_stage"),
    (("strategy=sharding", "strategy.sharding_stage=4"), "strategy.sharding_stage"),
    (("strategy.offload=true",), "strategy.offload"),
    (("strategy=sharding", "strategy.sharding_stage=1", "strategy.offload=true"), "strategy.offload"),
    (("strategy.recompute=some",), "strategy.recompute"),
    (("recipe=ctr/tiny", "strategy=dp", "strategy.recompute=full"), "strategy.recompute"),
    # --- parameter server
    (("strategy=ps",), "strategy.dense_fallback"),
    (("recipe=ctr/tiny", "strategy.max_staleness=2"), "strategy.max_staleness"),
    (("recipe=ctr/tiny", "strategy.num_trainers=3"), "train.global_batch_size"),
    (("recipe=ctr/tiny", "strategy.num_servers=0"), "strategy.num_servers"),
    (("recipe=ctr/tiny", "strategy.mode=eventual"), "strategy.mode"),
    (("recipe=ctr/tiny", "strategy.dispatch=random"), "strategy.dispatch"),
    (
        ("recipe=ctr/tiny", "model.sparse_tables=[{name:a,num_embeddings:5},{name:a,num_embeddings:6}]"),
        "model.sparse_tables",
    ),
    (("recipe=ctr/tiny", "model.sparse_tables=[]"), "model.sparse_tables"),
    # --- model families
    (("recipe=ernie/tiny", "model.mask_prob=0.01"), "model.mask_prob"),
    (("recipe=ernie/tiny", "model.masking=span"), "model.masking"),
    (("recipe=resnet/tiny", "model.image_size=16"), "model.image_size"),
    (("recipe=resnet/tiny", "model.layers=[1,1,1]"), "model.layers"),
    (("recipe=resnet/tiny", "model.block=dense"), "model.block"),
    # --- batch and precision
    (("train.global_batch_size=20",), "train.global_batch_size"),
    (("train.accumulate_steps=2",), "train.accumulate_steps"),
    (("train.micro_batch_size=32",), "train.micro_batch_size"),
    (("train.steps=0",), "train.steps"),
    (("train.precision=bf16",), "train.precision"),
    (("train.precision=fp16",), "train.precision"),
    (("train.precision=fp8",), "train.precision"),
    (("train.compile=maybe",), "train.compile"),
    (("recipe=ctr/tiny", "train.compile=true"), "train.compile"),  # ps trainers run eagerly
    (("recipe=ernie/ernie_base", "train.precision=bf16"), "train.precision"),
    (("hardware.backend=nccl",), "hardware.backend"),
    (("hardware.backend=mpi",), "hardware.backend"),
    # --- data
    (("data=token_file",), "data.path"),
    (("data=token_file", "data.path=/nonexistent/tokens.bin"), "data.path"),
    (("data=image_array", "data.path=/nonexistent.npz"), "data.source"),
    (("recipe=resnet/tiny", "data=image_folder", "data.path=/nonexistent"), "data.path"),
    (("data.source=csv",), "data.source"),
    # --- optimizer
    (("optim.warmup_steps=-1",), "optim.warmup_steps"),
    (("optim.betas=[0.9,1.5]",), "optim.betas"),
    (("optim.name=lion",), "optim.name"),
    (("optim.lr=0",), "optim.lr"),
    # --- launch, faults, checkpoints, tracking
    (("launch.nnodes=2",), "launch.nnodes"),
    (("launch.nnodes=abc",), "launch.nnodes"),
    (("launch.nnodes=2:1",), "launch.nnodes"),
    (("launch.node_rank=3",), "launch.node_rank"),
    (("launch.rdzv_endpoint=nohostport",), "launch.rdzv_endpoint"),
    (("fault.kill_rank=9", "fault.at_step=1"), "fault.kill_rank"),
    (("fault.kill_rank=1",), "fault.at_step"),
    (("fault.kill_rank=0", "fault.at_step=100"), "fault.at_step"),
    (("fault.mode=explode",), "fault.mode"),
    (("checkpoint.interval=5",), "checkpoint.interval"),
    (("checkpoint.resume=/nonexistent/ckpt",), "checkpoint.resume"),
    (("tracking.enabled=maybe",), "tracking.enabled"),
    (("plan.memory_check=maybe",), "plan.memory_check"),
    # --- memory: the plan does not fit
    (
        ("recipe=gpt/gpt3_175b", "strategy.pp_degree=4", "strategy.recompute=none"),
        "hardware.memory_per_device_gib",
    ),
    (("recipe=gpt/gpt3_6.7b", "strategy=dp", "strategy.mp_degree=1"), "hardware.memory_per_device_gib"),
    # --- absurd sizes: each used to hang validate/plan or allocate GiBs; bounded with a clear error
    (
        ("strategy=mp", "strategy.mp_degree=2", "strategy.dp_degree=4", "model.hidden_size=100000000001"),
        "model.hidden_size",
    ),
    (("model.hidden_size=100000000000",), "model.hidden_size"),
    (("model.num_layers=100000",), "model.num_layers"),
    (("model.ffn_hidden_size=100000000",), "model.ffn_hidden_size"),
    (("model.num_attention_heads=1000000",), "model.num_attention_heads"),
    (("model.vocab_size=10000000000",), "model.vocab_size"),
    (("model.seq_len=1000000000",), "model.seq_len"),
    (("hardware.nodes=10000000",), "hardware.nodes"),
    (("hardware.devices_per_node=1000000",), "hardware.devices_per_node"),
    (("hardware.nodes=65536", "hardware.devices_per_node=65536"), "hardware"),
    (
        (
            "strategy=hybrid",
            "strategy.pp_degree=4096",
            "hardware.devices_per_node=4096",
            "model.num_layers=4096",
            "train.global_batch_size=8192",
            "train.micro_batch_size=1",
        ),
        "strategy.pp_degree",
    ),
    (("strategy.virtual_stages=1000",), "strategy.virtual_stages"),
    (("train.global_batch_size=1000000000",), "train.global_batch_size"),
    (("train.accumulate_steps=1000000",), "train.accumulate_steps"),
    (("train.steps=10000000000000",), "train.steps"),
    (("train.micro_batch_size=100000000",), "train.micro_batch_size"),
    (("recipe=ctr/tiny", "strategy.num_servers=100000"), "strategy.num_servers"),
    (
        ("recipe=ctr/tiny", "strategy.num_trainers=100000", "train.global_batch_size=3200000"),
        "strategy.num_trainers",
    ),
    (
        ("recipe=ctr/tiny", "model.sparse_tables=[{name:a,num_embeddings:100000000000000}]"),
        "model.sparse_tables.0.num_embeddings",
    ),
    (("recipe=ctr/tiny", "model.embedding_dim=100000000"), "model.embedding_dim"),
    (("recipe=ctr/tiny", "model.mlp_hidden=[100000000]"), "model.mlp_hidden"),
    (("recipe=resnet/tiny", "model.layers=[5000,1,1,1]"), "model.layers"),
    (("recipe=resnet/tiny", "model.image_size=1000000"), "model.image_size"),
    (("launch.collective_timeout_s=100000000",), "launch.collective_timeout_s"),
    # --- non-finite numbers (inf/nan used to pass, then crash or print NaN into --json)
    (("optim.lr=inf",), "optim.lr"),
    (("optim.lr=nan",), "optim.lr"),
    (("optim.lr=-inf",), "optim.lr"),
    (("optim.eps=inf",), "optim.eps"),
    (("optim.weight_decay=inf",), "optim.weight_decay"),
    (("optim.grad_clip=inf",), "optim.grad_clip"),
    (("optim.min_lr_ratio=nan",), "optim.min_lr_ratio"),
    (("optim.betas=[0.9,nan]",), "optim.betas.1"),
    (("model.dropout=nan",), "model.dropout"),
    (("model.init_std=inf",), "model.init_std"),
    (("hardware.memory_per_device_gib=inf",), "hardware.memory_per_device_gib"),
    (("hardware.memory_per_device_gib=nan",), "hardware.memory_per_device_gib"),
    (("hardware.intra_node_gbps=inf",), "hardware.intra_node_gbps"),
    (("hardware.inter_node_gbps=nan",), "hardware.inter_node_gbps"),
    (("hardware.comm_latency_us=inf",), "hardware.comm_latency_us"),
    (("hardware.peak_tflops.fp32=inf",), "hardware.peak_tflops.fp32"),
    (("launch.collective_timeout_s=inf",), "launch.collective_timeout_s"),
    # --- finite but meaningless figures (1e308 GiB overflowed to a traceback; 1e-300 TFLOP/s planned)
    (("hardware.memory_per_device_gib=1e308",), "hardware.memory_per_device_gib"),
    (("hardware.memory_per_device_gib=1e-300",), "hardware.memory_per_device_gib"),
    (("hardware.device_overhead_gib=1e300",), "hardware.device_overhead_gib"),
    (("hardware.peak_tflops.fp32=1e-300",), "hardware.peak_tflops.fp32"),
    (("hardware.peak_tflops.bf16=1e300",), "hardware.peak_tflops.bf16"),
    (("hardware.intra_node_gbps=1e-320",), "hardware.intra_node_gbps"),
    (("hardware.inter_node_gbps=1e12",), "hardware.inter_node_gbps"),
    (("hardware.comm_latency_us=1e308",), "hardware.comm_latency_us"),
    (("hardware.elementwise_ns=1e200",), "hardware.elementwise_ns"),
    (("hardware.fsdp_us_per_tensor=1e300",), "hardware.fsdp_us_per_tensor"),
    # --- a yes/no value where a count is meant (train.steps=true ran one step)
    (("train.steps=true",), "train.steps"),
    (("hardware.nodes=true",), "hardware.nodes"),
    (("strategy=hybrid", "strategy.pp_degree=true"), "strategy.pp_degree"),
    (("model.hidden_size=false",), "model.hidden_size"),
    (("optim.lr=true",), "optim.lr"),
    (("launch.monitor_interval_s=nan",), "launch.monitor_interval_s"),
    (("recipe=ctr/tiny", "data.zipf_alpha=inf"), "data.zipf_alpha"),
    # --- more ranks than this machine holds (refused before spawning; launch.oversubscribe=true to force)
    (("hardware.devices_per_node=4096", "train.global_batch_size=8192"), "hardware.devices_per_node"),
    # --- names MLflow refuses at run time
    (("tracking.experiment=",), "tracking.experiment"),
    (("tracking.experiment='  '",), "tracking.experiment"),
    (("tracking.experiment=a/../b",), "tracking.experiment"),
    (("tracking.experiment=" + "x" * 501,), "tracking.experiment"),
    (("run.name=..",), "run.name"),
    (("run.name=" + "r" * 251,), "run.name"),
    # --- hydra.* overrides beyond the documented ones (callbacks instantiate any target at train time)
    (("+hydra.callbacks.x._target_=os.getcwd",), "hydra.callbacks.x._target_"),
    (("~hydra.callbacks.mlflow_sweep",), "hydra.callbacks.mlflow_sweep"),
    (("hydra.job.name=x",), "hydra.job.name"),
    (("++hydra.verbose=true",), "hydra.verbose"),
    (("hydra.output_subdir=null",), "hydra.output_subdir"),
    # other config trees only through --config-dir (file:///etc was scanned for 9 s; pkg:// imports)
    (("hydra.searchpath=[file:///etc]",), "hydra.searchpath"),
    (("hydra.searchpath=[pkg://os]",), "hydra.searchpath"),
    # --- parameter-server RPC address (it unpickles what it receives)
    (("recipe=ctr/tiny", "strategy.server_address=0.0.0.0"), "strategy.server_address"),
    (("recipe=ctr/tiny", "strategy.server_address=10.1.2.3"), "strategy.server_address"),
    (("recipe=ctr/tiny", "strategy.server_address='not an address'"), "strategy.server_address"),
    (
        ("recipe=ctr/tiny", "strategy.server_address='::'", "strategy.allow_remote_servers=true"),
        "strategy.server_address",
    ),
    # --- resuming from something that is not a checkpoint
    (("checkpoint.resume=/etc/passwd",), "checkpoint.resume"),
    (("checkpoint.resume=/etc",), "checkpoint.resume"),
    (("checkpoint.resume=/dev/null",), "checkpoint.resume"),
    # --- a recipe's layout with another size of machine: the error names the recipe
    (("recipe=gpt/gpt3_175b", "hardware.nodes=1"), "strategy.dp_degree"),
    # --- Hugging Face model directories (model.init_from; {hf}: the `hf_dirs` fixture's folder)
    (("recipe=llama/tiny", "model.init_from={hf}/empty"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/mistral"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/notjson"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/nofiles"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/truncated"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/badindex"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/llama", "model.hidden_size=128"), "model.hidden_size"),
    (("recipe=llama/tiny", "model.init_from={hf}/oddheads"), "model.num_kv_heads"),
    (("recipe=llama/tiny", "model.init_from={hf}/missing"), "model.init_from"),
    (("recipe=llama/tiny", "model.init_from={hf}/afile"), "model.init_from"),
    (
        ("recipe=llama/tiny", "model.init_from={hf}/llama", "strategy=hybrid", "strategy.mp_degree=3"),
        "strategy.dp_degree",
    ),
    # --- the llama family's own fields
    (("recipe=llama/tiny", "model.num_kv_heads=3"), "model.num_kv_heads"),
    (("recipe=llama/tiny", "model.hidden_size=60"), "model.hidden_size"),
    (("recipe=llama/tiny", "model.head_dim=7"), "model.head_dim"),
    (
        (
            "recipe=llama/tiny",
            "model.rope_scaling={rope_type:llama3,factor:8.0,low_freq_factor:4.0,high_freq_factor:1.0,"
            "original_max_position_embeddings:16}",
        ),
        "model.rope_scaling.high_freq_factor",
    ),
    (
        ("recipe=llama/tiny", "strategy=hybrid", "strategy.mp_degree=8", "strategy.dp_degree=1"),
        "strategy.mp_degree",
    ),
    (("recipe=llama/tiny", "model.tie_word_embeddings=true", *PP2), "strategy.pp_degree"),
    (("recipe=llama/tiny", "model.rope_theta=0"), "model.rope_theta"),
    (("recipe=llama/tiny", "model.rms_norm_eps=0"), "model.rms_norm_eps"),
    (("recipe=llama/tiny", "model.multiple_of=0"), "model.multiple_of"),
    (("recipe=llama/tiny", "model.ffn_dim_multiplier=-1"), "model.ffn_dim_multiplier"),
    (
        (
            "recipe=llama/tiny",
            "model.vocab_size=255",
            "strategy=mp",
            "strategy.mp_degree=2",
            "strategy.dp_degree=4",
        ),
        "strategy.mp_degree",
    ),
    (("recipe=llama/tiny", "model.intermediate_size=0"), "model.intermediate_size"),
    (("recipe=llama/tiny", "model.seq_len=0"), "model.seq_len"),
    # --- your own model (model=custom; {mynet}: the README's example config tree, examples/mynet)
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=nope.Net"), "model.module._target_"),
    (
        ("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=helpers.custom_models.NotAModule"),
        "model.module._target_",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "+model.module.bogus=1"), "model.module"),
    (
        ("--config-dir", "{mynet}", "recipe=mynet", "data.dataset._target_=nope.data.Set"),
        "data.dataset._target_",
    ),
    (
        (
            "--config-dir",
            "{mynet}",
            "recipe=mynet",
            "data.dataset._target_=helpers.custom_models.TupleItems",
            "~data.dataset.n",
        ),
        "data.dataset",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.label=z"), "model.label"),
    (
        (
            "--config-dir",
            "{mynet}",
            "recipe=mynet",
            "model.loss._target_=helpers.custom_models.per_sample_loss",
        ),
        "model.loss",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "+model.tp_plan.nope=rowwise"), "model.tp_plan.nope"),
    (("--config-dir", "{mynet}", "recipe=mynet", "+model.tp_plan.trunk=sideways"), "model.tp_plan.trunk"),
    (
        ("--config-dir", "{mynet}", "recipe=mynet", "strategy=mp", "strategy.mp_degree=2", "~model.tp_plan"),
        "strategy.mp_degree",
    ),
    (
        (
            "--config-dir",
            "{mynet}",
            "recipe=mynet",
            "strategy=mp",
            "strategy.mp_degree=3",
            "hardware.devices_per_node=3",
        ),
        "strategy.mp_degree",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.blocks=nope"), "model.blocks"),
    (
        ("--config-dir", "{mynet}", "recipe=mynet", "strategy=hybrid", "strategy.pp_degree=8"),
        "strategy.pp_degree",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=''"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=os.getcwd"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=torch.nn.Linear"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module._target_=mynet.net"), "model.module._target_"),
    (
        ("--config-dir", "{mynet}", "recipe=mynet", *HYB, "strategy.recompute=full", "model.blocks=null"),
        "strategy.recompute",
    ),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.inputs=[nope]"), "model.inputs"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.inputs=[x,x,x]"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.loss=null", "model.inputs=null"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "data.dataset=null"), "data.dataset"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module=null"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.loss._target_=nope.loss"), "model.loss._target_"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module.dim=-1"), "model.module"),
    (("--config-dir", "{mynet}", "recipe=mynet", "model.module.depth=0"), "model.blocks"),
    (("--config-dir", "{mynet}", "recipe=mynet", "data.dataset.n=0"), "data.dataset"),
    (("recipe=gpt/tiny", "data=custom"), "data.source"),
    # --- data sources
    (("recipe=llama/tiny", "data=token_file"), "data.path"),
    (("recipe=llama/tiny", "data=token_file", "data.path={hf}/missing.bin"), "data.path"),
    (("data=token_file", "data.path={hf}/afile"), "data.path"),
    (("recipe=resnet/tiny", "data=image_folder", "data.path={hf}/missing"), "data.path"),
    (("recipe=resnet/tiny", "data=image_array", "data.path={hf}/missing.npz"), "data.path"),
    (("data=image_folder",), "data.source"),
    # --- fine-tuning documents (data=jsonl; {hf}/bad.jsonl: a good line, a broken one, a wrong type)
    (("recipe=llama/tiny", "data=jsonl"), "data.path"),
    (("recipe=llama/tiny", "data=jsonl", "data.path={hf}/missing.jsonl"), "data.path"),
    (("recipe=llama/tiny", "data=jsonl", "data.path={hf}/bad.jsonl"), "data.path"),
    (("recipe=gpt/tiny", "data=jsonl", "data.path={hf}/bad.jsonl"), "data.source"),
    (
        ("recipe=llama/tiny", "data=jsonl", "data.path={hf}/bad.jsonl", "data.tokenizer={hf}/no.json"),
        "data.tokenizer",
    ),
    (("recipe=llama/tiny", "data=jsonl", "data.path={hf}/bad.jsonl", *PP2), "strategy.pp_degree"),
    # --- context parallelism
    ((*HYB, "strategy.cp_degree=3"), "model.seq_len"),
    (("strategy=dp", "strategy.cp_degree=2"), "strategy.cp_degree"),
    (("recipe=resnet/tiny", *HYB, "strategy.cp_degree=2", "strategy.dp_degree=4"), "strategy.cp_degree"),
    (("recipe=ctr/tiny", *HYB, "strategy.cp_degree=2", "strategy.dp_degree=4"), "strategy.cp_degree"),
    ((*HYB, "strategy.cp_degree=2", "strategy.dp_degree=4", "model.seq_len=30"), "model.seq_len"),
    (
        (*HYB, "strategy.cp_degree=8", "strategy.dp_degree=1", "strategy.cp_method=ulysses"),
        "model.num_attention_heads",
    ),
    (  # sequence parallelism splits each cp chunk over mp: seq_len divides by 2·cp·mp = 8
        (
            *HYB,
            "strategy.cp_degree=2",
            "strategy.mp_degree=2",
            "strategy.sequence_parallel=true",
            "strategy.dp_degree=2",
            "model.seq_len=36",
        ),
        "model.seq_len",
    ),
    ((*HYB, "strategy.cp_degree=2", "strategy.dp_degree=4", "train.compile=true"), "train.compile"),
    ((*HYB, "strategy.cp_degree=2", "strategy.dp_degree=4", "model.dropout=0.1"), "model.dropout"),
    (
        (*HYB, "strategy.cp_degree=2", "strategy.dp_degree=4", "strategy.cp_method=zigzag"),
        "strategy.cp_method",
    ),
    ((*HYB, "strategy.cp_degree=0"), "strategy.cp_degree"),
    (
        (
            *HYB,
            "strategy.cp_degree=2",
            "strategy.sharding_degree=4",
            "strategy.dp_degree=1",
            "strategy.sharding_stage=1",
        ),
        "strategy.sharding_stage",
    ),
    (
        ("recipe=llama/moe_tiny", *HYB, "strategy.cp_degree=2", "strategy.dp_degree=4"),
        "model.moe.num_experts",
    ),
    (
        (
            "recipe=llama/tiny",
            "data=jsonl",
            "data.path={hf}/bad.jsonl",
            *HYB,
            "strategy.cp_degree=2",
            "strategy.pp_degree=2",
            "strategy.dp_degree=2",
        ),
        "strategy.pp_degree",  # packed documents run under cp, not through a pipeline
    ),
    # --- expert parallelism
    (("strategy=dp", "strategy.ep_degree=2"), "strategy.ep_degree"),
    (("recipe=llama/moe_tiny", "strategy=dp", "strategy.ep_degree=3"), "model.moe.num_experts"),
    (("recipe=llama/moe_tiny", "strategy=dp", "strategy.ep_degree=16"), "strategy.ep_degree"),
    (
        ("recipe=llama/moe_tiny", "strategy=sharding", "strategy.sharding_stage=1", "strategy.ep_degree=2"),
        "strategy.sharding_stage",
    ),
    (
        (
            "recipe=llama/moe_tiny",
            "strategy=mp",
            "strategy.mp_degree=2",
            "strategy.sequence_parallel=true",
            "hardware.devices_per_node=2",
        ),
        "strategy.sequence_parallel",
    ),
    (
        (
            "recipe=llama/moe_tiny",
            "strategy=dp",
            "strategy.ep_degree=2",
            "train.precision=fp16",
            "hardware=a100",
        ),
        "train.precision",
    ),
    (("recipe=llama/moe_tiny", "strategy=dp", "strategy.ep_degree=0"), "strategy.ep_degree"),
    # --- the other sections' fields, one bad value each
    (("optim.lr=-1",), "optim.lr"),
    (("optim.momentum=1.5",), "optim.momentum"),
    (("train.log_interval=0",), "train.log_interval"),
    (("train.warmup_steps_excluded=-1",), "train.warmup_steps_excluded"),
    (("launch.node_rank=1",), "launch.node_rank"),
    (("launch.rdzv_endpoint=nohost",), "launch.rdzv_endpoint"),
    (("launch.max_restarts=-1",), "launch.max_restarts"),
    (("launch.rdzv_last_call_s=-1",), "launch.rdzv_last_call_s"),
    (("launch.monitor_interval_s=0",), "launch.monitor_interval_s"),
    (("checkpoint.interval=-1",), "checkpoint.interval"),
    (("checkpoint.keep=0",), "checkpoint.keep"),
    (("checkpoint.resume=maybe",), "checkpoint.resume"),
    (("tracking.tags={fleetwise.recipe:x}",), "tracking.tags"),
    (("tracking.tags={mlflow.user:x}",), "tracking.tags"),
    (("tracking.model_max_bytes=-1",), "tracking.model_max_bytes"),
    (("fault.kill_rank=99",), "fault.kill_rank"),
    (("fault.at_step=0", "fault.kill_rank=0"), "fault.at_step"),
    (("fault.on_nonfinite=ignore",), "fault.on_nonfinite"),
    (("auto.objective=cost",), "auto.objective"),
    (("auto.top_k=0",), "auto.top_k"),
    (("auto.headroom=1.5",), "auto.headroom"),
    (("auto.max_mp=0",), "auto.max_mp"),
    (("auto.max_cp=0",), "auto.max_cp"),
    (("hardware=h200", "hardware.nodes=0"), "hardware.nodes"),
    (("hardware.device_type=tpu",), "hardware.device_type"),
    (("hardware.fragmentation=1.5",), "hardware.fragmentation"),
    (("hardware.matmul_efficiency=2",), "hardware.matmul_efficiency"),
    (("hardware.co_run_slowdown=0.5",), "hardware.co_run_slowdown"),
    (("hardware.host_cores=0",), "hardware.host_cores"),
    (("run.overwrite=maybe",), "run.overwrite"),
    (("recipe=ctr/tiny", "model.embedding_dim=0"), "model.embedding_dim"),
    (("recipe=ernie/tiny", "model.hidden_size=66"), "model.hidden_size"),
    (("recipe=resnet/tiny", "model.layers=[0,1,1,1]"), "model.layers.0"),
    (("recipe=resnet/tiny", "model.num_classes=0"), "model.num_classes"),
    (("recipe=resnet/tiny", "model.image_size=3"), "model.image_size"),
    # --- Hydra-level: unknown keys, groups, options, syntax
    (("train.stepz=3",), "train.stepz"),
    (("+train.foo=1",), "train.foo"),
    (("strategy=foo",), "strategy"),
    (("recipe=gpt/huge",), "recipe"),
    (("strateg=dp",), "strateg"),
    (("train.steps=[1,",), "train.steps"),
]


def _validate(overrides):
    """What `fleetwise validate` reports (config problems + the memory check)."""
    from fleetwise.cli import preflight

    return preflight(list(overrides)).problems


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 250
    assert len({c[0] for c in CASES}) == len(CASES)


def test_a_figure_out_of_range_names_its_unit_and_bounds_and_a_yes_no_count_is_refused():
    (p,) = _validate(["hardware.memory_per_device_gib=1e308"])
    assert "GiB" in p.msg and "1e-06..100000 GiB" in p.msg and not p.msg.startswith("Value error")
    (p,) = _validate(["hardware.comm_latency_us=1e308"])
    assert "us" in p.msg and "0..1e+07" in p.msg
    (p,) = _validate(["train.steps=true"])
    assert "yes/no" in p.msg and p.hint == "set train.steps to a number"
    assert _validate(["hardware.comm_latency_us=0", "hardware.memory_per_device_gib=0.0085"]) == []
    # a yes/no where yes/no is meant stays accepted
    assert _validate(["train.compile=true"]) == []


def test_degree_product_error_names_all_four_degrees_and_the_world_size():
    (p,) = _validate(["strategy.dp_degree=3"])
    for word in ("sharding_degree(1)", "dp_degree(3)", "mp_degree(1)", "pp_degree(1)", "world_size(8)"):
        assert word in p.msg
    assert "strategy.dp_degree=8" in p.hint


def test_all_problems_are_reported_together():
    problems = _validate(
        [
            "strategy.dp_degree=3",
            "train.precision=bf16",
            "optim.betas=[0.9,1.5]",
            "train.stepz=1",
            "model.hidden_size=66",
        ]
    )
    assert {"strategy", "train.precision", "optim.betas", "train.stepz", "model.hidden_size"} <= {
        p.loc for p in problems
    }


def test_a_layer_split_hint_keeps_its_spaces_and_a_pastable_override():
    from helpers.config import compose

    _, problems = compose("strategy=hybrid", "strategy.pp_degree=8", "model.num_layers=12")
    (p,) = [p for p in problems if p.loc == "strategy.pp_degree"]
    assert p.hint == "choose a stage count dividing 12, or set strategy.layer_split=[2,2,2,2,1,1,1,1]"


def test_unknown_key_suggests_the_close_one():
    (p,) = _validate(["strategy.mp_degre=2"])
    assert p.loc == "strategy.mp_degre" and "Did you mean 'mp_degree'" in p.msg
    (p,) = _validate(["recipe=gpt/tinyy"])
    assert "gpt/tiny" in p.msg


def test_memory_problem_lists_numbers_and_remedies_and_can_be_waived():
    problems = _validate(["recipe=gpt/gpt3_175b", "strategy.pp_degree=4", "strategy.recompute=none"])
    (p,) = problems
    assert "GiB" in p.msg and "strategy.recompute=full" in p.hint and "plan.memory_check=warn" in p.hint
    assert (
        _validate(
            [
                "recipe=gpt/gpt3_175b",
                "strategy.pp_degree=4",
                "strategy.recompute=none",
                "plan.memory_check=warn",
            ]
        )
        == []
    )


HANG_S = 60  # a hang (what the absurd sizes used to cause) fails the case; the time itself is reported


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    """What the cases name: broken Hugging Face model directories (written by hand: config.json and
    bytes, no transformers), a plain file, and a derivation cache of the module's own."""
    root = tmp_path_factory.mktemp("corpus")
    hf = root / "hf"
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    configs = {
        "mistral": {"architectures": ["MistralForCausalLM"]},
        "llama": llama,  # no weights: what an explicit value disagrees with is its config.json
        "nofiles": llama,
        "truncated": llama,
        "badindex": llama,
        "oddheads": {**llama, "num_attention_heads": 7},
    }
    for name, config in configs.items():
        (hf / name).mkdir(parents=True)
        (hf / name / "config.json").write_text(json.dumps(config))
    (hf / "empty").mkdir()
    (hf / "notjson").mkdir()
    (hf / "notjson" / "config.json").write_text("{not json")
    (hf / "truncated" / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a')
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (hf / "badindex" / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "afile").write_text("not a directory\n")
    (hf / "bad.jsonl").write_text('{"text": "hello"}\nnot json\n{"prompt": 3, "response": "x"}\n')
    return {"hf": hf, "cache": root / "cache"}


def with_files(overrides, files) -> list[str]:
    return [o.replace("{hf}", str(files["hf"])).replace("{mynet}", str(MYNET)) for o in overrides]


@pytest.mark.parametrize("overrides,loc", CASES, ids=[" ".join(c[0])[:120] for c in CASES])
def test_train_refuses_it_with_exit_2_spawning_and_writing_nothing(
    overrides, loc, tmp_path, monkeypatch, capsys, corpus_files
):
    """Each case through `fleetwise train`: exit 2, the location named, every problem with a message
    and a fix, no traceback, no process started (Popen is forbidden), no run directory, Hydra
    output, or MLflow store written."""
    import subprocess

    from fleetwise import cli
    from fleetwise.config.paths import EXTRA_DIRS_ENV

    # --config-dir sets this for the process (the ranks inherit it): restored after the case
    monkeypatch.setenv(EXTRA_DIRS_ENV, "")
    monkeypatch.setenv("FLEETWISE_CACHE_DIR", str(corpus_files["cache"]))
    if "{mynet}" in overrides:
        monkeypatch.syspath_prepend(str(MYNET.parent.parent))  # examples/: `mynet` imports from there
    overrides = with_files(overrides, corpus_files)

    def forbidden(*args, **kwargs):
        raise AssertionError(f"a process was spawned for an invalid config: {args[:1]}")

    reported = []
    report = cli._report_invalid
    monkeypatch.setattr(
        cli,
        "_report_invalid",
        lambda problems, as_json: reported.extend(problems) or report(problems, as_json),
    )
    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    monkeypatch.chdir(tmp_path)

    def hung(signum, frame):
        raise TimeoutError(f"no answer within {HANG_S} s")

    torch_before = "torch" in sys.modules
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    try:
        with timed_here() as took:
            code = cli.main(["train", *overrides, f"run.dir={tmp_path / 'run'}"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert code == 2
    assert loc in [p.loc for p in reported], f"expected {loc}, got {reported}"
    assert all(p.msg and p.hint for p in reported), reported
    assert "Traceback" not in err and loc in " ".join(err.split())
    assert list(tmp_path.iterdir()) == []
    print(f"answered in {took}")
    # within what a `fleetwise` process is promised (the sample below), in this process; a custom
    # model's case that imported torch here first is held to it in the sample, beside `import torch`
    if torch_before or "torch" not in sys.modules:
        assert took.within(CLI_S), f"{took}: over {CLI_S} s ({LOADED_FACTOR}x on CPU time when busy)"


CLI_SAMPLE = CASES[:: len(CASES) // 20][:20]  # every group of the table, in the order it is written
CLI_S = 2.0  # an invalid config is answered within this at idle (issue 44); under load: helpers/timing.py


@pytest.mark.slow
def test_the_cli_answers_a_sample_within_two_seconds_at_idle(tmp_path, corpus_files):
    """20 cases of the corpus as `fleetwise train` processes (the user's view: interpreter, imports,
    Hydra, rules): exit 2, the location on stderr, no traceback; at idle (1-minute load below 0.5)
    each within CLI_S of wall and CPU time, else within LOADED_FACTOR x CLI_S of CPU time (user +
    system, the kernel's accounting of the child; helpers/timing.py). A custom model's problem is found by importing
    it, which imports torch: its budget adds what `import torch` costs, measured here beside it."""
    import os
    import sys

    exe = str(Path(sys.executable).parent / "fleetwise")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FLEETWISE_"))}
    env["FLEETWISE_CACHE_DIR"] = str(corpus_files["cache"])
    _, torch_import = run_timed([sys.executable, "-c", "import torch"], env=env, timeout=HANG_S)
    print(f"import torch: {torch_import}")
    slow = []
    for overrides, loc in CLI_SAMPLE:
        custom = "{mynet}" in overrides
        cwd = MYNET.parent.parent if custom else tmp_path
        cmd = [exe, "train", *with_files(overrides, corpus_files), f"run.dir={tmp_path / 'run'}"]
        r, took = run_timed(cmd, cwd=cwd, env=env, timeout=HANG_S)
        promise = CLI_S + (torch_import.cpu if custom else 0.0)
        assert r.returncode == 2 and loc in " ".join(r.stderr.split()), (overrides, r.stderr[-2000:])
        assert "Traceback" not in r.stderr + r.stdout
        print(f"{took} (promise {promise:.2f} s)  {' '.join(overrides)[:100]}")
        if not took.within(promise):
            slow.append(f"{took} (promise {promise:.2f} s): {' '.join(overrides)}")
    assert not (tmp_path / "run").exists()
    assert not slow, slow
