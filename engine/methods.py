"""The decoding methods' names: one definition for the round loop, the server and the command
lines (no torch, so a command line can offer them before anything heavy loads).

    ar       autoregressive: one target step a token
    linear   the DFlash drafter's chain of B-1 tokens, verified in one target pass
    ddtree   a best-first tree of the drafter's proposals within a node budget, verified at once
    auto     ddtree with each round's node count (0, plain decoding, to the budget as a cap)
             chosen for the batch by a cost model (engine/budgets.py); alone in `generate`, and
             under tensor parallelism, it is ddtree at the cap
"""

METHODS = ("ar", "linear", "ddtree", "auto")
TREE_METHODS = ("ddtree", "auto")  # those that verify a tree within `budget`
