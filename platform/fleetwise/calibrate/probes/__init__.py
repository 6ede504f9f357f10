"""The probes of `fleetwise calibrate`: what each measures is in machine.py's docstring."""
