"""Memory per device: what one pipeline rank holds at its peak, and which ranks to work out.

Sources: model states after ZeRO (Rajbhandari et al. 2020, section 3): fp32 params 4 B, grads 4 B,
optimizer k·4 B per parameter, divided by the sharding degree as each stage shards them; mapped
onto what FSDP2 / DDP / fleetwise's ZeRO-1 actually keep (config/engine.py). Activations:
Korthikanti et al. 2022 per-layer accounting, redone for this engine (plan/units.py), times the
micro-batches each pipeline schedule keeps in flight (plan/pipeline.py). The rest -- which
temporaries are alive together, when the peak is -- is measured in the dry run, and each term
says where.

    context.py      what one rank's memory depends on (`RankContext`), worked out once
    states.py       parameters, gradients, optimizer state; and at the optimizer step
    activations.py  saved activations, the short-lived peaks beside them, the batch
    buffers.py      pipeline receive buffers and the outputs a stage holds
    phases.py       the moments of a step, what is alive at each, and the peak
    ranks.py        one rank's memory from those; which ranks to work out; the worst
"""
