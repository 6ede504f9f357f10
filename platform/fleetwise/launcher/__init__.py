"""The parent side: what runs before and around the ranks, never inside one.

    preflight.py      compose, validate, plan and the memory fit (validate, plan, train, dryrun);
                      for train, what this machine and run.dir say (GPUs, room for the ranks, resume)
    sweeps.py         `fleetwise train`: every sweep point checked once, Hydra's app, one job per point
    job.py            one job on this node, start to end: run dir locked, ranks followed, summary
    torchrun.py       the torchrun command and the ranks' environment; start it, follow rank 0, stop it
    run_dir_guard.py  a run directory refused when another job's, locked for a job's life, cleared
    job_tracking.py   the job's MLflow run, owned by the launcher on node 0
    failure.py        the failure's root cause and report (cause first, peers' tracebacks folded)
    agent.py          torchrun for one node, its rendezvous stores on loopback
    agent_pool.py     warm agents: forked from a process with torch imported (FLEETWISE_AGENT_POOL; the tests)
    auto.py           strategy=auto: the layout search's outcome as overrides

Imports point one way, no cycle: sweeps → job → torchrun → failure, beside them preflight,
run_dir_guard and job_tracking. Code that runs inside a rank lives in fleetwise.runtime; what crosses
the boundary is fleetwise.rundir. `fleetwise dryrun` is fleetwise.dryrun, `fleetwise calibrate`
fleetwise.calibrate. A node's address, interface and rendezvous role (from the route to node 0)
is fleetwise.hostnet, which calibrate's inter-node probe uses too.
"""
