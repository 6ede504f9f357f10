"""The parent side: what runs before and around the ranks, never inside one.

    preflight.py   compose, validate, plan and the memory fit (validate, plan, train, dryrun)
    train.py       `fleetwise train`: sweep points checked once, Hydra jobs, the job's MLflow run, summary
    launch.py      the run directory, torchrun, following rank 0, signals, the failure's root cause
    agent.py       torchrun for one node, its rendezvous stores on loopback
    calibrate.py   `fleetwise calibrate`: measure this machine, write a hardware profile

Code that runs inside a rank lives in fleetwise.runtime (the dry run's, in fleetwise.dryrun); what
crosses the boundary is fleetwise.rundir.
"""
