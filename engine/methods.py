"""The decoding methods' names: one definition for the round loop, the server and the command
lines (no torch, so a command line can offer them before anything heavy loads).

    ar       autoregressive: one target step a token
    linear   the DFlash drafter's chain of B-1 tokens, verified in one target pass
    ddtree   a best-first tree of the drafter's proposals within a node budget, verified at once
"""

METHODS = ("ar", "linear", "ddtree")
