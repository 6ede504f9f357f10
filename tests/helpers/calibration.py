"""A fixed calibration: what `fleetwise calibrate` could measure on a 2-core CPU machine, as the
keyword arguments of `Calibration` (no timing in the tests; each test checks the planner terms
these numbers feed)."""

MEASURED = dict(
    device_type="cpu",
    backend="gloo",
    cores=2,
    peak_flops={"fp32": 150e9},
    gemm_flops={"512": 150e9},
    single_thread_flops=80e9,
    matmul_efficiency=0.9,
    op_overhead_us=10.0,
    allreduce_latency_us=200.0,
    allreduce_gbps=1.5,
    memory_gib=16.0,
    gemm_curve={"1e5": 0.1, "1e7": 0.5, "1e9": 0.95},
    gemm_curve_one_thread={"1e5": 0.5, "1e7": 0.9, "1e9": 1.0},
    elementwise_ns=2.0,
    update_us_per_tensor=30.0,
    update_ns_per_param=1.0,
    dtensor_op_us=400.0,
    fsdp_us_per_tensor=300.0,
    pipeline_action_us=100.0,
    co_run_slowdown=1.5,
    conv_call_us=200.0,
    checkpoint_op_us=20.0,
    selective_checkpoint_op_us=50.0,
    zero_bubble_split_op_us=30.0,
    zero_bubble_split_ns_per_param=0.5,
)
