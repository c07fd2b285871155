"""Structured output: grammars compiled against the tokenizer, applied as token masks."""
