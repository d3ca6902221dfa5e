"""Check implementations, one module per area; declarations live in registry.py."""
