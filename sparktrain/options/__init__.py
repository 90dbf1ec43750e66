"""The estimators' and models' options, each declared once (:mod:`.declarations`).

From the declarations come the Spark ML ``Param`` classes with their ``get``/``set``
accessors (:mod:`.params`), the constructors' keywords (:mod:`.keywords`), the rank loops'
spec fields (:mod:`sparktrain.options.spec`) and the parameter table of docs/usage.md
(:mod:`.docs`). :mod:`.horovod` checks Horovod's params and maps the Petastorm ones.

This package imports nothing until a module of it is imported: the rank loops read the
declarations without ``pyspark.ml``.
"""
