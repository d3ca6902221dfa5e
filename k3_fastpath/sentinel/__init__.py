"""The trained K3-architecture sentinel (issue #19): task generators in the three eval formats
(``tasks``); tokenizer and training build on them."""
