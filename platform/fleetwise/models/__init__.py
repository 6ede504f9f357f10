"""What the model families share: transformer blocks (`transformer`), layout-invariant
initialisation (`init`), pipeline chunking (`pipeline`), the tensor-parallel pieces both
transformer families use (`tp_plan`), and the contract every model obeys (`contract`).

Each family's own nn.Module lives with the family (`fleetwise.families.<name>.model`). Importing
this package (or `contract`) never imports torch; the other modules do.
"""
