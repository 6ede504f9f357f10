"""The parent side: what runs before and around the ranks, never inside one.

    preflight.py   compose, validate, plan and the memory fit (validate, plan, train, dryrun)
    train.py       `fleetwise train`: sweep points checked once, Hydra jobs, the job's MLflow run, summary
    launch.py      the run directory, torchrun, following rank 0, signals, the failure's root cause
    agent.py       torchrun for one node, its rendezvous stores on loopback
    dryrun.py      `fleetwise dryrun`: one fake-tensor process per simulated rank, planner beside it

Code that runs inside a rank lives in fleetwise.runtime; what crosses the boundary is
fleetwise.rundir; `fleetwise calibrate` is fleetwise.calibrate.
"""
