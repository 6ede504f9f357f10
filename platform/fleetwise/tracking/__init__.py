"""MLflow tracking of fleetwise jobs.

    run_tracker.py  RunTracker (owned by the launcher), sync_run_dir, flatten_config, git_commit
    spool.py        metrics.jsonl (rank 0's per-step records) and tracking.json (what MLflow has)
    summary.py      end-of-run summary metrics
    store.py        tracking_uri(): the one store every command uses; MLflow client settings
    sweep.py        Hydra callback: a parent run per multirun, the comparison on it
    compare.py      run table and throughput/memory chart
    commands.py     fleetwise ui | compare | sync

Nothing here imports torch, and nothing imports mlflow at module level (it costs ~2.5 s).
"""
