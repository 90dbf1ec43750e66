"""Text generation with a fitted causal language model: ``TextGenerator`` writes an answer for
every row of a DataFrame (docs/generation.md).

Layers inside, from low to high: ``settings`` and ``prompts`` (what to generate, checked on the
driver), ``engines`` (the plug-in registry and the request/completion types), one module per
engine (``hf_continuous``, ``hf_static``), ``rows`` (a Spark task's rows through an engine),
``resume`` (a long job written slice by slice) and ``generator`` (the Spark ML transformer).
"""
