"""Eval data: synthetic generators in the real formats (``make_synthetic``) and the resolver that finds
the real datasets in a local directory or a pre-filled HF cache and hashes the files read (``sources``)."""
