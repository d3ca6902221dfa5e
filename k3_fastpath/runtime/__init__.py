"""Serving runtime around a model: sampler (``sampler.py``), batched generation (``generator.py``), and the
fast-path decode executor with its envelope and trace (``executor.py``, ``envelope.py``, ``trace.py``)."""
