"""Tool calling: tool specs and choices, prompts, grammars for forced calls, output parsers."""
