"""Rules of `fleetwise dryrun`: what the dry run cannot simulate, refused before it starts.

They apply only to a dry run (`Context.dryrun`); `validate`, `plan` and `train` never see them.
The launch section's rules do not apply to a dry run (rules/launch.py): it starts no rendezvous.
"""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule


@rule
def dryrun_collective(ctx: Context) -> Iterator[Problem]:
    if ctx.dryrun and ctx.collective is None:
        yield Problem(
            "strategy",
            "dryrun simulates the collective runtime; strategy=ps runs on torch.distributed.rpc",
            "use `fleetwise plan` for a parameter-server job, or a collective strategy (dp, sharding, …)",
        )


@rule
def dryrun_eager(ctx: Context) -> Iterator[Problem]:
    if ctx.dryrun and ctx.cfg.train.compile:
        # dynamo refuses to trace under the dry run's counting dispatch mode (it would run the blocks
        # eagerly: a second path), and the FLOPs/bytes it counts per op are not visible inside a
        # compiled graph; refused rather than reported for a program the job would not run
        yield Problem(
            "train.compile",
            "dryrun cannot simulate train.compile=true: torch.compile does not trace under the dispatch "
            "mode that counts the dry run's FLOPs and collective bytes, and hides the ops inside its graphs",
            "dry-run the eager model (train.compile=false): the same parameters, gradients, optimizer state "
            "and saved activations; compiled blocks usually hold less (fused elementwise ops)",
        )
