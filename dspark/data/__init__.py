"""Drafter training data: offline prompts (`prompt_sources`) and target-regenerated responses
(`regenerate`); `dspark data prompts|generate` (`cli`) runs both."""
