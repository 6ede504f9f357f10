"""`fleetwise calibrate`: measure this machine and write a hardware profile the planner can use.

    registry.py     one row per measured hardware constant: profile key, unit, defaults, meaning,
                    the probe that measures it, the planner term that charges it
    probes/         the measurements (torch), grouped by what they measure
    calibration.py  Calibration: what one run of the probes measured
    profile.py      the profile writer (every registry row) and the inter-node keys' update
    command.py      the command: options, probes, profile YAML, summary
"""
