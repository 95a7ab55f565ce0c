"""What a person runs: the command line (:mod:`.cli`), ``polykernel bench`` (:mod:`.bench`),
``polykernel tune`` (:mod:`.tune_cmd`), the demo (:mod:`.demo`) and its models (:mod:`.models`),
and their console and plotting helpers. Nothing below this package imports it."""
