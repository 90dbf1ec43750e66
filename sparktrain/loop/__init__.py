"""Everything that runs inside a rank: the epoch protocol (:mod:`.epochs`), checkpoints
(:mod:`.checkpoint`), callbacks (:mod:`.callbacks`), and the two rank loops with their helpers:
torch (:mod:`.torch_loop`, ``torch_*``) and Keras (:mod:`.keras_loop`, ``keras_*``). The specs
a rank trains by are made with the options (:mod:`sparktrain.options.spec`).

Nothing here imports an estimator or ``pyspark.ml``: the driver builds a spec and a payload,
the launchers run a loop on every rank.
"""
