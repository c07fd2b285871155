"""Text: tokenizer, chat template, incremental detokenization, stop strings.

The router owns text; workers see token ids only (docs/architecture.md).
"""
