"""What the eval-check tests share: gates that let every truncation and extraction failure through (k3-tiny's
random weights hit max_tokens on every answer; the paired gates are what those tests look at) and a quiet
``Output``."""

from __future__ import annotations

PERMISSIVE = """
defaults:
  alpha: 0.05
  min_relative_accuracy: 0.99
  min_accuracy_drop: 0.01
  max_relative_length_change: 0.10
  truncation: {max_rate: 1.0, max_increase: 0.02}
  extraction_failure: {max_rate: 1.0, max_increase: 0.02}
  increase_test: mcnemar
  bootstrap: {iters: 1000, confidence: 0.95}
"""


class QuietOut:
    """``verify.output.Output``'s ``note``, dropped."""

    def note(self, text: str) -> None:
        pass
