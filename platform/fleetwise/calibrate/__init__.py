"""`fleetwise calibrate`: measure this machine and write a hardware profile the planner can use."""
